"""The ``--http`` server: ``/healthz``, ``/readyz`` and ``/metrics`` (stdlib ``http.server`` in a daemon thread),
listening from process start, before the node exists; ``bind`` hands it the seeder or download once there is
one.  ``--http :PORT`` listens on loopback only (name ``0.0.0.0`` or ``[::]`` for every interface);
``ConnectionLimit`` caps the connections served at once, and those from one address, and closes each one its
deadline after it was accepted; a connection over a cap goes to the ``ProbeLane`` (``ProbeDoor``: one
selector thread), where a probe (``/healthz``, ``/readyz``) is still answered and anything else gets 503, so
clients holding every slot never fail a liveness probe."""
from __future__ import annotations

import json
import logging
import threading
import time

from .metrics import OpsError, Readiness, metrics_registry

log = logging.getLogger("p2pw")
DEFAULT_HTTP_PORT = 9420


LOOPBACK = "127.0.0.1"  # where --http :PORT listens: every other interface is named explicitly


MAX_CONNECTIONS = 32  # --http connections served at once; one more goes to the probe lane


MAX_PER_ADDRESS = 8  # of those, from one source address


PROBE_LANE = 64  # connections over a cap held at once (an fd each) to read a probe; a newer one displaces the oldest


MAX_HEAD = 8192  # bytes of a request head the probe lane reads


PROBES = ("/healthz", "/readyz")  # answered even over the cap (and ``/readyz/...``: the agent's per model)


REQUEST_TIMEOUT = 10.0  # seconds an --http connection is held, from accept to its answer's last byte


BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n"
        b"Connection: close\r\n\r\ntoo many connections\n")


def parse_http_addr(addr: str) -> tuple[str, int]:
    """'[HOST]:PORT' -> (host, port).  No host means this host only: ':9420' -> ('127.0.0.1', 9420); every
    interface is asked for by name ('0.0.0.0:9420', '[::]:9420'); an IPv6 address in brackets ('[::1]:9420')."""
    host, sep, port = addr.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if (not sep or not port.isdigit() or not 0 <= int(port) < 65536 or "[" in host or "]" in host
            or (":" in host and not bracketed)):
        raise OpsError(f"bad --http address {addr!r}: expected [HOST]:PORT, e.g. :{DEFAULT_HTTP_PORT} (this host "
                       f"only), 0.0.0.0:{DEFAULT_HTTP_PORT} (every interface) or [::1]:{DEFAULT_HTTP_PORT}")
    return host or LOOPBACK, int(port)


class ConnectionLimit:
    """Which --http connections are served: at most ``cap`` at once and ``per_address`` from one source
    address, each closed ``timeout`` s after it was accepted, so a half-sent request or an unread answer holds
    its thread no longer.  Pure: ``now`` is given."""

    def __init__(self, cap: int = MAX_CONNECTIONS, timeout: float = REQUEST_TIMEOUT,
                 per_address: int = MAX_PER_ADDRESS):
        self.cap, self.timeout, self.per_address = cap, timeout, per_address
        self.deadlines: dict = {}  # connection -> when it is closed
        self.source: dict = {}  # connection -> the address it came from
        self.held: dict = {}  # address -> connections it holds

    def admit(self, conn, now: float, addr=None) -> bool:
        """Whether ``conn`` (from ``addr``) is served (False: a cap is reached)."""
        if len(self.deadlines) >= self.cap or addr is not None and self.held.get(addr, 0) >= self.per_address:
            return False
        self.deadlines[conn] = now + self.timeout
        if addr is not None:
            self.source[conn] = addr
            self.held[addr] = self.held.get(addr, 0) + 1
        return True

    def release(self, conn) -> None:
        self.deadlines.pop(conn, None)
        addr = self.source.pop(conn, None)
        if addr is not None:
            self.held[addr] -= 1
            if not self.held[addr]:
                del self.held[addr]

    def expired(self, now: float) -> list:
        """Connections held past their deadline."""
        return [c for c, t in self.deadlines.items() if t <= now]


