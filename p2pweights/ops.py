"""Ops: what operators and machines see of a running node; it never changes node state.

- ``OpsServer``: ``/healthz``, ``/readyz`` and ``/metrics`` over HTTP (stdlib
  ``http.server`` in a daemon thread), listening from process start, before
  the node exists; ``bind`` hands it the seeder or download once there is one.
  ``--http :PORT`` listens on loopback only (name ``0.0.0.0`` or ``[::]`` for
  every interface); ``ConnectionLimit`` caps the connections served at once,
  and those from one address, and closes each one its deadline after it was
  accepted; a connection over a cap goes to the ``ProbeLane``, where a probe
  (``/healthz``, ``/readyz``) is still answered and anything else gets 503,
  so clients holding every slot never fail a liveness probe.
- ``Readiness``: the stage of a node (connecting, loading, ready) read from
  its store, disk writer and device sink.
- ``NodeCollector``: Prometheus metrics read from the node's own counters at
  scrape time (no second bookkeeping in the hot path).
- ``Progress``: a bar on a terminal, else a progress line every 10 s;
  ``FleetProgress``: the seeder's line about its fleet every 10 s.
- ``JsonFormatter``: one JSON object per log line (``--log-format json``).
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time

from .errors import UserError

log = logging.getLogger("p2pw")
progress_log = logging.getLogger("p2pw.progress")  # INFO even when the rest logs only warnings

PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
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


class OpsError(UserError, ValueError):
    """A bad --http address, a port already taken, or prometheus_client missing."""


def _version() -> str:
    from . import __version__

    return __version__


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


# ----- readiness ---------------------------------------------------------------


class Readiness:
    """The stage of this process's node: what ``/readyz`` and ``p2pw_ready`` say."""

    def __init__(self):
        self.handle = None  # a Seeder or a Download, once it exists
        self.starting = "connecting"  # the stage before there is a handle ("loading" on a seeder: hashing)

    def bind(self, handle) -> None:
        self.handle = handle

    def alive(self) -> bool:
        """The node's loop runs (or, before it exists, the process is still starting it)."""
        h = self.handle
        if h is None:
            return True
        thread = h.node.thread
        return thread is not None and thread.is_alive()

    def stage(self) -> dict:
        """{"stage": "connecting" | "loading", "pct": ...} until the copy is complete, then {"stage": "ready"}."""
        h = self.handle
        if h is None:
            return {"stage": self.starting, "pct": 0.0}
        if getattr(h, "store", None) is None:  # a standalone tracker: ready while its loop serves
            return {"stage": "failed", "pct": 0.0, "error": h.node.fatal} if h.node.fatal else {"stage": "ready"}
        store = h.store
        pct = round(100.0 * store.bytes / h.manifest.total_size, 1) if h.manifest.total_size else 100.0
        if h.node.fatal:
            return {"stage": "failed", "pct": pct, "error": h.node.fatal}
        if getattr(h, "source", None) is not None:  # a seeder reading chunks from storage as peers ask
            return {"stage": "ready"}
        if not store.complete:
            return {"stage": "loading", "pct": pct}
        cache = getattr(h, "cache", None)
        if cache is not None and not cache.finished.is_set():
            return {"stage": "loading", "pct": pct, "waiting_for": "disk"}
        loader = getattr(h, "loader", None)
        if loader is not None:
            landed = loader.sink.landed_at
            on_device = int(len(landed) - _count_nan(landed))
            if on_device < len(landed):
                return {"stage": "loading", "pct": round(100.0 * on_device / len(landed), 1),
                        "waiting_for": "device"}
        return {"stage": "ready"}

    def ready(self) -> bool:
        return self.stage()["stage"] == "ready"


def _count_nan(a) -> int:
    import numpy as np

    return int(np.isnan(a).sum())


# ----- metrics -----------------------------------------------------------------


class NodeCollector:
    """Prometheus metrics of one node, read from its counters when scraped."""

    def __init__(self, readiness: Readiness):
        self.readiness = readiness

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h = self.readiness.handle
        model_id = h.model_id if h is not None else ""
        info = GaugeMetricFamily("p2pw_build_info", "p2pweights version and the model this node carries",
                                 labels=["version", "model_id"])
        info.add_metric([_version(), model_id], 1)
        yield info
        yield GaugeMetricFamily("p2pw_ready", "1 once the copy is complete and verified (on disk, on the device "
                                              "where asked), else 0", value=int(self.readiness.ready()))
        if h is None:
            return
        if getattr(h, "store", None) is None:  # a standalone tracker: its swarms' members
            yield GaugeMetricFamily("p2pw_peers", "peers in the fleet that have not left",
                                    value=sum(w.live for w in list(h.registry.swarms.values())))
            yield GaugeMetricFamily("p2pw_swarms", "models a standalone tracker serves", value=len(h.registry.swarms))
            return
        st = h.node.stats
        yield CounterMetricFamily("p2pw_received_bytes", "chunk bytes received from partners",
                                  value=st.bytes_received)
        yield CounterMetricFamily("p2pw_sent_bytes", "chunk bytes sent to partners", value=st.bytes_sent)
        yield CounterMetricFamily("p2pw_chunks_verified", "chunks verified and held (hashed on arrival, on "
                                                          "resume, or by the seeder's scan)", value=h.store.count)
        rejected = CounterMetricFamily("p2pw_chunks_rejected", "chunks received and dropped", labels=["reason"])
        rejected.add_metric(["hash"], st.bad_chunks)
        rejected.add_metric(["duplicate"], st.duplicates)
        yield rejected
        yield CounterMetricFamily("p2pw_source_switches", "chunks taken from a partner other than the planned "
                                                          "source", value=st.switches)
        fleet = h.node.fleet
        if fleet is not None:  # the seeder: storage and the tracker
            yield CounterMetricFamily("p2pw_storage_read_bytes", "bytes read from storage", value=h.bytes_read)
            yield GaugeMetricFamily("p2pw_peers", "peers in the fleet that have not left", value=fleet.live)
        else:
            yield GaugeMetricFamily("p2pw_download_seconds", "seconds from join to the last verified chunk "
                                                             "(so far, while downloading)", value=h.seconds)


