"""Seeding from object storage: s3:// against a real S3 API server (moto) on loopback.

A sharded checkpoint uploaded to the server is seeded straight from s3:// and
reaches real ``p2pw join`` processes byte-identical to the local files, with
storage read once.  Faults come from the server itself (missing bucket or
object, access denied, a changed object refused by If-Match) or from a small
HTTP proxy in front of it that answers 503 SlowDown or cuts the body mid-way
for the first GETs.
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import ROOT, free_port, p2pw_argv, same_tree

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

from p2pweights.sources.chunker import build  # noqa: E402
from p2pweights.sources.manifest import Manifest  # noqa: E402
from p2pweights.sources.objstore import Retry  # noqa: E402

CREDS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
SHARD = "model-00002-of-00003.safetensors"


class MotoServer:
    """``moto_server`` as a subprocess on a free loopback port."""

    def __init__(self, **env):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.popen = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, env=dict(os.environ, **CREDS, **env))
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.popen.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise AssertionError("moto_server did not start")
                time.sleep(0.1)

    def client(self, service="s3", **kw):
        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1",
                            **{"aws_access_key_id": "test", "aws_secret_access_key": "test", **kw})

    def close(self):
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    try:
        yield server
    finally:
        server.close()


def s3_env(endpoint: str) -> dict:
    return {**CREDS, "AWS_ENDPOINT_URL": endpoint, "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def upload(client, root, bucket: str, prefix: str) -> None:
    client.create_bucket(Bucket=bucket)
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            client.upload_file(full, bucket, prefix + os.path.relpath(full, root).replace(os.sep, "/"))


@pytest.fixture
def bucket(moto, model_dir):
    """A fresh bucket holding ``model_dir`` under ``model/``."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    upload(moto.client(), model_dir, name, "model/")
    return name


def size_of(root) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root) for n in names)