class ProbeLane:
    """Connections over a cap, held only to read whether they ask for a probe: at most ``size`` at once, each
    for ``timeout`` s.  A newer one takes the place of the oldest (answered 503), so clients that hold their
    connections half-sent never keep a probe sent whole from being read.  Pure: ``now`` is given."""

    def __init__(self, size: int = PROBE_LANE, timeout: float = REQUEST_TIMEOUT):
        self.size, self.timeout = size, timeout
        self.deadlines: dict = {}  # connection -> when it is answered 503, oldest first

    def add(self, conn, now: float) -> list:
        """Hold ``conn``; the connections it displaced, oldest first."""
        self.deadlines[conn] = now + self.timeout
        out = []
        while len(self.deadlines) > self.size:
            oldest = next(iter(self.deadlines))
            del self.deadlines[oldest]
            out.append(oldest)
        return out

    def release(self, conn) -> None:
        self.deadlines.pop(conn, None)

    def expired(self, now: float) -> list:
        return [c for c, t in self.deadlines.items() if t <= now]

    def wait(self, now: float) -> float | None:
        """Seconds until the next deadline (None: nothing held)."""
        return max(min(self.deadlines.values()) - now, 0.0) if self.deadlines else None


def is_probe(path: str) -> bool:
    return path in PROBES or path.startswith("/readyz/")


class ProbeDoor:
    """The probe lane's thread: reads the heads of connections over a cap (without a thread each), answers a
    GET of a probe with ``answer(path)`` and anything else, or nothing whole in time, with 503."""

    def __init__(self, answer, lane: ProbeLane):
        import selectors
        import socket

        self.answer, self.lane = answer, lane
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.lock, self.incoming, self.heads, self.stopped = threading.Lock(), [], {}, False
        self.thread = threading.Thread(target=self._run, name="p2pw-http-probes", daemon=True)
        self.thread.start()

    def add(self, conn) -> None:
        """A connection over a cap (from the server's thread)."""
        with self.lock:
            self.incoming.append(conn)
        self._wake()

    def _wake(self) -> None:
        try:
            self.wake_w.send(b"x")
        except OSError:  # the wake is full: the thread will look anyway
            pass

    def _run(self) -> None:
        while not self.stopped:
            try:
                self._pass()
            except Exception:  # a probe never takes the node down, nor this thread
                log.debug("--http: the probe lane's pass failed", exc_info=True)

    def _pass(self) -> None:
        """Wait for a head's bytes, a new connection or a deadline; act on each."""
        import selectors

        self._ready(self.lane.wait(time.monotonic()), wake=True)
        with self.lock:
            incoming, self.incoming = self.incoming, []
        for conn in incoming:
            try:
                conn.setblocking(False)
                self.selector.register(conn, selectors.EVENT_READ)
            except (OSError, ValueError):  # gone already
                conn.close()
                continue
            self.heads[conn] = b""
            self._ready(0)  # what has come is read first (the new one's too): no probe sent whole is displaced
            if conn in self.heads:
                for old in self.lane.add(conn, time.monotonic()):
                    self._close(old, BUSY)
        for conn in self.lane.expired(time.monotonic()):
            self._close(conn, BUSY)

    def _ready(self, timeout: float | None, wake: bool = False) -> None:
        """Read every head with bytes waiting, within ``timeout`` s; ``wake``: drain the wake-up too."""
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.wake_r:
                if wake:
                    try:
                        while self.wake_r.recv(4096):
                            pass
                    except OSError:  # drained
                        pass
            elif key.fileobj in self.heads:
                self._read(key.fileobj)

    def _read(self, conn) -> None:
        try:
            got = conn.recv(MAX_HEAD)
        except BlockingIOError:
            return
        except OSError:
            got = b""
        if not got:
            return self._close(conn, b"")
        head = self.heads[conn] + got
        self.heads[conn] = head
        if b"\r\n\r\n" not in head and b"\n\n" not in head:
            if len(head) > MAX_HEAD:
                self._close(conn, BUSY)
            return
        words = head.split(b"\n", 1)[0].split()
        path = words[1].decode("latin-1").split("?", 1)[0] if len(words) == 3 and words[0] == b"GET" else ""
        self._close(conn, self._probe(path) if is_probe(path) else BUSY)

    def _probe(self, path: str) -> bytes:
        try:
            code, ctype, body = self.answer(path)
        except Exception as e:  # a probe never takes the node down
            code, ctype, body = 500, "text/plain", f"error: {e!r}\n".encode()
        from http import HTTPStatus

        return (f"HTTP/1.0 {code} {HTTPStatus(code).phrase}\r\nContent-Type: {ctype}\r\nContent-Length: "
                f"{len(body)}\r\nConnection: close\r\n\r\n").encode() + body

    def _close(self, conn, answer: bytes) -> None:
        self.lane.release(conn)
        self.heads.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        try:
            if answer:
                conn.send(answer)  # a few hundred bytes: the socket's buffer takes them at once
        except OSError:
            pass
        conn.close()

    def close(self) -> None:
        self.stopped = True
        self._wake()
        self.thread.join()
        for conn in list(self.heads):
            self._close(conn, b"")
        with self.lock:
            for conn in self.incoming:
                conn.close()
            self.incoming = []
        self.selector.close()
        self.wake_r.close()
        self.wake_w.close()


