"""Node: the event loop of one p2pweights process.

One thread owns every socket and every piece of mutable network state (like
Kraken's scheduler): the ROUTER that children and joiners talk to, a DEALER
per parent (one per stripe) and one to the tracker.  Each change of state is a
small named handler.  Other threads only read the store and ask the loop to
stop.

Flow control is the credit window: a peer keeps at most ``window`` REQUESTs
outstanding per parent and asks again only as chunks arrive.  A parent sends a
child only chunks it asked for, straight from the store (zero-copy), and parks
requests for chunks it does not hold yet; the moment such a chunk is verified
it goes to every child parked on it.  Per child, a parent therefore holds at
most ``window`` queued references into its store, whatever the child's speed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import zmq

from . import faults, forgery, keys, protocol
from .manifest import chunk_hasher
from .protocol import CLIENT_TRANSITIONS, SERVER_TRANSITIONS, Connection, Msg, ProtocolError
from .tracker import TrackerError

log = logging.getLogger("p2pw")

DEFAULT_WINDOW = 8
MAX_WINDOW = 64  # most requests a child may have parked at a parent
MAX_BAD_MESSAGES = 32  # malformed messages before a connection is ignored
MAX_CHILDREN = 64  # children one parent serves at once; more are refused at ATTACH
MAX_NAME = 256  # longest peer id or listen address a HELLO may carry
LEAVE_POLL = 0.2
ROUTER_MAX_MSG = 1 << 20


@dataclass
class Stats:
    """Counters a node reports."""

    chunks_sent: int = 0
    bytes_sent: int = 0
    chunks_received: int = 0
    bad_chunks: int = 0
    refetched: int = 0
    duplicates: int = 0
    malformed: int = 0


@dataclass
class Child:
    """A connection attached to this node as a child."""

    peer_id: str
    rank: int
    parked: int = 0


@dataclass
class Upstream:
    """This peer's link to its parent in one stripe, with its credit window."""

    stripe: int
    addr: str
    rank: int
    socket: zmq.Socket
    conn: Connection
    todo: deque = field(default_factory=deque)
    outstanding: set = field(default_factory=set)
    attach_sent: float = 0.0


def tcp(addr: str) -> str:
    return addr if "://" in addr else f"tcp://{addr}"