def run(*args, env=None, timeout=60):
    return subprocess.run(p2pw_argv(*args), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


def one_error_line(r) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("p2pw: error:"), r.stderr
    return lines[0]


def broadcast(procs, tmp_path, source, peers, env, *extra):
    """Seed ``source`` until ``peers`` joiners are done; their reports and the seeder's."""
    seeder, info = procs.seeder(source, "--chunk-size", "1MiB", "--exit-after", peers,
                                "--report", tmp_path / "seed.json", *extra, env=env)
    joins = [procs.join(info["port"], tmp_path / f"peer{k}", "--model-id", info["model_id"]) for k in range(peers)]
    for j in joins:
        assert j.wait(90) == 0, j.output()
    assert seeder.wait(30) == 0, seeder.output()
    return json.loads((tmp_path / "seed.json").read_text()), seeder


def test_seed_from_s3_reaches_three_peers(procs, tmp_path, moto, bucket, model_dir):
    report, _ = broadcast(procs, tmp_path, f"s3://{bucket}/model", 3, s3_env(moto.url))
    for k in range(3):
        assert same_tree(model_dir, tmp_path / f"peer{k}") == []
    assert report["bytes_read"] == size_of(model_dir)  # every byte of the bucket read once
    assert report["s3_retries"] == 0
    assert report["total_size"] == build(model_dir, 1 << 20)[0].total_size


def test_manifest_published_ahead_serves_at_once(procs, tmp_path, moto, bucket, model_dir):
    env = s3_env(moto.url)
    r = run("manifest", f"s3://{bucket}/model/", "--chunk-size", "1MiB", "-o", tmp_path / "m.json", env=env)
    assert r.returncode == 0, r.stderr
    m = Manifest.from_json((tmp_path / "m.json").read_text())
    local, _, _ = build(model_dir, 1 << 20)
    assert m.chunks == local.chunks and m.tensors == local.tensors  # the same blob and tensor index
    etags = {o["Key"][len("model/"):]: o["ETag"].strip('"')
             for o in moto.client().list_objects_v2(Bucket=bucket, Prefix="model/")["Contents"]}
    assert [(f["name"], f["offset"], f["size"], f["etag"]) for f in m.files] == [
        (f["name"], f["offset"], f["size"], etags[f["name"]]) for f in local.files]
    assert all("etag" not in f for f in local.files)  # a local checkpoint's model id is unchanged

    report, seeder = broadcast(procs, tmp_path, f"s3://{bucket}/model", 1, env, "--manifest", tmp_path / "m.json")
    assert "manifest known" in seeder.output()
    assert report["model_id"] == m.model_id
    assert same_tree(model_dir, tmp_path / "peer0") == []
    assert report["bytes_read"] == size_of(model_dir)


def test_one_object(tmp_path, moto, bucket, model_dir):
    r = run("manifest", f"s3://{bucket}/model/{SHARD}", "--chunk-size", "256KiB", env=s3_env(moto.url))
    assert r.returncode == 0, r.stderr
    m = Manifest.from_json(r.stdout)
    local, _, _ = build(model_dir / SHARD, 256 << 10)
    assert [f["name"] for f in m.files] == [SHARD]
    assert m.chunks == local.chunks and m.tensors == local.tensors


class FaultProxy:
    """An HTTP proxy in front of the S3 server that spoils the first ranged GETs, one per entry of ``faults``:
    "slowdown" answers 503 SlowDown, "drop" sends the headers and half the body, then cuts the connection."""

    SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b'<Message>Please reduce your request rate.</Message></Error>')

    def __init__(self, upstream_port: int, faults: list[str]):
        self.faults, self.injected, self.lock = list(faults), [], threading.Lock()
        self.gets: list[tuple[str, str, str | None]] = []  # (path, Range, fault) of each ranged GET, in order
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_request(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                fault = proxy.take(self.path, self.headers.get("Range")) if self.command == "GET" else None
                if fault == "slowdown":
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(proxy.SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(proxy.SLOWDOWN)
                    return
                up = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                try:
                    up.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    resp = up.getresponse()
                    data = resp.read()
                finally:
                    up.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "server", "date") and (
                            k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "drop":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_request

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, path: str, ranged: str | None) -> str | None:
        if ranged is None:
            return None
        with self.lock:
            fault = self.faults.pop(0) if self.faults else None
            if fault:
                self.injected.append(fault)
            self.gets.append((path, ranged, fault))
            return fault

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def faulty(moto):
    proxies = []

    def make(faults):
        proxies.append(FaultProxy(moto.port, faults))
        return proxies[-1]

    try:
        yield make
    finally:
        for p in proxies:
            p.close()


def test_throttled_and_dropped_gets_resume_where_they_stopped(procs, tmp_path, bucket, model_dir, faulty):
    proxy = faulty(["slowdown", "drop", "slowdown", "drop", "drop", "slowdown"])
    report, seeder = broadcast(procs, tmp_path, f"s3://{bucket}/model", 1, s3_env(proxy.url),
                               "--s3-range-size", "1MiB", "--s3-concurrency", "4")
    assert proxy.injected == ["slowdown", "drop", "slowdown", "drop", "drop", "slowdown"]
    assert same_tree(model_dir, tmp_path / "peer0") == []
    assert report["s3_retries"] == 6
    assert report["bytes_read"] == size_of(model_dir)  # nothing landed twice
    # each GET cut mid-body was resumed with a GET from the byte where it stopped, to the same end
    for i, (path, ranged, fault) in enumerate(proxy.gets):
        if fault == "drop":
            lo, hi = map(int, ranged.removeprefix("bytes=").split("-"))
            later = [tuple(map(int, r.removeprefix("bytes=").split("-"))) for p, r, _ in proxy.gets[i + 1:]
                     if p == path]
            assert any(lo < a <= hi and b == hi for a, b in later), (ranged, later)


def test_consecutive_chunks_are_read_with_one_ranged_get(procs, tmp_path, moto, bucket, model_dir, faulty):
    """A seeder serving a published manifest reads runs of consecutive chunks, one ranged GET of at most
    --s3-range-size each: fewer GETs than chunks, every byte of the bucket once, every chunk still verified."""
    r = run("manifest", f"s3://{bucket}/model/", "--chunk-size", "256KiB", "-o", tmp_path / "m.json",
            env=s3_env(moto.url))
    assert r.returncode == 0, r.stderr
    chunks = Manifest.from_json((tmp_path / "m.json").read_text()).n_chunks
    proxy = faulty([])  # records every ranged GET
    report, _ = broadcast(procs, tmp_path, f"s3://{bucket}/model", 1, s3_env(proxy.url), "--manifest",
                          tmp_path / "m.json", "--s3-range-size", "1MiB")
    assert same_tree(model_dir, tmp_path / "peer0") == []
    assert report["bytes_read"] == size_of(model_dir)
    spans = [(path, *map(int, rng.removeprefix("bytes=").split("-"))) for path, rng, _ in proxy.gets]
    assert len(spans) == len(set(spans)) and sum(b - a + 1 for _, a, b in spans) == size_of(model_dir)
    assert all(b - a + 1 <= 1 << 20 for _, a, b in spans)
    assert len(spans) <= chunks // 2, (len(spans), chunks)


def test_a_run_yields_each_chunk_as_its_bytes_land(tmp_path, moto, bucket, model_dir, monkeypatch):
    """A run's chunks are verified and handed on while its ranged GET still streams (the GET's bytes are counted
    when it ends), each once, byte-identical to the files, a chunk that fails its hash reported as such."""
    from p2pweights.sources.manifest import chunk_hasher
    from p2pweights.sources.objstore import S3Checkpoint

    for k, v in s3_env(moto.url).items():
        monkeypatch.setenv(k, v)
    ckpt = S3Checkpoint(f"s3://{bucket}/model", range_size=1 << 20)
    m, _, _ = ckpt.build(chunk_size=128 << 10)
    local, _, _ = build(model_dir, 128 << 10)
    assert m.chunks == local.chunks
    source = ckpt.source(m.files)
    try:
        def in_one_object(r):
            lo, hi = m.chunk_span(r[0])[0], m.chunk_span(r[-1])[1]
            return any(f["offset"] <= lo and hi <= f["offset"] + f["size"] for f in m.files)

        run_ = next(r for r in source.runs(m, range(m.n_chunks)) if len(r) >= 4 and in_one_object(r))  # one GET
        bufs = {i: bytearray(m.chunk_size) for i in run_}
        counted, seen = [], []

        def emit(i, ok):
            counted.append(source.bytes_read)
            seen.append((i, ok))

        before = source.bytes_read
        m.chunks[run_[2]] = b"\0" * len(m.chunks[run_[2]])  # as if the chunk had changed since the manifest
        source.read_run(m, run_, lambda i: memoryview(bufs[i])[: m.chunk_span(i)[1] - m.chunk_span(i)[0]],
                        chunk_hasher(m.hash), emit)
        assert [i for i, _ in seen] == run_ and [ok for _, ok in seen] == [i != run_[2] for i in run_]
        assert counted[0] == before  # the first chunk went on before the GET had ended
        blob = bytearray(m.total_size)
        from p2pweights.sources.source import BlobSource
        BlobSource(model_dir, local.files).read_into(0, memoryview(blob))
        for i in run_:
            lo, hi = m.chunk_span(i)
            assert bytes(bufs[i][: hi - lo]) == bytes(blob[lo:hi])

        # read straight into one buffer holding the whole blob (a seeder's store): the same, with no copy
        whole, seen[:], counted[:] = memoryview(bytearray(m.total_size)), [], []
        before = source.bytes_read
        source.read_run(m, run_, lambda i: whole[m.chunk_span(i)[0]: m.chunk_span(i)[1]], chunk_hasher(m.hash),
                        emit, span_of=lambda lo, hi: whole[lo:hi])
        assert [i for i, _ in seen] == run_ and [ok for _, ok in seen] == [i != run_[2] for i in run_]
        assert counted[0] == before
        lo, hi = m.chunk_span(run_[0])[0], m.chunk_span(run_[-1])[1]
        assert bytes(whole[lo:hi]) == bytes(blob[lo:hi])
    finally:
        source.close()


def test_object_changed_before_serving_is_refused(tmp_path, moto, bucket):
    env = s3_env(moto.url)
    assert run("manifest", f"s3://{bucket}/model", "-o", tmp_path / "m.json", env=env).returncode == 0
    client = moto.client()
    body = client.get_object(Bucket=bucket, Key=f"model/{SHARD}")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"model/{SHARD}", Body=body[:-1] + bytes([body[-1] ^ 1]))
    line = one_error_line(run("seed", f"s3://{bucket}/model", "--port", "0", "--manifest", tmp_path / "m.json",
                              env=env))
    assert f"s3://{bucket}/model/{SHARD} changed since" in line and "ETag" in line


