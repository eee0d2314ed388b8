"""An HTTP(S) origin: real nginx (Debian's) serving a folder on loopback, real ``p2pw`` processes.

nginx is started here as a process of its own (daemon off, its config, logs and pid in tmp_path, the
folder listed with ``autoindex_format json``) and ended by PID in teardown; its access log gives the bytes
each request sent.  Assertions are on bytes, exit codes and counts, never on time.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import same_tree
from test_fleet_get import get, publish, published_id, report, size_of, start_tracker

NGINX = "/usr/sbin/nginx"
pytestmark = [pytest.mark.skipif(not os.path.exists(NGINX), reason=f"{NGINX} is not installed (apt-get install "
                                                                    "nginx-light)"),
              *([pytest.mark.timeout(240)] if hasattr(pytest.mark, "timeout") else [])]


class Nginx:
    """nginx serving ``root`` at http://127.0.0.1:PORT/m/, listed as JSON, each request logged with its bytes."""

    def __init__(self, tmp_path, root):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tmp_path / "nginx"
        self.dir.mkdir()
        self.log = self.dir / "access.log"
        conf = self.dir / "nginx.conf"
        import pwd

        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""  # workers read tmp_path
        conf.write_text(f"""
daemon off; {user} pid {self.dir}/nginx.pid; error_log {self.dir}/error.log; worker_processes 1;
events {{ worker_connections 256; }}
http {{
  log_format bytes '$request_method $uri $status $body_bytes_sent "$http_range"';
  access_log {self.log} bytes;
  client_body_temp_path {self.dir}; proxy_temp_path {self.dir}; fastcgi_temp_path {self.dir};
  uwsgi_temp_path {self.dir}; scgi_temp_path {self.dir};
  server {{ listen 127.0.0.1:{self.port}; location /m/ {{ alias {root}/; autoindex on; autoindex_format json; }} }}
}}
""")
        self.popen = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(self.dir), "-e", str(self.dir / "error.log")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                break
            except OSError:
                assert self.popen.poll() is None and time.monotonic() < deadline, self.popen.stderr.read()
                time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/m/"

    def gets(self) -> list[tuple[str, int, int, str]]:
        """``(uri, status, body bytes, range)`` of each GET logged so far."""
        out = []
        for line in self.log.read_text().splitlines() if self.log.exists() else []:
            method, uri, status, sent, rng = line.split(" ", 4)
            if method == "GET":
                out.append((uri, int(status), int(sent), rng.strip('"')))
        return out

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@pytest.fixture
def nginx(tmp_path, model_dir):
    n = Nginx(tmp_path, model_dir)
    yield n
    n.close()


def file_bytes(nginx) -> int:
    """Bytes nginx sent of the model's files (listings left out)."""
    return sum(sent for uri, _, sent, _ in nginx.gets() if not uri.endswith("/"))


def test_three_hosts_get_the_folder_reading_it_about_once(procs, tmp_path, model_dir, nginx):
    _, port = start_tracker(procs, tmp_path)
    publish(port, nginx.url)
    before = file_bytes(nginx)
    hosts = [get(procs, nginx.url, port, tmp_path / f"h{k}", "--s3-range-size", "1MiB") for k in range(3)]
    for p in hosts:
        assert p.wait(120) == 0, p.output()
    for k in range(3):
        assert same_tree(model_dir, tmp_path / f"h{k}") == []
    read = file_bytes(nginx) - before
    assert read <= 1.5 * size_of(model_dir)
    assert sum(report(tmp_path / f"h{k}")["origin_bytes_read"] for k in range(3)) <= 1.5 * size_of(model_dir)
    assert all(status == 206 for uri, status, _, _ in nginx.gets()[-5:] if not uri.endswith("/"))


def test_a_single_file_url_and_a_host_without_the_origin_takes_it_from_peers(procs, tmp_path, model_dir, nginx):
    name = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))[0]
    url = nginx.url + name
    _, port = start_tracker(procs, tmp_path)
    mid = published_id(publish(port, url))
    reader = get(procs, url, port, tmp_path / "r")
    blind = get(procs, url, port, tmp_path / "b", "--model-id", mid, "--no-origin")  # trusts the id it is given
    assert reader.wait(120) == 0, reader.output()
    assert blind.wait(120) == 0, blind.output()
    for d in ("r", "b"):
        assert open(tmp_path / d / name, "rb").read() == open(model_dir / name, "rb").read()
    assert report(tmp_path / "b")["origin_bytes_read"] == 0


def test_a_file_changed_since_the_manifest_is_refused(procs, tmp_path, model_dir, nginx):
    from p2pweights.sources.httpstore import HttpCheckpoint
    from p2pweights.sources.objstore import ObjectChanged

    ckpt = HttpCheckpoint(nginx.url, 4, 1 << 20)
    m, read, _ = ckpt.build(256 << 10)
    assert read == sum(f["size"] for f in m.files) and all(f.get("etag") for f in m.files)
    big = max(m.files, key=lambda f: f["size"])
    path = model_dir / big["name"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    time.sleep(1.1)  # nginx's ETag is mtime-size: the next second's write changes it
    path.write_bytes(bytes(data))
    src = ckpt.source(m.files)
    view = memoryview(bytearray(big["size"]))
    with pytest.raises(ObjectChanged):
        src.s3.read(None, ckpt.keys[big["name"]], big["etag"], 0, view)
    with pytest.raises(ObjectChanged):  # a host opening the origin against the old manifest refuses it too
        HttpCheckpoint(nginx.url, 4, 1 << 20).check(m, "the manifest")
    src.close()
    assert bytes(view) == bytes(len(view))  # nothing of the new bytes written


def test_a_host_refuses_a_published_manifest_of_a_file_changed_since(procs, tmp_path, model_dir, nginx):
    _, port = start_tracker(procs, tmp_path)
    publish(port, nginx.url)
    name = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))[0]
    data = bytearray((model_dir / name).read_bytes())
    data[-1] ^= 0xFF
    time.sleep(1.1)  # nginx's ETag is mtime-size: the next second's write changes it
    (model_dir / name).write_bytes(bytes(data))
    p = get(procs, nginx.url, port, tmp_path / "h")
    assert p.wait(120) == 1, p.output()
    errors = [line for line in p.output().splitlines() if line.startswith("p2pw: error:")]
    assert len(errors) == 1 and "describes the origin" in errors[0], p.output()
    assert not os.path.exists(tmp_path / "h" / name)


def test_a_seeder_serves_an_http_folder_with_each_file_s_validator(model_dir, nginx):
    from p2pweights.api import seed
    from p2pweights.sources.chunker import build

    s = seed(nginx.url, port=0, host="127.0.0.1")
    try:
        local, _, _ = build(str(model_dir), s.manifest.chunk_size)
        assert s.manifest.chunks == local.chunks and [f["name"] for f in s.manifest.files] == [
            f["name"] for f in local.files]
        assert all(f.get("etag") for f in s.manifest.files)
    finally:
        s.close()