class Node:
    """Serves its store to children; a peer node also pulls from its parents and reports to the tracker."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, manifest, store, *, peer_id: str,
                 tracker=None, window: int = DEFAULT_WINDOW, attach_timeout: float = 30.0,
                 key: keys.FleetKey | None = None, max_children: int = MAX_CHILDREN):
        self.ctx = ctx
        self.key = key  # CURVE on every link this node opens (keys.py)
        self.max_children = max_children
        self.forge = forgery.from_env()  # test-only fault injection, None unless P2PW_FAULT_FORGE is set
        self.router = router
        self.manifest = manifest
        self.model_id = manifest.model_id
        self.store = store
        self.peer_id = peer_id
        self.tracker = tracker
        self.tracker_addr: str | None = None
        self.tracker_link: zmq.Socket | None = None
        self.tracker_conn: Connection | None = None
        self.rank = 0
        self.window = window
        self.attach_timeout = attach_timeout
        self.digest = chunk_hasher(manifest.hash)
        self.upstreams: list[Upstream] = []
        self.conns: dict[bytes, Connection] = {}
        self.children: dict[bytes, Child] = {}
        self.members: dict[bytes, int] = {}
        self.parked: dict[int, list[bytes]] = defaultdict(list)
        self.bad: dict[bytes, int] = defaultdict(int)
        self.stats = Stats()
        self.faults = faults.from_env()
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.stop_event = threading.Event()
        self.left = threading.Event()
        self.leave_when_done = False
        self.done_reported = False
        self.leave_next = 0.0
        self.extra_done = []  # callables that must be true before the peer counts as done (disk cache)
        self.fatal: str | None = None
        self.thread: threading.Thread | None = None

    # ----- setup ---------------------------------------------------------

    def attach_tracker(self, socket: zmq.Socket, addr: str, rank: int) -> None:
        """Adopt the (already welcomed) DEALER to the tracker."""
        self.tracker_link, self.tracker_addr, self.rank = socket, addr, rank
        self.tracker_conn = Connection(CLIENT_TRANSITIONS, "member")
        self.poller.register(socket, zmq.POLLIN)

    def add_parent(self, stripe: int, stripes: int, addr: str, rank: int) -> None:
        """Open the link to our parent in ``stripe`` and queue the chunks it will send us."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.manifest.chunk_size, protocol.MAX_CONTROL_BODY) + 4096)
        sock.setsockopt(zmq.RCVHWM, 4 * MAX_WINDOW)
        keys.secure_client(sock, self.key)
        sock.connect(tcp(addr))
        todo = deque(i for i in range(stripe, self.manifest.n_chunks, stripes) if not self.store.has(i))
        up = Upstream(stripe, addr, rank, sock, Connection(CLIENT_TRANSITIONS, "attaching"), todo)
        self.upstreams.append(up)
        self.poller.register(sock, zmq.POLLIN)
        if todo:
            self._attach(up)

    def _attach(self, up: Upstream) -> None:
        up.attach_sent = time.monotonic()
        up.socket.send(protocol.control(Msg.ATTACH, peer_id=self.peer_id, rank=self.rank,
                                        model_id=self.model_id, stripe=up.stripe))

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="p2pw-node", daemon=True)
        self.thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self.stop_event.set()
        if self.thread and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    # ----- the loop ------------------------------------------------------

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                for sock, _ in self.poller.poll(50):
                    if sock is self.router:
                        self._drain(sock, self._on_router)
                    elif sock is self.tracker_link:
                        self._drain(sock, self._on_tracker)
                    else:
                        up = next(u for u in self.upstreams if u.socket is sock)
                        self._drain(sock, lambda s, up=up: self._on_upstream(up))
                self._tick(time.monotonic())
        except Exception as e:  # a bug: fail the download loudly rather than hang its waiters
            log.exception("node loop crashed")
            self._fail(f"internal error: {e!r}")
        finally:
            self._close_sockets()

    def _drain(self, sock, handler, budget: int = 64) -> None:
        for _ in range(budget):
            if not sock.poll(0, zmq.POLLIN):
                return
            handler(sock)

    def _tick(self, now: float) -> None:
        """Timers: attach timeouts, completion, leaving."""
        for up in self.upstreams:
            if up.conn.state == "attaching" and up.todo and now - up.attach_sent > self.attach_timeout:
                self._fail(f"parent {up.addr} (rank {up.rank}) did not answer within {self.attach_timeout:.0f} s")
        if self.tracker_link is None or self.fatal:
            return
        if self.store.complete and all(ok() for ok in self.extra_done):
            if not self.done_reported:
                self.done_reported = True
                self.tracker_link.send(protocol.control(Msg.DONE, rank=self.rank))
            if self.leave_when_done and now >= self.leave_next:
                self.leave_next = now + LEAVE_POLL
                self.tracker_link.send(protocol.control(Msg.LEAVE, rank=self.rank))

    def _fail(self, message: str) -> None:
        if self.fatal is None:
            self.fatal = message
            log.error("%s", message)
            self.store.fail(message)
            self.stop_event.set()

    def _close_sockets(self) -> None:
        if self.tracker_link is not None and not self.left.is_set():
            try:  # tell the tracker we are gone, so no joiner is sent to a dead parent
                self.tracker_link.send(protocol.control(Msg.BYE, rank=self.rank), zmq.NOBLOCK)
                self.tracker_link.setsockopt(zmq.LINGER, 500)
            except zmq.ZMQError:
                pass
        for up in self.upstreams:
            up.socket.close(0)
        if self.tracker_link is not None:
            self.tracker_link.close(0)
        self.router.close(0)

    # ----- upstream: chunks from our parents -----------------------------

    def _on_upstream(self, up: Upstream) -> None:
        sock = up.socket
        try:
            event = protocol.decode_header(sock.recv(zmq.NOBLOCK))
            if event.type == Msg.CHUNK:
                if not sock.getsockopt(zmq.RCVMORE):
                    raise ProtocolError("CHUNK without its payload frame")
                up.conn.receive(event)
                self._on_chunk(up, event.indices[0])
            else:
                self._discard_rest(sock)
                up.conn.receive(event)
                self._on_upstream_control(up, event)
        except ProtocolError as e:
            self._discard_rest(sock)
            self.stats.malformed += 1
            log.warning("parent %s (rank %d) sent a bad message: %s", up.addr, up.rank, e)

    def _discard_rest(self, sock) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv_into(bytearray())

    def _on_upstream_control(self, up: Upstream, event) -> None:
        if event.type == Msg.ATTACHED:
            self._request_more(up)
        elif event.type == Msg.ERROR:
            self._fail(f"parent {up.addr} refused us: {event.fields.get('message')}")

    def _on_chunk(self, up: Upstream, index: int) -> None:
        """A chunk arrived: verify it in place, then publish and forward it, or drop it."""
        sock = up.socket
        if index >= self.manifest.n_chunks or index not in up.outstanding:
            self._discard_rest(sock)
            self.stats.malformed += 1
            log.warning("parent %s sent chunk %d, which we did not ask it for: dropped", up.addr, index)
            return
        up.outstanding.discard(index)
        if self.store.has(index):
            self._discard_rest(sock)
            self.stats.duplicates += 1
            return
        view = self.store.chunk(index)
        n = sock.recv_into(view)
        self._discard_rest(sock)
        self.stats.chunks_received += 1
        if self.faults is not None:
            self.faults.received()
        if n != len(view) or self.digest(view) != self.manifest.chunks[index]:
            self.stats.bad_chunks += 1
            self.stats.refetched += 1
            up.todo.appendleft(index)
            log.warning("chunk %d from parent %s failed verification (%d bytes): dropped, fetching it again",
                        index, up.addr, n)
        else:
            self._publish(index)
        self._request_more(up)

    def _request_more(self, up: Upstream) -> None:
        """Top the credit window for ``up`` back up to ``window`` outstanding requests."""
        if up.conn.state != "attached":
            return
        want = []
        while up.todo and len(up.outstanding) + len(want) < self.window:
            i = up.todo.popleft()
            if not self.store.has(i):
                want.append(i)
        if want:
            up.outstanding.update(want)
            up.socket.send(protocol.request(want))

    def _publish(self, index: int) -> None:
        """Chunk ``index`` is verified: make it visible and send it to every child waiting on it."""
        self.store.verified(index)
        for ident in self.parked.pop(index, ()):
            child = self.children.get(ident)
            if child is not None:
                child.parked -= 1
                self._send_chunk(ident, index)

    # ----- tracker link (peers only) ---------------------------------------

    def _on_tracker(self, sock) -> None:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            event = self.tracker_conn.receive(protocol.decode(frames))
        except ProtocolError as e:
            self.stats.malformed += 1
            log.warning("tracker %s sent a bad message: %s", self.tracker_addr, e)
            return
        if event.type == Msg.LEAVE_OK:
            self.left.set()
            self.stop_event.set()
        elif event.type == Msg.ERROR:
            log.warning("tracker: %s", event.fields.get("message"))

    # ----- router: children, joiners, members ------------------------------

    def _on_router(self, sock) -> None:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
        ident = frames[0]
        if self.bad[ident] >= MAX_BAD_MESSAGES:
            return
        conn = self.conns.get(ident)
        if conn is None:
            conn = self.conns[ident] = Connection(SERVER_TRANSITIONS, "new")
        try:
            event = conn.receive(protocol.decode(frames[1:]))
            handler = self.ROUTER_HANDLERS.get(event.type)
            if handler is not None:
                handler(self, ident, event)
        except ProtocolError as e:
            self._reject(ident, str(e), isinstance(e, protocol.VersionMismatch))
        except Exception as e:  # never let one peer take the node down
            self._reject(ident, f"could not handle its message: {e!r}", False)

    def _who(self, ident: bytes) -> str:
        child = self.children.get(ident)
        if child is not None:
            return f"peer {child.peer_id} (rank {child.rank})"
        rank = self.members.get(ident)
        if rank is not None and self.tracker is not None:
            return f"peer {self.tracker.members[rank].peer_id} (rank {rank})"
        return f"unknown peer {ident.hex()[:10]}"

    def _reject(self, ident: bytes, reason: str, tell: bool) -> None:
        self.bad[ident] += 1
        self.stats.malformed += 1
        log.warning("%s: %s", self._who(ident), reason)
        if tell or self.bad[ident] == 1:
            self._send(ident, protocol.control(Msg.ERROR, message=reason))
        if self.bad[ident] >= MAX_BAD_MESSAGES:
            log.warning("%s: %d bad messages, ignoring it from now on", self._who(ident), self.bad[ident])
            self._forget(ident)

    def _forget(self, ident: bytes) -> None:
        self.children.pop(ident, None)
        for waiting in self.parked.values():
            while ident in waiting:
                waiting.remove(ident)

    def _send(self, ident: bytes, *frames, copy=True) -> bool:
        try:
            self.router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=copy)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self._forget(ident)
                return False
            raise

    def _send_chunk(self, ident: bytes, index: int) -> None:
        data = self.store.chunk(index)
        if self.forge is not None:
            data = self.forge.outgoing(index, data)
        if self.faults is not None:
            data = self.faults.outgoing(data)
            if data is None:
                return
        if self._send(ident, protocol.chunk_header(index), data, copy=False):
            self.stats.chunks_sent += 1
            self.stats.bytes_sent += len(data)
        elif ident in self.children and self.children[ident].parked < MAX_WINDOW:  # queue full: retry later
            self.parked[index].append(ident)
            self.children[ident].parked += 1
        elif ident in self.children:  # it asks far beyond any credit window and does not read: drop, not hoard
            self.stats.malformed += 1

    def _on_hello(self, ident: bytes, event) -> None:
        f = event.fields
        if self.tracker is None:
            self.conns[ident].state = "new"
            self._send(ident, protocol.control(Msg.REDIRECT, tracker=self.tracker_addr))
            return
        want = f.get("model_id")
        if want and not self.model_id.startswith(str(want).lower()):
            self._send(ident, protocol.control(
                Msg.ERROR, message=f"model id mismatch: you want {want}, this seeder serves {self.model_id}", fatal=True))
            self.conns.pop(ident, None)
            return
        if len(f["peer_id"]) > MAX_NAME or len(f["listen"]) > MAX_NAME:
            raise ProtocolError(f"HELLO peer_id or listen address longer than {MAX_NAME} characters")
        try:
            member = self.tracker.join(f["peer_id"], f["listen"])
        except TrackerError as e:
            self._send(ident, protocol.control(Msg.ERROR, message=str(e), fatal=True))
            self.conns.pop(ident, None)
            return
        self.members[ident] = member.rank
        log.info("peer %s joined as rank %d under %s", f["peer_id"], member.rank,
                 ", ".join(f"rank {p}" for p in member.parents))
        self._send(ident, protocol.control(
            Msg.WELCOME, rank=member.rank, parents=self.tracker.parent_addrs(member),
            stripes=self.tracker.topology.stripes, tracker=self.tracker.root_listen),
            self.manifest.to_json().encode())

    def _on_attach(self, ident: bytes, event) -> None:
        f = event.fields
        if f["model_id"] != self.model_id:
            self._send(ident, protocol.control(Msg.ERROR, message="model id mismatch", fatal=True))
            self.conns.pop(ident, None)
            return
        if ident not in self.children and len(self.children) >= self.max_children:
            self._send(ident, protocol.control(
                Msg.ERROR, message=f"parent serves its maximum of {self.max_children} children", fatal=True))
            self.conns.pop(ident, None)
            return
        self.children[ident] = Child(f["peer_id"][:MAX_NAME], f["rank"])
        self._send(ident, protocol.control(Msg.ATTACHED))

    def _on_request(self, ident: bytes, event) -> None:
        child = self.children.get(ident)
        if child is None:
            raise ProtocolError("REQUEST from a connection that is not attached")
        n = self.manifest.n_chunks
        if len(set(event.indices)) != len(event.indices):
            raise ProtocolError("REQUEST names a chunk twice")
        for index in event.indices:
            if index >= n:
                raise ProtocolError(f"requested chunk {index}, but the blob has {n}")
            if self.store.has(index):
                self._send_chunk(ident, index)
            elif child.parked < MAX_WINDOW:
                child.parked += 1
                self.parked[index].append(ident)
            else:
                raise ProtocolError(f"more than {MAX_WINDOW} requests parked")

    def _on_done(self, ident: bytes, event) -> None:
        rank = self.members.get(ident)
        if rank is not None:
            self.tracker.done(rank)
            log.info("peer rank %d is done", rank)

    def _on_bye(self, ident: bytes, event) -> None:
        rank = self.members.pop(ident, None)
        if rank is not None:
            self.tracker.gone(rank)
            log.info("peer rank %d left", rank)

    def _on_leave(self, ident: bytes, event) -> None:
        rank = self.members.get(ident)
        if rank is None:
            raise ProtocolError("LEAVE from a connection that never joined")
        waiting = self.tracker.leave(rank)
        if waiting:
            self._send(ident, protocol.control(Msg.LEAVE_WAIT, waiting_for=waiting))
        else:
            self._send(ident, protocol.control(Msg.LEAVE_OK))

    ROUTER_HANDLERS = {
        Msg.HELLO: _on_hello,
        Msg.ATTACH: _on_attach,
        Msg.REQUEST: _on_request,
        Msg.DONE: _on_done,
        Msg.LEAVE: _on_leave,
        Msg.BYE: _on_bye,
    }


def bind_router(ctx: zmq.Context, host: str, port: int, key: keys.FleetKey | None = None) -> tuple[zmq.Socket, int]:
    """A ROUTER bound on host:port (port 0 picks a free one), CURVE-secured with ``key``; returns it and its port."""
    sock = ctx.socket(zmq.ROUTER)
    keys.secure_server(sock, key)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, ROUTER_MAX_MSG)
    sock.setsockopt(zmq.SNDHWM, 2 * MAX_WINDOW)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, port
