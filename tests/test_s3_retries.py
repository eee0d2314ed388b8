"""Bounded S3 retries: an S3 server on loopback that sends a little of each ranged GET and drops the connection.

Every GET makes progress, so failures in a row never add up; the tries of one range and its deadline do, and
then one error line names the object and the range.  The server answers 403 once it has seen ``GIVE_UP`` GETs,
so a client that retried for ever ends with 'access denied' instead of hanging."""
import os
import socket
import subprocess
import threading

import pytest

from conftest import ROOT, p2pw_argv

pytest.importorskip("boto3")

from p2pweights.sources.objstore import DEFAULT_TRIES, S3, Retry, RetriesSpent  # noqa: E402

SIZE = 5000  # bytes of the one object
LITTLE = 10  # bytes sent of each ranged GET before the connection drops
GIVE_UP = 200  # GETs after which the server answers 403: far more than any bound allows
CREDS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
         "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
          b'<Message>Access Denied</Message></Error>')


def pattern(offset: int, n: int) -> bytes:
    """The object's bytes [offset, offset + n)."""
    return bytes((offset + i) % 251 for i in range(n))


class DroppingS3:
    """A raw-socket HTTP server: HEAD of any object answers ``SIZE`` bytes; a ranged GET gets its headers and
    ``LITTLE`` bytes of the body, then the connection is closed."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.ranges: list[str] = []  # the Range of each GET, in order
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    pass

    def _answer(self, conn):
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(65536)
            if not data:
                return
            head += data
        lines = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        method = lines[0].split(" ")[0]
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if method == "HEAD":
            conn.sendall(f'HTTP/1.1 200 OK\r\nContent-Length: {SIZE}\r\nETag: "e7a9"\r\n'
                         f"Last-Modified: Mon, 01 Jan 2024 00:00:00 GMT\r\nConnection: close\r\n\r\n".encode())
            return
        self.ranges.append(headers.get("range", ""))
        if len(self.ranges) > GIVE_UP:
            conn.sendall(f"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: {len(DENIED)}"
                         f"\r\nConnection: close\r\n\r\n".encode() + DENIED)
            return
        lo, hi = map(int, headers["range"].removeprefix("bytes=").split("-"))
        conn.sendall(f'HTTP/1.1 206 Partial Content\r\nContent-Length: {hi - lo + 1}\r\nETag: "e7a9"\r\n'
                     f"Content-Range: bytes {lo}-{hi}/{SIZE}\r\nConnection: close\r\n\r\n".encode()
                     + pattern(lo, LITTLE))

    def close(self):
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self.listener.close()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def dropping():
    server = DroppingS3()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_a_server_that_sends_a_little_and_drops_ends_in_one_error_line(dropping, tmp_path):
    env = dict(os.environ, **CREDS, AWS_ENDPOINT_URL=dropping.url, P2PW_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run(p2pw_argv("manifest", "s3://ckpt/w.bin"), capture_output=True, text=True, timeout=110,
                       cwd=ROOT, env=env)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"p2pw: error: s3://ckpt/w.bin bytes 0-{SIZE - 1}: gave up after {DEFAULT_TRIES} tries"), r.stderr
    # each try resumed from the byte where the last one stopped, and the tries stopped at the bound
    assert dropping.ranges == [f"bytes={k * LITTLE}-{SIZE - 1}" for k in range(DEFAULT_TRIES)]


@pytest.mark.timeout(60)
def test_a_range_is_given_up_at_its_deadline(dropping, monkeypatch):
    for k, v in {**CREDS, "AWS_ENDPOINT_URL": dropping.url}.items():
        monkeypatch.setenv(k, v)
    ticks = iter(range(10**6))  # a clock that moves one second each time it is read
    retry = Retry(tries=10**6, deadline=20.0, base=0.0, clock=lambda: float(next(ticks)))
    view = memoryview(bytearray(1000))
    with pytest.raises(RetriesSpent, match=r"^s3://ckpt/w\.bin bytes 4000-4999: gave up after 20 s"):
        S3(concurrency=1, retry=retry).read("ckpt", "w.bin", None, 4000, view)
    assert 0 < len(dropping.ranges) <= 20
    assert bytes(view[:LITTLE]) == pattern(4000, LITTLE)


def test_retry_bounds_are_counted_whatever_the_progress():
    now = [0.0]
    retry = Retry(tries=3, deadline=10.0, clock=lambda: now[0])
    assert retry.spent(1, 0.0) is None and retry.spent(2, 0.0) is None
    assert retry.spent(3, 0.0) == "3 tries"
    now[0] = 10.0
    assert retry.spent(1, 0.0) == "10 s" and retry.spent(1, 0.5) is None
