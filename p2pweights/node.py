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
import struct
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import zmq

from . import faults, keys, protocol
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
HEARTBEAT_INTERVAL = 0.5  # parents -> children, peers <-> tracker
PARENT_TIMEOUT = 5.0  # a parent silent this long is given up for another (configurable)
TRACKER_TIMEOUT = 10.0  # a tracker silent this long is re-introduced to (it may have restarted)
MAX_BAD_FROM_PARENT = 4  # chunks failing verification before a parent is abandoned for another
STALL_MIN = 2.0  # floor of the stall bound for one outstanding request, seconds
IDLE_FORGET = 60.0  # a quiet connection that is neither child nor member is forgotten after this long
RETRY_INTERVAL = 1.0  # ORPHAN / HELLO resend while waiting for the tracker
ROUTER_MAX_MSG = 1 << 20
READY = struct.Struct("<I?")  # read-ahead -> loop: chunk index, matched the manifest


@dataclass
class Stats:
    """Counters a node reports."""

    chunks_sent: int = 0
    bytes_sent: int = 0
    chunks_received: int = 0
    bad_chunks: int = 0
    duplicates: int = 0
    malformed: int = 0
    stalled: int = 0
    reparented: int = 0
    resumed: int = 0

    @property
    def refetched(self) -> int:
        """Chunks fetched again: each one that failed verification."""
        return self.bad_chunks


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
    last_heard: float = field(default_factory=time.monotonic)
    sent_at: dict = field(default_factory=dict)  # chunk index -> when we (last) asked for it
    bad: int = 0
    last_chunk: float = field(default_factory=time.monotonic)  # when a chunk last came from this parent
    lost: str | None = None  # why we gave this parent up, while waiting for the tracker to name another
    dead: bool = False  # lost because it went silent (the tracker may declare it gone), not merely bad
    orphan_sent: float = 0.0

    def requeue(self) -> None:
        """Put every outstanding request back at the front of the queue, in order, to be asked again."""
        self.todo.extendleft(sorted(self.outstanding, reverse=True))
        self.outstanding.clear()
        self.sent_at.clear()


def tcp(addr: str) -> str:
    return addr if "://" in addr else f"tcp://{addr}"


