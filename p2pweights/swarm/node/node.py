"""Node: the event loop of one p2pweights process.

One thread owns every socket and all mutable network state (like Kraken's
scheduler): the ROUTER that partners and joiners talk to, a DEALER to each
partner this peer pulls from, one to the tracker, and the inbox through which
other threads (read-ahead, waiters, the workers, ``stop``) reach it.  The
loop polls, decodes, hands each event to the objects that decide (``pull``:
what to ask of whom; ``serve``: whom to send what next; ``endpoint``: the
tracker's member handlers, on the seeder) and sends what they return.

A chunk is taken off the wire as ZeroMQ's buffer and handed to the intake
(``intake``): worker threads hash it and write it where it belongs only if
it matches, and the loop, told on the inbox, only then publishes it: marks
it held, announces it to partners in the next HAVE batch, and sends it to
every partner whose request was parked on it.
"""
from __future__ import annotations

import errno
import logging
import random
import struct
import threading
import time

import zmq

from ... import failpoints as faults
from ...wire import keys, protocol
from ...errors import P2PError
from .handlers import MAX_BAD_FROM_PARENT, MAX_BAD_MESSAGES, NOBLOCK, READY, Child, Handlers  # noqa: F401
from ...sources.manifest import chunk_hasher
from ..tracker.admission import CHILD_TIMEOUT, MAX_PER_HOST, Admission
from .forward import Forwarding
from .intake import Intake
from .lanes import Lanes
from .member import Membership
from .originread import back_to_source
from .partners import Partners, send_nowait, tcp  # noqa: F401  (tcp: part of the node's surface)
from ...wire.context import default_lanes
from ...wire.protocol import MAX_LANE, MAX_NAME, YOUNG, Connection, Msg  # noqa: F401  (MAX_NAME: the node's limits)
from ..policy.pull import DEFAULT_WINDOW, PullScheduler
from ..policy.serve import MAX_PARKED, Announcer, UploadScheduler

log = logging.getLogger("p2pw")

MAX_WINDOW = MAX_PARKED  # most requests a partner may have waiting here
MAX_CHILDREN = 64  # partners one node serves at once; more are refused at ATTACH
TIMER_INTERVAL = 0.02  # the loop looks at its timers at most this often
HEARTBEAT_INTERVAL = 0.5  # to partners we serve, and peers <-> tracker
YOUNG_HEARTBEAT_INTERVAL = HEARTBEAT_INTERVAL / 2  # within ``protocol.YOUNG`` of joining (the tracker reviews
#                                                   as often then: endpoint.YOUNG_REVIEW_INTERVAL)
PARENT_TIMEOUT = 5.0  # a partner silent this long is given up (configurable)
TRACKER_TIMEOUT = 10.0  # a tracker silent this long is re-introduced to (it may have restarted)
IDLE_FORGET = 60.0  # a quiet connection that is neither partner nor member is forgotten after this long
GIVE_UP_AFTER = 300.0  # seconds with nothing to fetch from anyone before a join fails
SEND_BUDGET = 256  # chunks handed to ZeroMQ per loop turn
ROUTER_MAX_MSG = 1 << 20
FRAME_HEAP_KEEP = 128 << 20  # freed frame memory glibc keeps for the next frames (``keep_frame_memory``)


