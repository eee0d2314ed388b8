"""Node: the event loop of one p2pweights process.

One thread owns every socket and all mutable network state (like Kraken's
scheduler): the ROUTER that partners and joiners talk to, a DEALER to each
partner this peer pulls from, one to the tracker, and the inbox through which
other threads (read-ahead, waiters, the disk writer, ``stop``) reach it.  The
loop polls, decodes, hands each event to the objects that decide (``pull``:
what to ask of whom; ``serve``: whom to send what next; ``endpoint``: the
tracker's member handlers, on the seeder) and sends what they return.

A chunk is received straight into its place in the store, hashed, and only
then published: marked held, announced to partners in the next HAVE batch,
and sent to every partner whose request was parked on it.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np
import zmq

from . import faults, keys, protocol
from .endpoint import MAX_NAME, TrackerEndpoint  # noqa: F401  (MAX_NAME: part of the node's limits)
from .handlers import MAX_BAD_FROM_PARENT, MAX_BAD_MESSAGES, READY, Child, Handlers  # noqa: F401
from .manifest import chunk_hasher
from .protocol import CLIENT_TRANSITIONS, Connection, Msg
from .pull import DEFAULT_WINDOW, PullScheduler
from .serve import MAX_PARKED, UploadScheduler

log = logging.getLogger("p2pw")

MAX_WINDOW = MAX_PARKED  # most requests a partner may have waiting here
MAX_CHILDREN = 64  # partners one node serves at once; more are refused at ATTACH
LEAVE_POLL = 0.2
HEARTBEAT_INTERVAL = 0.5  # to partners we serve, and peers <-> tracker
PARENT_TIMEOUT = 5.0  # a partner silent this long is given up (configurable)
TRACKER_TIMEOUT = 10.0  # a tracker silent this long is re-introduced to (it may have restarted)
IDLE_FORGET = 60.0  # a quiet connection that is neither partner nor member is forgotten after this long
RETRY_INTERVAL = 1.0  # ORPHAN / HELLO resend while waiting for the tracker
WAIT_REPORT = 10.0  # seconds between "waiting for ..." lines when nothing arrives
GIVE_UP_AFTER = 300.0  # seconds with nothing to fetch from anyone before a join fails
SEND_BUDGET = 256  # chunks handed to ZeroMQ per loop turn
ROUTER_MAX_MSG = 1 << 20


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
    switches: int = 0  # chunks taken from a partner other than the planned source

    @property
    def refetched(self) -> int:
        """Chunks fetched again: each one that failed verification."""
        return self.bad_chunks


@dataclass
class PartnerLink:
    """This peer's DEALER to one partner it pulls from."""

    rank: int
    addr: str
    socket: zmq.Socket
    conn: Connection
    last_heard: float
    last_chunk: float
    orphan_sent: float = 0.0


def tcp(addr: str) -> str:
    return addr if "://" in addr else f"tcp://{addr}"