def metrics_registry(readiness: Readiness):
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise OpsError("--http needs prometheus_client: pip install 'p2pweights[ops]' "
                       "(or pip install prometheus_client)") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(readiness))
    return registry


# ----- HTTP --------------------------------------------------------------------


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


# ----- progress ----------------------------------------------------------------


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f}"


class Progress:
    """A one-line bar redrawn on a terminal; elsewhere (a pod's log) a progress line every ``every`` s."""

    def __init__(self, download, stream=None, every: float = PROGRESS_EVERY):
        self.download = download
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.every = 0.2 if self.tty else every
        self.last = (time.monotonic(), download.progress["bytes"])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="p2pw-progress", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(self.every):
            self.draw() if self.tty else self.line()

    def _rate(self, p: dict) -> float:
        """Bytes/s since the last line (the mean rate on a terminal's fast redraws)."""
        now = time.monotonic()
        t0, b0 = self.last
        self.last = (now, p["bytes"])
        return (p["bytes"] - b0) / (now - t0) if now > t0 and not self.tty else p["rate"]

    def draw(self):
        p = self.download.progress
        frac = p["bytes"] / p["total"] if p["total"] else 1.0
        eta = (p["total"] - p["bytes"]) / p["rate"] if p["rate"] > 0 else float("inf")
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        self.stream.write(f"\r[{bar}] {human(p['bytes'])}/{human(p['total'])} "
                          f"{p['rate'] / 1e6:7.1f} MB/s ETA {eta:5.1f}s ")
        self.stream.flush()

    def line(self, final: bool = False):
        """One progress line through the log (text or JSON): bytes, percent, rate, ETA, sources."""
        dl = self.download
        p = dl.progress
        rate = self._rate(p) if not final else p["rate"]
        left = p["total"] - p["bytes"]
        eta = left / rate if rate > 0 else None
        pct = round(100.0 * p["bytes"] / p["total"], 1) if p["total"] else 100.0
        sources = [x["rank"] for x in dl.parents]
        progress_log.info("%s %s/%s (%.1f%%) %.1f MB/s ETA %s sources %s", "progress",
                          human(p["bytes"]), human(p["total"]), pct, rate / 1e6,
                          f"{eta:.0f}s" if eta is not None else "-",
                          ", ".join(f"rank {r}" for r in sources) or "none",
                          extra={"event": "progress", "bytes": p["bytes"], "total": p["total"], "pct": pct,
                                 "rate": round(rate, 1), "eta_s": round(eta, 1) if eta is not None else None,
                                 "sources": sources})

    def close(self):
        """Stop; the bar's last state, or (off a terminal) a last line with the mean rate."""
        self.stop.set()
        self.thread.join()
        if self.tty:
            self.draw()
            self.stream.write("\n")
        else:
            self.line(final=True)


class FleetProgress:
    """The seeder's line every ``every`` s while some live peer is not done: peers, done, the slowest."""

    def __init__(self, seeder, every: float = PROGRESS_EVERY):
        self.seeder, self.every = seeder, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="p2pw-fleet-progress", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(self.every):
            self.line()

    def line(self) -> None:
        f = self.seeder.fleet  # the loop's published snapshot, never the live member table
        busy = [p for p in f.peers if not p.left and not p.done]
        if not busy:
            return
        slow = busy[0]
        progress_log.info("fleet: %d peers, %d done; slowest rank %d (%s) at %.1f%%, %.1f MB/s, %s",
                          f.live, f.done, slow.rank, slow.addr, 100 * slow.progress, slow.rate / 1e6, slow.state,
                          extra={"event": "fleet", "peers": f.live, "done": f.done, "slowest": slow.rank,
                                 "slowest_progress": slow.progress, "slowest_rate": slow.rate})

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


# ----- logs --------------------------------------------------------------------

RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class LogContext:
    """Fields every JSON log line carries: model_id and rank, once the node knows them."""

    def __init__(self):
        self.handle = None

    def fields(self) -> dict:
        h = self.handle
        if h is None:
            return {"model_id": None, "rank": None}
        rank = getattr(h, "rank", 0)
        member = getattr(h.node, "member", None)
        return {"model_id": h.model_id, "rank": h.node.rank if member is not None else rank}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "event", "model_id", "rank", "message", ...extra}`` on one line."""

    def __init__(self, context: LogContext):
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        from datetime import datetime, timezone  # only for --log-format json
        doc = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
               .replace("+00:00", "Z"),
               "level": record.levelname.lower(), "event": getattr(record, "event", "log"),
               **self.context.fields(), "message": record.getMessage()}
        for k, v in vars(record).items():
            if k not in RESERVED and k != "event" and k not in doc:
                doc[k] = v
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(fmt: str, level: int, context: LogContext) -> None:
    """Log lines to stderr, as text or (``fmt == "json"``) one JSON object per line.

    Like ``logging.basicConfig``: a process whose root logger already has
    handlers of its own (an embedding application, pytest) keeps them."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "p2pw", False)]
    for h in ours:
        root.removeHandler(h)
    progress_log.setLevel(logging.INFO)
    logging.getLogger("p2pw.events").setLevel(logging.INFO)
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.p2pw = True
    if fmt == "json":
        handler.setFormatter(JsonFormatter(context))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s p2pw %(levelname)s %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