def test_object_changed_while_serving_is_reported_and_never_served(procs, tmp_path, moto, bucket, model_dir):
    env = s3_env(moto.url)
    assert run("manifest", f"s3://{bucket}/model", "--chunk-size", "1MiB", "-o", tmp_path / "m.json",
               env=env).returncode == 0
    m = Manifest.from_json((tmp_path / "m.json").read_text())
    seeder, info = procs.seeder(f"s3://{bucket}/model", "--manifest", tmp_path / "m.json", env=env)
    client = moto.client()  # changed after the seeder started, before any peer asked for it
    body = (model_dir / SHARD).read_bytes()
    changed = bytes(b ^ 0x5A for b in body)
    client.put_object(Bucket=bucket, Key=f"model/{SHARD}", Body=changed)
    peer = procs.join(info["port"], tmp_path / "peer")
    seeder.wait_line(f"s3://{bucket}/model/{SHARD} changed: its ETag is no longer the one recorded", timeout=60)
    seeder.wait_line("not serving it", timeout=60)
    # every other file arrives whole; the changed object's bytes never reach the peer
    f = next(f for f in m.files if f["name"] == SHARD)
    others = [g for g in m.files if g["name"] != SHARD
              and not {*m.chunks_covering(g["offset"], g["offset"] + g["size"])}
              & {*m.chunks_covering(f["offset"], f["offset"] + f["size"])}]
    assert others
    deadline = time.monotonic() + 60
    while True:
        # each of them final as soon as it is complete (until then NAME.partial)
        have = [tmp_path / "peer" / g["name"] for g in others]
        if all(p.exists() and p.read_bytes() == (model_dir / g["name"]).read_bytes() for p, g in zip(have, others)):
            break
        assert time.monotonic() < deadline, peer.output()
        time.sleep(0.2)
    partial = (tmp_path / "peer" / (SHARD + ".partial")).read_bytes()
    assert not (tmp_path / "peer" / SHARD).exists()
    assert all(partial[i: i + 4096] != changed[i: i + 4096] for i in range(0, len(changed), 4096))
    assert peer.popen.poll() is None  # still waiting: nothing false was presented as complete