class Node:
    """Serves its store to children; a peer node also pulls from its parents and reports to the tracker."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, manifest, store, *, peer_id: str,
                 tracker=None, window: int = DEFAULT_WINDOW,
                 key: keys.FleetKey | None = None, max_children: int = MAX_CHILDREN,
                 parent_timeout: float = PARENT_TIMEOUT, tracker_timeout: float = TRACKER_TIMEOUT,
                 hello: dict | None = None):
        self.ctx = ctx
        self.key = key  # CURVE on every link this node opens (keys.py)
        self.max_children = max_children
        self.parent_timeout = parent_timeout
        self.tracker_timeout = tracker_timeout
        self.next_heartbeat = 0.0
        self.tracker_heard = time.monotonic()
        self.hello_sent = 0.0
        self.rate = 0.0  # recent verified bytes/s, for the stall bound
        self.rate_mark = (time.monotonic(), 0)
        self.hello_fields = hello or {}  # what we told the tracker when joining, repeated if it restarts
        self.reader = None  # a seeder restarted from the catalog reads chunks from storage as they are asked for
        self.ready_rx = None
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
        self.stripes = 1  # stripe trees of the topology; set by add_parent
        self.digest = chunk_hasher(manifest.hash)
        self.upstreams: list[Upstream] = []
        self.conns: dict[bytes, Connection] = {}
        self.children: dict[bytes, Child] = {}
        self.members: dict[bytes, int] = {}
        self.parked: dict[int, list[bytes]] = defaultdict(list)
        self.bad: dict[bytes, int] = defaultdict(int)
        self.seen: dict[bytes, float] = {}  # last message from each connection, for pruning idle ones
        self.next_prune = 0.0
        self.stats = Stats()
        self.faults = faults.from_env()  # test-only fault injection; None unless asked for in the environment
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
        """Open the link to our parent in ``stripe`` and queue the chunks it will send us.

        If we already had a parent in that stripe it is replaced; the chunks still
        missing are asked of the new one (resuming from the bitfield)."""
        self.stripes = stripes
        old = next((u for u in self.upstreams if u.stripe == stripe), None)
        if old is not None:
            self.upstreams.remove(old)
            if old.lost is None:
                self.poller.unregister(old.socket)
                old.socket.close(0)
            self.stats.reparented += 1
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
        self._post(up.socket, protocol.control(Msg.ATTACH, peer_id=self.peer_id, rank=self.rank,
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
                    elif sock is self.ready_rx:
                        self._drain(sock, self._on_source_ready)
                    else:
                        up = next((u for u in self.upstreams if u.socket is sock), None)
                        if up is not None:  # None: replaced by a REPARENT earlier in this poll
                            self._drain(sock, lambda s, up=up: self._on_upstream(up))
                self._tick(time.monotonic())
        except Exception as e:  # a bug: fail the download loudly rather than hang its waiters
            log.exception("node loop crashed")
            self._fail(f"internal error: {e!r}")
        finally:
            self._close_sockets()

    def _drain(self, sock, handler, budget: int = 64) -> None:
        for _ in range(budget):
            if sock.closed or not sock.poll(0, zmq.POLLIN):  # a handler may close it (parent given up)
                return
            handler(sock)

    def _tick(self, now: float) -> None:
        """Timers: heartbeats, silent parents, stalled requests, completion, leaving."""
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL
            self._heartbeat(now)
        for up in list(self.upstreams):
            self._watch_parent(up, now)
        if self.tracker_link is None or self.fatal:
            return
        if now - self.tracker_heard > self.tracker_timeout and now - self.hello_sent > RETRY_INTERVAL:
            self._reintroduce(now)
        if self.store.complete and all(ok() for ok in self.extra_done):
            if not self.done_reported:
                self.done_reported = True
                self._post(self.tracker_link, protocol.control(Msg.DONE, rank=self.rank))
            if self.leave_when_done and now >= self.leave_next:
                self.leave_next = now + LEAVE_POLL
                self._post(self.tracker_link, protocol.control(Msg.LEAVE, rank=self.rank))

    def _heartbeat(self, now: float) -> None:
        """Tell children and members we live; learn who disconnected; update the recent rate."""
        beat = protocol.control(Msg.HEARTBEAT)
        for ident in list(self.children):
            self._send(ident, beat)
        if self.tracker is not None:
            for ident in list(self.members):
                self._send(ident, beat)
        if self.tracker_link is not None:
            self._post(self.tracker_link, beat)
        if now >= self.next_prune:
            self.next_prune = now + IDLE_FORGET / 2
            self._prune(now)
        t0, b0 = self.rate_mark
        if now - t0 >= 1.0:
            self.rate = (self.store.bytes - b0) / (now - t0)
            self.rate_mark = (now, self.store.bytes)

    def _prune(self, now: float) -> None:
        """Forget connections that are neither child nor member and have been quiet a while,
        so strangers opening connections cannot grow this node's memory without bound."""
        for ident, last in list(self.seen.items()):
            if now - last > IDLE_FORGET and ident not in self.children and ident not in self.members:
                del self.seen[ident]
                self.conns.pop(ident, None)
                self.bad.pop(ident, None)

    def _watch_parent(self, up: Upstream, now: float) -> None:
        """Give up a silent parent; re-ask requests that stalled; nag the tracker for a new parent."""
        if up.lost is not None:
            if self.tracker_link is not None and now - up.orphan_sent > RETRY_INTERVAL \
                    and now - self.tracker_heard < self.tracker_timeout:
                up.orphan_sent = now
                self._post(self.tracker_link, protocol.control(Msg.ORPHAN, rank=self.rank, stripe=up.stripe,
                                                               parent=up.rank, reason=up.lost, dead=up.dead))
            return
        if not (up.todo or up.outstanding):
            return
        if now - up.last_heard > self.parent_timeout:
            if self.tracker_link is None:
                self._fail(f"parent {up.addr} (rank {up.rank}) did not answer within {self.parent_timeout:.0f} s")
            else:
                self._orphan(up, f"silent for {now - up.last_heard:.1f} s", dead=True)
            return
        if up.conn.state != "attached" or not up.outstanding:
            return
        if up.rank != 0 and self.tracker_link is not None and now - up.last_chunk > 3 * self.parent_timeout:
            # it answers heartbeats but sends no chunk (its own parent's silence would have been
            # repaired by now): another holder up the tree, its nearest live ancestor, takes over
            self._orphan(up, f"stalled: no chunk for {now - up.last_chunk:.1f} s though it is alive")
            return
        bound = min(max(STALL_MIN, 4 * self.window * self.manifest.chunk_size / max(self.rate, 1.0)),
                    2 * self.parent_timeout)
        stalled = [i for i in up.outstanding if now - up.sent_at.get(i, now) > bound]
        if not stalled:
            return
        self.stats.stalled += len(stalled)
        log.warning("re-requesting chunk(s) %s from parent %s: outstanding longer than %.1f s "
                    "(4 credit windows at the recent rate)", stalled[:8], up.addr, bound)
        for i in stalled:
            up.sent_at[i] = now
        self._post(up.socket, protocol.request(stalled[:protocol.MAX_REQUEST]))

    def _orphan(self, up: Upstream, reason: str, dead: bool = False) -> None:
        """Stop pulling from ``up``'s parent; ask the tracker for another in that stripe."""
        log.warning("giving up parent %s (rank %d) in stripe %d: %s; asking the tracker for another",
                    up.addr, up.rank, up.stripe, reason)
        up.lost, up.dead = reason, dead
        up.requeue()
        up.orphan_sent = 0.0
        self.poller.unregister(up.socket)
        up.socket.close(0)

    def _reintroduce(self, now: float) -> None:
        """The tracker went quiet (restarted?): HELLO again with our rank and what we hold."""
        if self.hello_sent == 0.0 or now - self.hello_sent > 5 * RETRY_INTERVAL:
            log.warning("tracker %s silent for %.0f s: introducing ourselves again", self.tracker_addr,
                        now - self.tracker_heard)
        self.hello_sent = now
        self._post(self.tracker_link, protocol.control(Msg.HELLO, **self.hello_fields, rank=self.rank,
                                                       have=self.store.count))

    @staticmethod
    def _post(sock: zmq.Socket, frame: bytes) -> bool:
        """Send one frame to a parent or the tracker without ever blocking the loop.

        A DEALER whose peer is down queues up to its high-water mark and then
        would block; dropping is right for these messages (requests are re-asked,
        heartbeats and reports are repeated)."""
        try:
            sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _fail(self, message: str) -> None:
        if self.fatal is None:  # not logged here: every wait raises it, and the CLI prints it once
            self.fatal = message
            log.debug("fatal: %s", message)
            self.store.fail(message)
            self.stop_event.set()

    def _close_sockets(self) -> None:
        if self.tracker_link is not None and not self.left.is_set():
            try:  # tell the tracker we are gone, so no joiner is sent to a dead parent
                self._post(self.tracker_link, protocol.control(Msg.BYE, rank=self.rank))
                self.tracker_link.setsockopt(zmq.LINGER, 500)
            except zmq.ZMQError:
                pass
        for up in self.upstreams:
            up.socket.close(0)
        if self.reader is not None:
            self.reader.stop()
            self.ready_rx.close(0)
        if self.tracker_link is not None:
            self.tracker_link.close(0)
        self.router.close(0)

    # ----- upstream: chunks from our parents -----------------------------

    def _on_upstream(self, up: Upstream) -> None:
        sock = up.socket
        up.last_heard = time.monotonic()
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
        elif event.type == Msg.ERROR and event.fields.get("fatal"):
            self._fail(f"parent {up.addr} refused us: {event.fields.get('message')}")
        elif event.type == Msg.ERROR:  # it lost our state (restarted?): attach again, ask again
            log.warning("parent %s: %s; attaching again", up.addr, event.fields.get("message"))
            up.conn.state = "attaching"
            up.requeue()
            self._attach(up)

    def _on_chunk(self, up: Upstream, index: int) -> None:
        """A chunk arrived: verify it in place, then publish and forward it, or drop it."""
        sock = up.socket
        if index < self.manifest.n_chunks and self.store.has(index):  # e.g. the answer to a stall re-request
            self._discard_rest(sock)
            self.stats.duplicates += 1
            up.outstanding.discard(index)
            return
        if index >= self.manifest.n_chunks or index not in up.outstanding:
            self._discard_rest(sock)
            self.stats.malformed += 1
            log.warning("parent %s sent chunk %d, which we did not ask it for: dropped", up.addr, index)
            return
        up.outstanding.discard(index)
        up.sent_at.pop(index, None)
        up.last_chunk = time.monotonic()
        view = self.store.chunk(index)
        n = sock.recv_into(view)
        self._discard_rest(sock)
        self.stats.chunks_received += 1
        if self.faults is not None:
            self.faults.received()
        if n != len(view) or self.digest(view) != self.manifest.chunks[index]:
            self.stats.bad_chunks += 1
            up.todo.appendleft(index)
            up.bad += 1
            log.warning("chunk %d from parent %s failed verification (%d bytes): dropped, fetching it again",
                        index, up.addr, n)
            if up.bad >= MAX_BAD_FROM_PARENT:
                self._orphan(up, f"sent {up.bad} chunks that failed verification")
                return
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
            self._post(up.socket, protocol.request(want))

    def attach_source(self, source) -> None:
        """Serve chunks not yet held by reading them from ``source`` (a seeder restarted from the catalog)."""
        from .source import ReadAhead

        addr = f"inproc://p2pw-readahead-{id(self)}"
        self.ready_rx = self.ctx.socket(zmq.PULL)
        self.ready_rx.bind(addr)
        tx = self.ctx.socket(zmq.PUSH)  # used (and closed) only by the read-ahead thread from here on
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(addr)
        self.reader = ReadAhead(source, self.store, lambda i, ok: tx.send(READY.pack(i, ok)), on_exit=tx.close)
        self.poller.register(self.ready_rx, zmq.POLLIN)

    def _on_source_ready(self, sock) -> None:
        index, ok = READY.unpack(sock.recv())
        if ok:
            self._publish(index)
        else:
            log.error("chunk %d read from storage does not match the manifest: the checkpoint changed under "
                      "the seeder (or cannot be read); not serving it (restart the seeder to rescan)", index)

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
        self.tracker_heard = time.monotonic()
        if event.type == Msg.WELCOME:  # a restarted tracker took us back
            if self.hello_sent:
                log.warning("tracker %s is back: we are rank %d", self.tracker_addr, event.fields["rank"])
            self.hello_sent = 0.0
            self.done_reported = False  # tell the (new) tracker again
            self.rank = event.fields["rank"]
            self._on_reparent(event.fields["parents"])
        elif event.type == Msg.LEAVE_OK:
            self.left.set()
            self.stop_event.set()
        elif event.type == Msg.REPARENT:
            self._on_reparent(event.fields["parents"])
        elif event.type == Msg.ERROR:  # it does not know us (restarted): introduce ourselves at once
            log.warning("tracker: %s", event.fields.get("message"))
            if time.monotonic() - self.hello_sent > RETRY_INTERVAL:
                self._reintroduce(time.monotonic())

    def _on_reparent(self, parents: list) -> None:
        """The tracker moved us: in each stripe whose parent changed (or was lost), pull from the new one.

        The old link is closed; its outstanding requests (and chunks in flight
        on it) are asked of the new parent, which parks them until it holds them.
        """
        clean = []
        for p in parents:
            try:
                clean.append({"stripe": int(p["stripe"]), "rank": int(p["rank"]), "addr": str(p["addr"] or "")})
            except (KeyError, TypeError, ValueError):
                self.stats.malformed += 1
                log.warning("tracker sent a bad REPARENT entry %r: ignored", p)
                continue
            if not 0 <= clean[-1]["stripe"] < self.stripes:
                self.stats.malformed += 1
                log.warning("tracker sent a REPARENT for stripe %d, which does not exist: ignored", clean.pop()["stripe"])
        for p in clean:
            up = next((u for u in self.upstreams if u.stripe == p["stripe"]), None)
            addr = p["addr"] or self.tracker_addr
            if up is None or up.lost is not None or up.rank != p["rank"] or up.addr != addr:
                log.warning("stripe %d: new parent rank %d at %s", p["stripe"], p["rank"], addr)
                self.add_parent(p["stripe"], self.stripes, addr, p["rank"])

    # ----- router: children, joiners, members ------------------------------

    def _on_router(self, sock) -> None:
        frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
        ident = frames[0]
        self.seen[ident] = time.monotonic()
        if self.bad.get(ident, 0) >= MAX_BAD_MESSAGES:
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
        rank = self.members.pop(ident, None)
        if rank is not None and self.tracker is not None:
            self._member_gone(rank, "disconnected")
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
        if self.faults is not None:
            data = self.faults.outgoing(index, data)
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
            old_rank = f.get("rank") if isinstance(f.get("rank"), int) else None
            member = self.tracker.join(f["peer_id"], f["listen"], rank=old_rank)
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
        for moved in self.tracker.adoptions(member):
            self._send_parents(moved.rank)

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
            if not self.store.has(index) and self.reader is not None:
                self.reader.want(index)
            if self.store.has(index):
                self._send_chunk(ident, index)
            elif ident in self.parked.get(index, ()):
                continue  # asked again (a stall re-request): it is already parked
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
            self._member_gone(rank, "left")

    def _member_gone(self, rank: int, why: str) -> None:
        """Peer ``rank`` is gone: re-attach its dependents to their nearest live ancestors, and tell them now."""
        if rank not in self.tracker.members or self.tracker.members[rank].left:
            return
        moved = self.tracker.gone(rank)
        log.info("peer rank %d %s%s", rank, why,
                 f"; re-attaching {', '.join(f'rank {r}' for r, _ in moved)}" if moved else "")
        for r, _ in moved:
            self._send_parents(r)

    def _send_parents(self, rank: int) -> None:
        """Tell member ``rank`` (on its tracker link) who its parents are now."""
        ident = next((i for i, r in self.members.items() if r == rank), None)
        if ident is not None:
            self._send(ident, protocol.control(
                Msg.REPARENT, parents=self.tracker.parent_addrs(self.tracker.members[rank])))

    def _on_orphan(self, ident: bytes, event) -> None:
        rank = self.members.get(ident)
        f = event.fields
        if rank is None or rank != f["rank"] or rank not in self.tracker.members:
            raise ProtocolError("ORPHAN from a connection that is not that member")
        member = self.tracker.members[rank]
        if not 0 <= f["stripe"] < len(member.parents):
            raise ProtocolError(f"ORPHAN for stripe {f['stripe']}, which does not exist")
        dead = f.get("dead") is True
        if dead and f["parent"] in self.tracker.members and not self.tracker.members[f["parent"]].left:
            self._member_gone(f["parent"], f"reported silent by rank {rank}")
        new = self.tracker.reparent(rank, f["stripe"], f["parent"], dead)
        log.info("rank %d lost parent rank %d in stripe %d (%s): now under rank %d",
                 rank, f["parent"], f["stripe"], f["reason"], new)
        self._send_parents(rank)

    def _on_member_heartbeat(self, ident: bytes, event) -> None:
        rank = self.members.get(ident)
        if rank is not None:
            self.tracker.touch(rank)

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
        Msg.ORPHAN: _on_orphan,
        Msg.HEARTBEAT: _on_member_heartbeat,
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