def keep_frame_memory() -> None:
    """Make glibc reuse the memory of freed ZeroMQ frames instead of returning it to the kernel.

    libzmq mallocs every received frame (a chunk: 512 KiB by default).  glibc
    maps an allocation that size afresh and unmaps it at free (and trims a
    thread arena's freed top), so every chunk's pages were faulted in and
    zeroed again: ``clear_page`` alone was a quarter of a join's CPU (perf,
    256 MiB on loopback: 0.15-0.33 s of system time against 0.08-0.16 with
    this).  Frames up to 32 MiB now come from the heap, and up to
    ``FRAME_HEAP_KEEP`` bytes freed at its top stay mapped: the resident peak
    is unchanged (credits bound the frames alive at once), it is just not
    given back between chunks.  A no-op where the C library has no mallopt.
    """
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(-1, FRAME_HEAP_KEEP)  # M_TRIM_THRESHOLD
        mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (glibc's largest)


class Stats:
    """Counters a node reports: ``bytes_received`` counts chunk bytes received into the store (verified
    or not), ``switches`` chunks taken from a partner other than the planned source; ``bad_from``: chunks that
    failed verification, by the address of the partner that sent them; ``arrivals`` (traced joins): (clock,
    chunk, from rank, planned rank) per verified chunk."""

    def __init__(self):
        self.chunks_sent = self.bytes_sent = self.chunks_received = self.bytes_received = 0
        self.bad_chunks = self.duplicates = self.malformed = self.stalled = 0
        self.bad_from: dict[str, int] = {}
        self.reparented = self.resumed = self.switches = 0
        self.origin_chunks = 0  # chunks this node read from the origin and served (an origin reader)
        self.lane_chunks = [0] * (MAX_LANE + 1)  # chunks received by lane number (0: partners' links)
        self.loop_passes = 0  # the loop's polls, each one pass over what is ready (a wake, unless it was busy)
        self.arrivals: list | None = None

    @property
    def refetched(self) -> int:
        """Chunks fetched again: each one that failed verification."""
        return self.bad_chunks


class Node:
    """Serves its store to partners; a peer also pulls from partners and reports to the tracker."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, manifest, store, *, peer_id: str,
                 tracker=None, window: int = DEFAULT_WINDOW,
                 key: keys.FleetKey | None = None, max_children: int = MAX_CHILDREN,
                 parent_timeout: float = PARENT_TIMEOUT, tracker_timeout: float = TRACKER_TIMEOUT,
                 hello: dict | None = None, give_up_after: float = GIVE_UP_AFTER, clock=time.monotonic,
                 child_timeout: float = CHILD_TIMEOUT, max_per_host: int = MAX_PER_HOST, workers: int = 0,
                 lanes: int | None = None):
        keep_frame_memory()
        self.ctx, self.router, self.manifest, self.store = ctx, router, manifest, store
        self.model_id = manifest.model_id
        self.peer_id, self.key, self.clock = peer_id, key, clock
        self.max_children, self.parent_timeout, self.tracker_timeout = max_children, parent_timeout, tracker_timeout
        self.give_up_after, self.young_until = give_up_after, clock() + YOUNG  # (sooner heartbeats until then)
        self.hello_fields = hello or {}  # what we told the tracker when joining, repeated if it restarts
        self.member: Membership | None = None  # a peer's tracker link (attach_tracker)
        self.digest = chunk_hasher(manifest.hash)
        self.stats = Stats()
        self.faults = faults.from_env()  # test-only fault injection; None unless asked for in the environment
        n = manifest.n_chunks
        self.pull = PullScheduler(n, manifest.chunk_size, store.have, window=window, clock=clock,
                                  rng=random.Random())
        self.serve = UploadScheduler(n, store.has, fresh_first=tracker is not None, clock=clock,
                                     stripes=lambda: self.pull.stripes)
        self.announcer = Announcer(self.serve, clock)
        self.endpoint = None  # the tracker's member handlers: on the seeder only
        # our secret, from the tracker, checks the tickets of peers attaching (None: admit anyone)
        self.secret, self.admission = None, Admission(max_per_host, child_timeout)
        if tracker is not None:
            from ..tracker.endpoint import TrackerEndpoint

            self.endpoint = TrackerEndpoint(tracker, manifest, clock)
            self.endpoint.keyed, self.secret = key is not None, tracker.seal.secret(0)
        self.tracker, self.partners = tracker, Partners(self)
        self.conns: dict[bytes, Connection] = {}
        self.children: dict[bytes, Child] = {}
        self.lanes = Lanes()  # the other connections children pull over (serving side)
        self.pull_lanes = default_lanes(ctx.get(zmq.IO_THREADS)) if lanes is None else lanes  # ours, per partner
        self.bad: dict[bytes, int] = {}
        self.seen: dict[bytes, float] = {}  # last message from each connection, for pruning idle ones
        self.fresh: list[int] = []  # verified since the last HAVE batch
        self.tracker_addr, self.rank = None, 0  # where joiners are redirected (a peer: its tracker); our rank
        self.next_heartbeat = self.next_prune = self.next_timers = 0.0
        self.reader = self.origin = None  # a seeder reading chunks as peers ask them; an origin reader's shares
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.inbox = ctx.socket(zmq.PULL)  # every other thread reaches the loop through here
        self.inbox_addr = f"inproc://p2pw-inbox-{id(self)}"
        self.inbox.bind(self.inbox_addr)
        self.poller.register(self.inbox, zmq.POLLIN)
        self._outside, self._outside_lock = None, threading.Lock()
        self.stop_event, self.left = threading.Event(), threading.Event()
        self.leave_when_done = False
        self.extra_done = []  # callables that must be true before the peer counts as done (disk cache)
        self.fatal, self.thread = None, None  # (str: why the download failed; the loop's threading.Thread)
        self.intake = Intake(self, workers)  # chunks received: verified and written by ``workers`` threads
        self.forwarding = Forwarding(self)  # chunks sent; those no ring slot holds read back by the workers first

    # ----- other threads -------------------------------------------------

    def post(self, verb: bytes, body: bytes = b"") -> None:
        """From any thread: hand ``verb`` to the loop (``urgent``, ``fail``, ``stop``; ``leave``: once done,
        leave as soon as nobody depends on us; ``wake``: run the timers now, the copy is final)."""
        with self._outside_lock:
            try:
                if self._outside is None:
                    self._outside = self.ctx.socket(zmq.PUSH)
                    self._outside.setsockopt(zmq.LINGER, 0)
                    self._outside.connect(self.inbox_addr)
                if self._outside:  # False once stopped: a socket opened now would keep its context from ending
                    self._outside.send_multipart([verb, body], zmq.NOBLOCK)
            except zmq.ZMQError:  # the inbox is full, or the node is closed (its context ended): nobody to tell
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
            if self._outside:
                self._outside.close(0)
            self._outside = False  # a late post (a probe's thread) opens nothing (``post``)

    # ----- setup ---------------------------------------------------------

    def attach_tracker(self, socket: zmq.Socket, addr: str, rank: int, probe=None, secret=None) -> None:
        """Adopt the (already welcomed) DEALER to the tracker, with WELCOME's "uplink_probe" and "secret"."""
        self.tracker_addr, self.rank, self.secret = addr, rank, secret
        self.member = Membership(self, socket, addr, self.hello_fields, self.tracker_timeout, self.give_up_after,
                                 probe)
        self.poller.register(socket, zmq.POLLIN)

    @property
    def fleet(self):
        """The latest ``fleet.Fleet`` snapshot (a seeder), safe to read from any thread; None on a peer."""
        return self.endpoint.fleet if self.endpoint is not None else None

    @property
    def tracker_link(self) -> zmq.Socket | None:
        return self.member.socket if self.member is not None else None

    # ----- the loop ------------------------------------------------------

    def run(self) -> None:
        handlers = Handlers(self)
        try:
            while not self.stop_event.is_set():
                busy = self.serve.pending()
                self.stats.loop_passes += 1
                for sock, _ in self.poller.poll(1 if busy else 50):
                    handlers.dispatch(sock)
                self._flush()
                self._tick(self.clock())
        except Exception as e:  # a bug: fail the download loudly rather than hang its waiters
            log.exception("node loop crashed")
            self._fail(f"internal error: {e!r}")
        finally:
            if self.endpoint is not None:  # the last word on the fleet, for the seeder's report
                self.endpoint.publish(float("inf"))
            self._close_sockets()

    def _flush(self) -> None:
        """Send what the schedulers decided: requests, cancels, HAVE batches, chunks."""
        links = self.partners.links
        asks = self.pull.requests() if links and not self.store.complete else []
        for kind, todo in ((Msg.CANCEL, self.pull.take_cancels()), (Msg.REQUEST, asks)):  # withdraw first
            for rank, chunks in todo:
                link = links.get(rank)
                if link is not None:
                    for batch in protocol.batches(chunks):
                        send_nowait(link.socket, protocol.chunk_list(kind, batch))
        if self.fresh:
            everything = range(self.manifest.n_chunks) if self.store.complete else None
            for ident, chunks in self.announcer.fresh(self.children, self.pull.links, self.fresh, everything):
                self._announce(ident, chunks)
            self.fresh = []
        for ident, chunks in self.announcer.due():  # what partners not pulling from us hear late
            self._announce(ident, chunks)
        if self.endpoint is not None:
            for ident, frames in self.endpoint.take():
                self._send(ident, *frames)
        self.forwarding.flush()  # chunks the workers read back, first: they were asked for before
        blocked = set()
        for _ in range(SEND_BUDGET):
            item = self.serve.next(skip=blocked)
            if item is None:
                break
            ident, index = item
            if not self.forwarding.send(ident, index):
                self.serve.blocked(ident, index)
                blocked.add(ident)

    def _announce(self, ident: bytes, chunks) -> None:
        for batch in protocol.batches(chunks):
            self._send(ident, protocol.chunk_list(Msg.HAVE, batch))

    def _tick(self, now: float) -> None:
        """Timers: heartbeats, silent partners, stalled requests, completion, leaving, giving up."""
        if now < self.next_timers:
            return
        self.next_timers = now + TIMER_INTERVAL
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + (YOUNG_HEARTBEAT_INTERVAL if now < self.young_until else HEARTBEAT_INTERVAL)
            self._heartbeat(now)
        if self.endpoint is not None:
            self.endpoint.review(self.stats.chunks_sent)
            self.endpoint.publish(now)
        self.partners.watch(now)
        back_to_source(self, now)  # an origin reader whose tracker is away reads what no partner holds
        for rank, chunks in self.pull.stalled():
            self.stats.stalled += len(chunks)
            log.warning("re-requesting chunk(s) %s elsewhere: outstanding at rank %d far longer than "
                        "its rate explains", chunks[:8], rank)
        if self.member is not None and not self.fatal:
            self.member.tick(now)

    def _heartbeat(self, now: float) -> None:
        """Tell partners and members we live; report what we hold and measure to the tracker."""
        beat = protocol.control(Msg.HEARTBEAT)
        self._prune(now)
        for ident in [*self.children, *(self.endpoint.members if self.endpoint is not None else ())]:
            self._send(ident, beat)
        self.partners.beat(beat)  # the partners we pull from keep us (``admission``)
        if self.member is not None:
            self.member.heartbeat()

    def _prune(self, now: float) -> None:
        """Drop children silent for ``child_timeout``; every IDLE_FORGET / 2, forget connections that are
        neither partner nor member and have been quiet a while (strangers cannot grow our memory)."""
        for ident in self.admission.idle(self.children, self.seen, now):
            log.warning("dropping child rank %d: silent for over %g s", self.children[ident].rank,
                        self.admission.child_timeout)
            self._send(ident, protocol.control(Msg.BYE, rank=self.rank))
            self.forget(ident)
        if now < self.next_prune:
            return
        self.next_prune, keep = now + IDLE_FORGET / 2, self.endpoint.members if self.endpoint is not None else {}
        for ident in [i for i, last in self.seen.items() if now - last > IDLE_FORGET and i not in self.children
                      and i not in keep and not self.lanes.is_lane(i)]:
            del self.seen[ident]
            self.drop_conn(ident)
            self.bad.pop(ident, None)

    # ----- sending -------------------------------------------------------

    def _send(self, ident: bytes, *frames, copy=True, track=False):
        """True (with ``track``: the send's ``zmq.MessageTracker``), or False if it would block or ``ident`` is
        gone."""
        try:
            return self.router.send_multipart([ident, *frames], flags=NOBLOCK, copy=copy, track=track) or True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self.forget(ident)
                return False
            raise

    def drop_conn(self, ident: bytes) -> None:
        """Keep no state for connection ``ident`` (it no longer counts against its address's cap)."""
        self.conns.pop(ident, None)
        self.admission.release(ident)

    def forget(self, ident: bytes) -> None:
        """Connection ``ident`` is gone or ignored: drop what it asked for; a member is gone; a lane, only
        itself (its child sends on the rest); a child's link, its lanes too."""
        if self.lanes.is_lane(ident):
            self.lanes.drop(ident)
            self.drop_conn(ident)
            return
        for lane in self.lanes.drop(ident):
            self.drop_conn(lane)
        if self.endpoint is not None and ident in self.endpoint.members:
            self.endpoint.bye(ident)
        self.children.pop(ident, None)
        self.serve.detach(ident)

    # ----- chunks --------------------------------------------------------

    def attach_source(self, source) -> None:
        """Serve chunks not yet held by reading them from ``source`` (a seeder with a known manifest)."""
        from ...sources.source import ReadAhead

        tx = self.ctx.socket(zmq.PUSH)  # used (and closed) only by the read-ahead thread from here on
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(self.inbox_addr)
        self.reader = ReadAhead(source, self.store, lambda i, ok: tx.send_multipart([b"ready", READY.pack(i, ok)]),
                                on_exit=tx.close)

    def publish(self, index: int) -> None:
        """Chunk ``index`` is verified: make it visible, announce it, send it to whoever waits on it."""
        self.store.verified(index)
        if self.member is not None:
            self.member.progressed(self.clock(), index)
        if not self.pull.got(index):
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
        self.intake.close()  # before the files close: a worker may still write a verified chunk
        bye = protocol.control(Msg.BYE, rank=self.rank)
        for ident in list(self.children):  # partners pulling from us ask elsewhere at once
            self._send(ident, bye)
        self.router.setsockopt(zmq.LINGER, 200)
        self.partners.close_all()
        for reader in filter(None, (self.reader, self.origin)):
            reader.stop()
        if self.member is not None:
            self.member.close()
        self.inbox.close(0)
        self.router.close(0)


def bind_router(ctx: zmq.Context, host: str, port: int, key: keys.FleetKey | None = None,
                max_msg: int = ROUTER_MAX_MSG) -> tuple[zmq.Socket, int]:
    """A ROUTER bound on host:port (port 0 picks a free one), CURVE-secured with ``key``, taking messages of up to
    ``max_msg`` bytes (set before bind: each connection keeps the limit in force then); returns it and its port
    (P2PError, the socket closed, where it cannot listen there)."""
    sock = ctx.socket(zmq.ROUTER)
    keys.secure_server(sock, key)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    sock.setsockopt(zmq.SNDHWM, 2 * MAX_WINDOW)
    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as e:
        sock.close(0)  # else the context's term() waits for it forever
        why = "no interface of this host has that name or address" if e.errno in (
            errno.ENODEV, errno.EADDRNOTAVAIL) else e.strerror
        raise P2PError(f"cannot listen on {host}:{port}: {why}") from None
    return sock, port