class Node:
    """Serves its store to partners; a peer also pulls from partners and reports to the tracker."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, manifest, store, *, peer_id: str,
                 tracker=None, window: int = DEFAULT_WINDOW,
                 key: keys.FleetKey | None = None, max_children: int = MAX_CHILDREN,
                 parent_timeout: float = PARENT_TIMEOUT, tracker_timeout: float = TRACKER_TIMEOUT,
                 hello: dict | None = None, give_up_after: float = GIVE_UP_AFTER, clock=time.monotonic):
        self.ctx, self.router, self.manifest, self.store = ctx, router, manifest, store
        self.model_id = manifest.model_id
        self.peer_id, self.key, self.clock = peer_id, key, clock
        self.max_children, self.parent_timeout, self.tracker_timeout = max_children, parent_timeout, tracker_timeout
        self.give_up_after = give_up_after
        self.hello_fields = hello or {}  # what we told the tracker when joining, repeated if it restarts
        self.digest = chunk_hasher(manifest.hash)
        self.stats = Stats()
        self.faults = faults.from_env()  # test-only fault injection; None unless asked for in the environment
        n = manifest.n_chunks
        self.serve = UploadScheduler(n, store.has, fresh_first=tracker is not None)
        self.pull = PullScheduler(n, manifest.chunk_size, store.have, window=window, clock=clock)
        self.endpoint = TrackerEndpoint(tracker, manifest, clock) if tracker is not None else None
        self.tracker = tracker
        self.links: dict[int, PartnerLink] = {}
        self.plan: list[dict] = []  # {stripe, rank, addr} per stripe, as the tracker said
        self.lost: dict[int, tuple[str, bool]] = {}  # planned rank given up -> (why, dead), until re-planned
        self.lost_reported: dict[int, float] = {}  # planned rank -> when we last sent ORPHAN for it
        self.conns: dict[bytes, Connection] = {}
        self.children: dict[bytes, Child] = {}
        self.bad: dict[bytes, int] = {}
        self.seen: dict[bytes, float] = {}  # last message from each connection, for pruning idle ones
        self.fresh: list[int] = []  # verified since the last HAVE batch
        self.tracker_addr: str | None = None
        self.tracker_link: zmq.Socket | None = None
        self.tracker_conn: Connection | None = None
        self.rank = 0
        now = clock()
        self.tracker_heard = self.progress_at = self.reported_wait = now
        self.next_heartbeat = self.next_prune = self.hello_sent = self.leave_next = 0.0
        self.reader = None  # a seeder serving a known manifest reads chunks from storage as peers ask
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.inbox = ctx.socket(zmq.PULL)  # every other thread reaches the loop through here
        self.inbox_addr = f"inproc://p2pw-inbox-{id(self)}"
        self.inbox.bind(self.inbox_addr)
        self.poller.register(self.inbox, zmq.POLLIN)
        self._outside, self._outside_lock = None, threading.Lock()
        self.stop_event, self.left = threading.Event(), threading.Event()
        self.leave_when_done = self.done_reported = False
        self.extra_done = []  # callables that must be true before the peer counts as done (disk cache)
        self.fatal: str | None = None
        self.thread: threading.Thread | None = None

    # ----- other threads -------------------------------------------------

    def post(self, verb: bytes, body: bytes = b"") -> None:
        """From any thread: hand ``verb`` to the loop (``urgent``, ``fail``, ``stop``)."""
        with self._outside_lock:
            if self._outside is None:
                self._outside = self.ctx.socket(zmq.PUSH)
                self._outside.setsockopt(zmq.LINGER, 0)
                self._outside.connect(self.inbox_addr)
            try:
                self._outside.send_multipart([verb, body], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def prioritize(self, chunks) -> None:
        """From a reader's thread: fetch ``chunks`` before anything else."""
        missing = [i for i in chunks if not self.store.has(i)]
        if missing:
            self.post(b"urgent", struct.pack(f"<{len(missing)}I", *missing))

    def fail(self, message: str) -> None:
        """From any thread: end the download with ``message``."""
        self.post(b"fail", message.encode())

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="p2pw-node", daemon=True)
        self.thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self.stop_event.set()
        self.post(b"stop")
        if self.thread and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        with self._outside_lock:
            if self._outside is not None:
                self._outside.close(0)
                self._outside = None

    # ----- setup ---------------------------------------------------------

    def attach_tracker(self, socket: zmq.Socket, addr: str, rank: int) -> None:
        """Adopt the (already welcomed) DEALER to the tracker."""
        self.tracker_link, self.tracker_addr, self.rank = socket, addr, rank
        self.tracker_conn = Connection(CLIENT_TRANSITIONS, "member")
        self.poller.register(socket, zmq.POLLIN)

    def set_plan(self, parents: list[dict], partners: list[dict], stripes: int | None = None) -> None:
        """The tracker's plan for us: a planned source per stripe, and partners to pull from too.

        Links to partners no longer named are closed (their requests asked
        elsewhere); new ones are opened.  Entries are checked: a bad one is
        ignored, never trusted."""
        if stripes is not None and stripes != self.pull.stripes:
            self.pull.stripes = stripes
            self.pull.stripe_of = np.arange(self.manifest.n_chunks) % stripes
        plan, want = [None] * self.pull.stripes, {}
        for p in parents:
            if not self._entry_ok(p, stripe=True):
                continue
            plan[p["stripe"]] = p["rank"]
            want[p["rank"]] = p["addr"] or self.tracker_addr
        for p in partners:
            if self._entry_ok(p) and p["rank"] != self.rank:
                want.setdefault(p["rank"], p["addr"] or self.tracker_addr)
        if [x for x in plan if x is not None] != [x for x in self.pull.plan if x is not None]:
            self.stats.reparented += 1 if self.plan else 0
        self.plan = [{"stripe": s, "rank": r, "addr": want.get(r, "")} for s, r in enumerate(plan) if r is not None]
        self.pull.set_plan(plan)
        self.lost = {r: v for r, v in self.lost.items() if r in plan}
        for rank in [r for r in self.links if r not in want or self.links[r].addr != want[r]]:
            self._close_link(rank)
        for rank, addr in want.items():
            if rank not in self.links and not self.store.complete:
                self._open_link(rank, addr)

    def _entry_ok(self, p, stripe: bool = False) -> bool:
        ok = isinstance(p, dict) and isinstance(p.get("rank"), int) and isinstance(p.get("addr", ""), str) \
            and (not stripe or (isinstance(p.get("stripe"), int) and 0 <= p["stripe"] < self.pull.stripes))
        if not ok:
            self.stats.malformed += 1
            log.warning("tracker sent a bad plan entry %r: ignored", p)
        return ok

    def _open_link(self, rank: int, addr: str) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.manifest.chunk_size, protocol.MAX_CONTROL_BODY) + 4096)
        sock.setsockopt(zmq.RCVHWM, 4 * MAX_WINDOW)
        keys.secure_client(sock, self.key)
        sock.connect(tcp(addr))
        now = self.clock()
        self.links[rank] = PartnerLink(rank, addr, sock, Connection(CLIENT_TRANSITIONS, "attaching"), now, now)
        self.pull.add(rank)
        self.poller.register(sock, zmq.POLLIN)
        self._post(sock, protocol.control(Msg.ATTACH, peer_id=self.peer_id, rank=self.rank, model_id=self.model_id))

    def _close_link(self, rank: int) -> None:
        link = self.links.pop(rank, None)
        if link is not None:
            self.poller.unregister(link.socket)
            link.socket.close(0)
        self.pull.drop(rank)

    def parents(self) -> list[dict]:
        """Our planned source in each stripe now (the tracker may have moved us since we joined)."""
        return list(self.plan)

    # ----- the loop ------------------------------------------------------

    def run(self) -> None:
        handlers = Handlers(self)
        try:
            while not self.stop_event.is_set():
                busy = self.serve.pending()
                for sock, _ in self.poller.poll(1 if busy else 50):
                    handlers.dispatch(sock)
                self._flush()
                self._tick(self.clock())
        except Exception as e:  # a bug: fail the download loudly rather than hang its waiters
            log.exception("node loop crashed")
            self._fail(f"internal error: {e!r}")
        finally:
            self._close_sockets()

    def _flush(self) -> None:
        """Send what the schedulers decided: requests, cancels, HAVE batches, chunks."""
        if self.links and not self.store.complete:
            for rank, chunks in self.pull.requests():
                link = self.links.get(rank)
                if link is not None:
                    for batch in protocol.batches(chunks):
                        self._post(link.socket, protocol.request(batch))
        for rank, chunks in self.pull.take_cancels():
            link = self.links.get(rank)
            if link is not None:
                for batch in protocol.batches(chunks):
                    self._post(link.socket, protocol.chunk_list(Msg.CANCEL, batch))
        if self.fresh:
            batches = protocol.batches(self.fresh)
            self.fresh = []
            for ident in list(self.children):
                for batch in batches:
                    self._send(ident, protocol.chunk_list(Msg.HAVE, batch))
        if self.endpoint is not None:
            for ident, frames in self.endpoint.take():
                self._send(ident, *frames)
        blocked = set()
        for _ in range(SEND_BUDGET):
            item = self.serve.next(skip=blocked)
            if item is None:
                break
            ident, index = item
            if not self._send_chunk(ident, index):
                self.serve.blocked(ident, index)
                blocked.add(ident)

    def _tick(self, now: float) -> None:
        """Timers: heartbeats, silent partners, stalled requests, completion, leaving, giving up."""
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_INTERVAL
            self._heartbeat(now)
        if self.endpoint is not None:
            self.endpoint.review()
        for link in list(self.links.values()):
            self._watch_link(link, now)
        for rank, chunks in self.pull.stalled():
            self.stats.stalled += len(chunks)
            log.warning("re-requesting chunk(s) %s elsewhere: outstanding at rank %d far longer than "
                        "its rate explains", chunks[:8], rank)
        if self.tracker_link is None or self.fatal:
            return
        self._watch_progress(now)
        if now - self.tracker_heard > self.tracker_timeout and now - self.hello_sent > RETRY_INTERVAL:
            self._reintroduce(now)
        for rank, (why, dead) in self.lost.items():
            self._orphan_report(rank, why, dead, now)
        if self.store.complete and all(ok() for ok in self.extra_done):
            if not self.done_reported:
                self.done_reported = True
                self._post(self.tracker_link, protocol.control(Msg.DONE, rank=self.rank))
                for rank in list(self.links):  # nothing more to pull: only serve from now on
                    self._close_link(rank)
            if self.leave_when_done and now >= self.leave_next:
                self.leave_next = now + LEAVE_POLL
                self._post(self.tracker_link, protocol.control(Msg.LEAVE, rank=self.rank))

    def _watch_progress(self, now: float) -> None:
        """Nothing verified for a while: say what we wait for every WAIT_REPORT s, give up at the end."""
        if self.store.complete or now - self.progress_at < min(WAIT_REPORT, self.give_up_after):
            return
        if now - self.progress_at > self.give_up_after:
            self._fail(f"no chunk arrived for {self.give_up_after:.0f} s: {self.pull.missing()} of "
                       f"{self.manifest.n_chunks} chunks missing and no partner serves them "
                       f"(verified chunks are kept: join again to resume)")
        elif now - self.reported_wait >= WAIT_REPORT and now - self.progress_at >= WAIT_REPORT:
            self.reported_wait = now
            orphaned = self.pull.waiting_for()
            log.warning("waiting %.0f s for chunks: %d missing, %d of them held by no live partner "
                        "(first %s); partners %s; giving up after %.0f s", now - self.progress_at,
                        self.pull.missing(), len(orphaned), orphaned[:8],
                        sorted(self.links) or "none", self.give_up_after)

    def _heartbeat(self, now: float) -> None:
        """Tell partners and members we live; report what we hold and measure to the tracker."""
        beat = protocol.control(Msg.HEARTBEAT)
        for ident in list(self.children):
            self._send(ident, beat)
        if self.endpoint is not None:
            for ident in list(self.endpoint.members):
                self._send(ident, beat)
        if self.tracker_link is not None:
            rates = {str(r): round(lk.rate) for r, lk in self.pull.links.items() if lk.rate > 0}
            self._post(self.tracker_link, protocol.control(Msg.HEARTBEAT, have=self.store.count, links=rates))
        if now >= self.next_prune:
            self.next_prune = now + IDLE_FORGET / 2
            self._prune(now)

    def _prune(self, now: float) -> None:
        """Forget connections that are neither partner nor member and have been quiet a while,
        so strangers opening connections cannot grow this node's memory without bound."""
        members = self.endpoint.members if self.endpoint is not None else {}
        for ident, last in list(self.seen.items()):
            if now - last > IDLE_FORGET and ident not in self.children and ident not in members:
                del self.seen[ident]
                self.conns.pop(ident, None)
                self.bad.pop(ident, None)

    def _watch_link(self, link: PartnerLink, now: float) -> None:
        """Give up a silent partner, or a planned source that answers but sends nothing."""
        if now - link.last_heard > self.parent_timeout:
            self.give_up(link.rank, f"silent for {now - link.last_heard:.1f} s", dead=True)
            return
        planned = any(p["rank"] == link.rank for p in self.plan)
        lk = self.pull.links.get(link.rank)
        if planned and link.rank != 0 and lk is not None and lk.outstanding \
                and now - link.last_chunk > 3 * self.parent_timeout and self.tracker_link is not None:
            self.give_up(link.rank, f"stalled: no chunk for {now - link.last_chunk:.1f} s though it is alive")

    def give_up(self, rank: int, reason: str, dead: bool = False) -> None:
        """Stop pulling from partner ``rank``; if it was a planned source, ask the tracker for another."""
        log.warning("giving up partner rank %d: %s", rank, reason)
        self._close_link(rank)
        if any(p["rank"] == rank for p in self.plan):
            self.lost[rank] = (reason, dead)
            if self.tracker_link is None:
                self._fail(f"parent rank {rank} {reason}")

    def _orphan_report(self, rank: int, why: str, dead: bool, now: float) -> None:
        if now - self.lost_reported.get(rank, 0.0) <= RETRY_INTERVAL or \
                now - self.tracker_heard > self.tracker_timeout:
            return
        self.lost_reported[rank] = now
        for p in self.plan:
            if p["rank"] == rank:
                self._post(self.tracker_link, protocol.control(Msg.ORPHAN, rank=self.rank, stripe=p["stripe"],
                                                               parent=rank, reason=why, dead=dead))

    def _reintroduce(self, now: float) -> None:
        """The tracker went quiet (restarted?): HELLO again with our rank and what we hold."""
        if self.hello_sent == 0.0 or now - self.hello_sent > 5 * RETRY_INTERVAL:
            log.warning("tracker %s silent for %.0f s: introducing ourselves again", self.tracker_addr,
                        now - self.tracker_heard)
        self.hello_sent = now
        self._post(self.tracker_link, protocol.control(Msg.HELLO, **self.hello_fields, rank=self.rank,
                                                       have=self.store.count))

    # ----- sending -------------------------------------------------------

    @staticmethod
    def _post(sock: zmq.Socket, frame: bytes) -> bool:
        """Send one frame to a partner or the tracker without ever blocking the loop.

        A DEALER whose peer is down queues up to its high-water mark and then
        would block; dropping is right for these messages (requests are re-asked,
        heartbeats and reports are repeated)."""
        try:
            sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _send(self, ident: bytes, *frames, copy=True) -> bool:
        try:
            self.router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=copy)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self.forget(ident)
                return False
            raise

    def _send_chunk(self, ident: bytes, index: int) -> bool:
        """Send chunk ``index`` to ``ident``; False if it would block (try again later)."""
        data = self.store.chunk(index)
        if self.faults is not None:
            data = self.faults.outgoing(index, data)
            if data is None:
                return True
        if self._send(ident, protocol.chunk_header(index), data, copy=False):
            self.stats.chunks_sent += 1
            self.stats.bytes_sent += len(data)
            self.serve.sent(index)
            return True
        return ident not in self.children  # gone: nothing to retry

    def forget(self, ident: bytes) -> None:
        """Connection ``ident`` is gone or ignored: drop what it asked for; a member is gone."""
        if self.endpoint is not None and ident in self.endpoint.members:
            self.endpoint.bye(ident)
        self.children.pop(ident, None)
        self.serve.detach(ident)

    # ----- chunks --------------------------------------------------------

    def attach_source(self, source) -> None:
        """Serve chunks not yet held by reading them from ``source`` (a seeder with a known manifest)."""
        from .source import ReadAhead

        tx = self.ctx.socket(zmq.PUSH)  # used (and closed) only by the read-ahead thread from here on
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(self.inbox_addr)
        self.reader = ReadAhead(source, self.store, lambda i, ok: tx.send_multipart([b"ready", READY.pack(i, ok)]),
                                on_exit=tx.close)

    def publish(self, index: int) -> None:
        """Chunk ``index`` is verified: make it visible, announce it, send it to whoever waits on it."""
        self.store.verified(index)
        self.progress_at = self.clock()
        if not self.pull.have[index]:
            self.pull.verified(index)
        self.serve.verified(index)
        self.fresh.append(index)

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
        for link in self.links.values():
            link.socket.close(0)
        if self.reader is not None:
            self.reader.stop()
        if self.tracker_link is not None:
            self.tracker_link.close(0)
        self.inbox.close(0)
        self.router.close(0)


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
