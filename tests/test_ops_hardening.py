"""The --http server against hostile or careless clients: a real client and raw sockets against the real server.

Half-sent requests are closed at the server's deadline instead of holding a thread each; connections over the
cap are answered 503 at once; ``:PORT`` listens on loopback only; IPv6 addresses in brackets work."""
import http.client
import os
import socket

import pytest

pytest.importorskip("prometheus_client")

from p2pweights.ops import LOOPBACK, ConnectionLimit, OpsError, OpsServer, parse_http_addr  # noqa: E402

SAFETY = 60  # seconds a test socket waits for the server before the test fails (never reached when it passes)
HALF_SENT = b"GET /healthz HTTP/1.1\r\nHost: p2pw\r\n"  # no blank line: the request never ends


@pytest.fixture
def servers():
    started = []
    try:
        yield lambda *a, **kw: started.append(OpsServer(*a, **kw)) or started[-1]
    finally:
        for s in started:
            s.close()


@pytest.fixture
def sockets():
    opened = []

    def connect(port, host="127.0.0.1"):
        s = socket.create_connection((host, port), timeout=SAFETY)
        opened.append(s)
        return s

    try:
        yield connect
    finally:
        for s in opened:
            s.close()


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def get(port: int, path: str = "/healthz", host: str = "127.0.0.1") -> tuple[int, bytes]:
    c = http.client.HTTPConnection(host, port, timeout=SAFETY)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_half_sent_requests_are_closed_and_free_their_slots(servers, sockets):
    """20 half-sent requests once held 20 threads for ever: now the 21st connection is refused at once, and
    each held one is closed at its deadline."""
    ops = servers("127.0.0.1:0", max_connections=20, request_timeout=1.0)
    conns = [sockets(ops.port) for _ in range(21)]
    for s in conns:
        s.sendall(HALF_SENT)
    answers = sorted(read_all(s) for s in conns)
    # one over the cap, answered at once and never given a thread; the others closed by the server at their
    # deadline, with no answer to a request that never ended
    assert answers == [b""] * 20 + [b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                                    b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n"]
    assert get(ops.port) == (200, b'{"alive": true}')  # every slot is free again


@pytest.mark.timeout(120)
def test_a_connection_that_sends_nothing_is_closed(servers, sockets):
    """A connection that sends nothing is held no longer than one that sends half a request."""
    ops = servers("127.0.0.1:0", max_connections=1, request_timeout=1.0)
    conns = [sockets(ops.port), sockets(ops.port)]
    answers = sorted(read_all(s)[:13] for s in conns)
    assert answers == [b"", b"HTTP/1.0 503 "]
    assert get(ops.port, "/readyz") == (503, b'{"stage": "connecting", "pct": 0.0}')


def test_connection_limit_caps_and_expires():
    limit = ConnectionLimit(cap=2, timeout=10.0)
    assert limit.admit("a", 0.0) and limit.admit("b", 5.0) and not limit.admit("c", 6.0)
    assert limit.expired(9.9) == [] and limit.expired(10.0) == ["a"] and limit.expired(15.0) == ["a", "b"]
    limit.release("a")
    limit.release("never admitted")
    assert limit.admit("c", 16.0) and limit.expired(16.0) == ["b"]


def test_port_alone_means_loopback_and_every_interface_is_named(servers):
    assert parse_http_addr(":9420") == (LOOPBACK, 9420)
    assert parse_http_addr("0.0.0.0:9420") == ("0.0.0.0", 9420)
    assert parse_http_addr("[::]:9420") == ("::", 9420)
    assert parse_http_addr("[::1]:9420") == ("::1", 9420)
    for bad in ("::1:9420", "[::1:9420", "9420", "host:port", "[::1]:70000"):
        with pytest.raises(OpsError, match="bad --http address"):
            parse_http_addr(bad)
    ops = servers(":0")
    assert ops.httpd.server_address[0] == LOOPBACK and ops.addr == f"{LOOPBACK}:{ops.port}"
    assert get(ops.port)[0] == 200


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.timeout(60)
def test_ipv6_address_in_brackets(servers):
    ops = servers("[::1]:0")
    assert ops.addr == f"[::1]:{ops.port}"
    assert get(ops.port, host="::1") == (200, b'{"alive": true}')
    status, body = get(ops.port, "/metrics", host="::1")
    assert status == 200 and b"p2pw_build_info" in body


def test_kubernetes_examples_bind_the_pod_ip_for_their_probes():
    """A kubelet probe and a scraper reach the pod's IP: the examples name every interface, since ':PORT' is
    loopback only."""
    yaml = pytest.importorskip("yaml")
    from p2pweights.cli import parser

    root = os.path.join(os.path.dirname(__file__), "..", "examples", "kubernetes")
    hosts = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".yaml"):
            with open(os.path.join(root, name)) as f:
                for doc in yaml.safe_load_all(f):
                    spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
                    for c in spec.get("containers", []):
                        argv = [*c.get("command", []), *c.get("args", [])]
                        if argv[:1] == ["p2pw"] and "--http" in argv and c.get("readinessProbe"):
                            args = parser(argv[1:]).parse_args(argv[1:])
                            hosts.append(parse_http_addr(args.http)[0])
    assert hosts and all(h in ("0.0.0.0", "::") for h in hosts), hosts