def test_missing_bucket_or_object_gives_one_error_line(moto, bucket):
    env = s3_env(moto.url)
    line = one_error_line(run("seed", "s3://no-such-bucket-p2pw/model", "--port", "0", env=env))
    assert "s3://no-such-bucket-p2pw/model: no such bucket" in line
    line = one_error_line(run("manifest", f"s3://{bucket}/nothing-here", env=env))
    assert f"s3://{bucket}/nothing-here: no such object" in line
    line = one_error_line(run("seed", "s3://", "--port", "0", env=env))
    assert "expected s3://BUCKET/PREFIX" in line


def test_credentials_and_endpoint_from_a_profile(tmp_path, moto, bucket, model_dir):
    (tmp_path / "config").write_text(f"[profile ckpt]\nregion = us-east-1\nendpoint_url = {moto.url}\n")
    (tmp_path / "credentials").write_text("[ckpt]\naws_access_key_id = test\naws_secret_access_key = test\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_PROFILE="ckpt", AWS_CONFIG_FILE=str(tmp_path / "config"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"), AWS_EC2_METADATA_DISABLED="true")
    r = subprocess.run(p2pw_argv("manifest", f"s3://{bucket}/model", "--chunk-size", "1MiB"), capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert Manifest.from_json(r.stdout).chunks == build(model_dir, 1 << 20)[0].chunks


def test_no_credentials_or_no_boto3_gives_one_error_line(moto, bucket):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=moto.url, AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_EC2_METADATA_DISABLED="true")
    r = subprocess.run(p2pw_argv("manifest", f"s3://{bucket}/model"), capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=env)
    assert "no AWS credentials found" in one_error_line(r)
    code = "import sys; sys.modules['boto3'] = None; from p2pweights.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "manifest", f"s3://{bucket}/model"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env=dict(os.environ, **s3_env(moto.url)))
    assert "pip install 'p2pweights[s3]'" in one_error_line(r)


def test_access_denied_gives_one_error_line(model_dir):
    server = MotoServer(INITIAL_NO_AUTH_ACTION_COUNT="4")  # then every request is authenticated and authorized
    try:
        iam = server.client("iam")
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]  # no policy: may do nothing
        s3 = server.client()
        s3.create_bucket(Bucket="ckpt-denied")
        s3.put_object(Bucket="ckpt-denied", Key="model/config.json", Body=b"{}")
        env = {**s3_env(server.url), "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        for args in (("seed", "s3://ckpt-denied/model", "--port", "0"),
                     ("manifest", "s3://ckpt-denied/model/config.json")):
            line = one_error_line(run(*args, env=env))
            assert "access denied" in line, line
    finally:
        server.close()


def test_local_seeder_never_imports_the_s3_client(model_dir):
    code = ("import sys; from p2pweights.api import seed; s = seed(sys.argv[1], port=0, host='127.0.0.1'); "
            "s.close(); print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore') "
            "or m == 'p2pweights.sources.objstore'))")
    r = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_retry_backs_off_and_gives_up():
    slept = []
    retry = Retry(attempts=4, base=0.1, cap=0.3, sleep=slept.append, random=lambda: 1.0)
    assert [retry.wait(k) for k in (1, 2, 3, 4)] == [True, True, True, False]
    assert slept == [0.1, 0.2, 0.3]  # doubling, capped; the fourth failure in a row gives up
    low = Retry(base=0.1, random=lambda: 0.0)
    assert low.delay(1) == 0.05 and low.delay(3) == 0.2  # jitter keeps at least half the backoff
