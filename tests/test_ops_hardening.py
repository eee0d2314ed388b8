"""The --http server against hostile or careless clients: a real client and raw sockets against the real server.

Half-sent requests are closed at the server's deadline instead of holding a thread each; connections over the
cap are answered 503 at once; ``:PORT`` listens on loopback only; IPv6 addresses in brackets work."""
import http.client
import os
import socket

import pytest

pytest.importorskip("prometheus_client")

from p2pweights.ops import (BUSY, LOOPBACK, ConnectionLimit, OpsError, OpsServer, ProbeLane, is_probe,  # noqa: E402
                            parse_http_addr)

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

    def connect(port, host="127.0.0.1", source=None):  # source: another loopback address (127.0.0.2 ...)
        s = socket.create_connection((host, port), timeout=SAFETY, source_address=(source, 0) if source else None)
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


def get(port: int, path: str = "/healthz", host: str = "127.0.0.1", source: str | None = None) -> tuple[int, bytes]:
    """A GET by a real HTTP client (from the loopback address ``source`` if given)."""
    c = http.client.HTTPConnection(host, port, timeout=SAFETY, source_address=(source, 0) if source else None)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_half_sent_requests_are_closed_and_free_their_slots(servers, sockets):
    """20 half-sent requests once held 20 threads for ever: now the 21st connection is refused, and each held
    one is closed at its deadline.  (From three addresses: one address holds at most 8.)"""
    ops = servers("127.0.0.1:0", max_connections=20, request_timeout=1.0)
    conns = [sockets(ops.port, source=f"127.0.0.{1 + i % 3}") for i in range(21)]
    for s in conns:
        s.sendall(HALF_SENT)
    answers = sorted(read_all(s) for s in conns)
    # one over the cap, never given a thread, answered 503 once it never sent a probe; the others closed by
    # the server at their deadline, with no answer to a request that never ended
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


@pytest.mark.timeout(120)
def test_probes_are_answered_while_strangers_hold_every_slot(servers, sockets):
    """Half-sent requests from six addresses hold every slot and fill the probe lane, and more keep coming:
    /healthz and /readyz from any address (the strangers' own included) are still answered, anything else gets
    503 without a thread."""
    ops = servers("127.0.0.1:0")
    for i in range(120):  # 32 slots (8 an address), 64 in the probe lane, 24 displaced
        sockets(ops.port, source=f"127.0.0.{1 + i % 6}").sendall(HALF_SENT)
    for source in ("127.0.0.1", "127.0.0.9"):
        assert get(ops.port, "/healthz", source=source) == (200, b'{"alive": true}')
        assert get(ops.port, "/readyz", source=source) == (503, b'{"stage": "connecting", "pct": 0.0}')
        assert get(ops.port, "/metrics", source=source) == (503, b"too many connections\n")
    alive = 0
    for round in range(5):  # strangers opening half-sent requests between the probes: each displaces an older one
        for i in range(70):
            sockets(ops.port, source=f"127.0.0.{10 + i % 4}").sendall(HALF_SENT)
        alive += get(ops.port, "/healthz", source="127.0.0.1") == (200, b'{"alive": true}')
    assert alive == 5


class Reopener:
    """A stranger holding ``n`` half-sent requests from ``addresses``, opening a new one as each is closed (at
    most ``most`` in all), on its own thread until ``close``."""

    def __init__(self, port: int, n: int, addresses: list[str], most: int = 500):
        import selectors
        import threading

        self.port, self.addresses, self.most, self.opened = port, addresses, most, 0
        self.selector, self.stop = selectors.DefaultSelector(), threading.Event()
        for _ in range(n):
            self._open()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        import selectors

        s = socket.create_connection(("127.0.0.1", self.port), timeout=SAFETY,
                                     source_address=(self.addresses[self.opened % len(self.addresses)], 0))
        s.sendall(HALF_SENT)
        self.selector.register(s, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.selector.select(0.1):
                self.selector.unregister(key.fileobj)
                key.fileobj.close()
                if self.opened < self.most:
                    self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(SAFETY)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


@pytest.mark.timeout(120)
def test_a_stranger_reopening_half_sent_requests_never_fails_a_probe(servers):
    """Every slot and the probe lane held, each connection the server closes opened again at once."""
    ops = servers("127.0.0.1:0")
    stranger = Reopener(ops.port, 120, [f"127.0.0.{k}" for k in range(1, 7)])
    try:
        answers = [get(ops.port, "/healthz", source="127.0.0.1") for _ in range(10)]
    finally:
        stranger.close()
    assert answers == [(200, b'{"alive": true}')] * 10
    assert stranger.opened > 120  # the server closed some (the lane's oldest), and each was opened again


@pytest.mark.timeout(120)
def test_one_address_holds_at_most_its_share_of_the_slots(servers, sockets):
    ops = servers("127.0.0.1:0", max_connections=32, max_per_address=8)
    held = [sockets(ops.port, source="127.0.0.2") for _ in range(8)]
    for s in held:
        s.sendall(HALF_SENT)
    assert get(ops.port, "/metrics", source="127.0.0.2") == (503, b"too many connections\n")
    status, body = get(ops.port, "/metrics", source="127.0.0.3")
    assert status == 200 and b"p2pw_build_info" in body
    assert get(ops.port, "/healthz", source="127.0.0.2") == (200, b'{"alive": true}')


def test_connection_limit_caps_each_address():
    limit = ConnectionLimit(cap=4, timeout=10.0, per_address=2)
    assert limit.admit("a1", 0.0, "10.0.0.1") and limit.admit("a2", 0.0, "10.0.0.1")
    assert not limit.admit("a3", 0.0, "10.0.0.1")  # its address holds its share
    assert limit.admit("b1", 0.0, "10.0.0.2") and limit.admit("b2", 0.0, "10.0.0.2")
    assert not limit.admit("c1", 0.0, "10.0.0.3")  # the cap
    limit.release("a1")
    assert limit.admit("a3", 1.0, "10.0.0.1") and not limit.admit("a4", 1.0, "10.0.0.1")


def test_probe_lane_displaces_the_oldest_and_expires():
    lane = ProbeLane(size=2, timeout=5.0)
    assert lane.add("a", 0.0) == [] and lane.add("b", 1.0) == [] and lane.wait(1.0) == 4.0
    assert lane.add("c", 2.0) == ["a"]  # a newer connection takes the oldest one's place
    lane.release("b")
    assert lane.add("d", 3.0) == [] and lane.expired(6.9) == [] and lane.expired(7.0) == ["c"]
    lane.release("c")
    lane.release("d")
    assert lane.wait(8.0) is None and BUSY.startswith(b"HTTP/1.0 503 ")
    # what the lane answers: the probes (the agent's per model too); everything else is 503 there
    assert all(map(is_probe, ("/healthz", "/readyz", "/readyz/ab12cd34")))
    assert not any(map(is_probe, ("/metrics", "/models", "/healthzz", "/")))


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