def _http_server(host: str, port: int, handler, limit: ConnectionLimit, door: ProbeDoor):
    """A ThreadingHTTPServer on ``host`` (IPv6 for an IPv6 address) that serves within ``limit``: over a cap
    a connection goes to ``door`` (a probe is answered, anything else 503); past its deadline it is shut from
    the serving thread."""
    import socket
    from http.server import ThreadingHTTPServer

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True
        request_queue_size = 64  # the listen backlog: connections over the cap are accepted to be answered 503

        def __init__(self):
            self.lock = threading.Lock()
            super().__init__((host, port), handler)

        def process_request(self, request, client_address) -> None:
            with self.lock:
                admitted = limit.admit(request, time.monotonic(), client_address[0])
            if admitted:
                super().process_request(request, client_address)
            else:
                door.add(request)  # over a cap: read there, without a thread, for a probe

        def shutdown_request(self, request) -> None:
            with self.lock:
                limit.release(request)
            super().shutdown_request(request)

        def service_actions(self) -> None:  # the serving thread, between requests and every poll interval
            with self.lock:
                late = limit.expired(time.monotonic())
            for conn in late:  # the handler's next read or write fails and its thread ends
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        def handle_error(self, request, client_address) -> None:
            log.debug("--http: a connection from %s ended early", client_address, exc_info=True)

    return Server()


class OpsServer:
    """``/healthz``, ``/readyz`` and ``/metrics`` on ``addr``, served from a daemon thread, at most
    ``max_connections`` at once and ``max_per_address`` from one address, each for at most ``request_timeout``
    s; probes over those caps are answered by the ``ProbeDoor``."""

    def __init__(self, addr: str, max_connections: int = MAX_CONNECTIONS, request_timeout: float = REQUEST_TIMEOUT,
                 max_per_address: int = MAX_PER_ADDRESS):
        from http.server import BaseHTTPRequestHandler  # only a node serving --http

        host, port = parse_http_addr(addr)
        self.readiness = Readiness()
        self.registry = metrics_registry(self.readiness)
        ops = self

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout  # each read and write; the server's deadline bounds them all

            def do_GET(self):  # noqa: N802  (http.server's name)
                try:
                    code, ctype, body = ops.answer(self.path.split("?", 1)[0])
                except Exception as e:  # a probe never takes the node down
                    code, ctype, body = 500, "text/plain", f"error: {e!r}\n".encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # probes every few seconds would flood the log
                pass

        self.door = ProbeDoor(lambda path: ops.answer(path), ProbeLane(PROBE_LANE, request_timeout))
        try:
            self.httpd = _http_server(host, port, Handler, ConnectionLimit(max_connections, request_timeout,
                                                                           max_per_address), self.door)
        except (OSError, OverflowError) as e:
            self.door.close()
            raise OpsError(f"cannot serve --http on {addr}: {getattr(e, 'strerror', None) or e}") from None
        self.port = self.httpd.server_address[1]
        self.addr = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="p2pw-http", daemon=True)
        self.thread.start()

    def bind(self, handle) -> None:
        self.readiness.bind(handle)

    def answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/healthz":
            ok = self.readiness.alive()
            return (200 if ok else 503), "application/json", json.dumps({"alive": ok}).encode()
        if path == "/readyz":
            st = self.readiness.stage()
            return (200 if st["stage"] == "ready" else 503), "application/json", json.dumps(st).encode()
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        return 404, "text/plain", b"not found: try /healthz, /readyz, /metrics\n"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.door.close()
