"""Member: a peer's side of its tracker link (the loop's thread only).

What a peer tells the tracker and when: its uplink's rate when WELCOME asks
for a probe (timed off the loop: ``uplink``), heartbeats with what it holds and the rate each partner
delivers, ORPHAN for a planned source it gave up, DONE, LEAVE until the
tracker lets it go, a new HELLO when the tracker went quiet (it may
have restarted), and, when nothing arrives from anyone, a line every
``WAIT_REPORT`` seconds and the end of the download after ``give_up_after``.

While its link to the tracker is down (a socket monitor says so) a member
sends it nothing: what a DEALER queues meanwhile reaches a restarted tracker
all at once (seven HELLOs each, and a stray READ or HEARTBEAT a second, after
a 16 s outage).  ``Reintroduction`` decides when it says HELLO again: once
when the link comes back or the tracker went silent, then only if no WELCOME
came within a patience that doubles.
"""
from __future__ import annotations

import logging
import os
import struct

import zmq

from ...wire import keys, protocol
from ..policy.backtosource import tracker_away
from .partners import BYE_LINGER_MS, send_nowait
from ...wire.protocol import CLIENT_TRANSITIONS, Connection, Msg
from .uplink import probe_in_background, split_host_port

log = logging.getLogger("p2pw")

LEAVE_POLL = 1.0  # seconds between LEAVEs while told to wait (the tracker sends LEAVE_OK the moment we may go)
RETRY_INTERVAL = 1.0  # ORPHAN resend while waiting for the tracker
WAIT_REPORT = 10.0  # seconds between "waiting for ..." lines when nothing arrives
MAX_PROBE = 4 << 20  # most bytes a WELCOME may ask us to send as a probe (the probe sink's limit)
TIMED = struct.Struct("<ddd")  # the inbox's b"uplink": a probe's rate (bytes/s), seconds sending, seconds from its
#                               start to its last byte acknowledged (empty: it failed)
HELLO_PATIENCE = 5.0  # seconds an unanswered re-introduction waits before the next (doubling, to HELLO_PATIENCE_MAX)
HELLO_PATIENCE_MAX = 60.0
LINK_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
PROBE_HOLD = 0.25  # seconds a joiner that has sent nothing yet holds its uploads while its probe runs (a quarter
#                    of 400 Mbit/s takes 70-76 ms): forwarding beside it, early joiners' probes read 19-22 MB/s


class Reintroduction:
    """When a member says HELLO again to its tracker (pure; the times are given).  Rules: nothing is sent while
    the link is down (``up``); the link coming back after a drop is a HELLO at once (the tracker behind it may
    have restarted); a silent tracker, or one that says it does not know us, is a HELLO; a HELLO no WELCOME
    answered (an ERROR is no answer: the swarm may not be published again yet) is repeated once ``patience``
    passes, which doubles with each; a WELCOME ends the round."""

    def __init__(self):
        self.up = True
        self.sent = 0.0  # when the unanswered HELLO went (0: none is)
        self.tries = 0  # HELLOs unanswered this round
        self.owed = False  # the link came back after a drop, or a HELLO was due while it was down

    @property
    def patience(self) -> float:
        return min(HELLO_PATIENCE * 2 ** max(self.tries - 1, 0), HELLO_PATIENCE_MAX)

    def dropped(self) -> None:
        self.up, self.owed = False, True

    def connected(self) -> None:
        self.up = True

    def due(self, now: float, silent: bool) -> bool:
        """Whether to send HELLO now: the link is up, and it is owed, or asked (``silent``) with none pending, or
        the pending one is older than ``patience``."""
        if not self.up:
            self.owed = self.owed or silent
            return False
        if self.owed:
            return True
        return now - self.sent >= self.patience if self.sent else silent

    def said(self, now: float) -> bool:
        """A HELLO went: whether it is the first of this round (the one to log)."""
        first = not self.sent
        self.sent, self.owed, self.tries = now, False, self.tries + 1
        return first

    def welcomed(self) -> None:
        self.sent, self.tries, self.owed = 0.0, 0, False


class Membership:
    """The tracker link of one peer, and the reports it sends on it."""

    def __init__(self, node, socket: zmq.Socket, addr: str, hello: dict, tracker_timeout: float,
                 give_up_after: float, probe=None):  # probe: WELCOME's "uplink_probe"
        self.node, self.socket, self.addr = node, socket, addr
        self.conn = Connection(CLIENT_TRANSITIONS, "member")
        self.hello_fields = hello  # what we told the tracker when joining, repeated if it restarts
        self.tracker_timeout, self.give_up_after = tracker_timeout, give_up_after
        now = node.clock()
        self.heard = self.progress_at = self.reported_wait = now
        self.hello_sent = self.leave_next = 0.0
        self.asked_plan = False  # the last HELLO asked for a new plan (sources refused us), not a lost tracker
        self.done_reported = False
        self.linger = None  # seconds to serve unfinished partners once done, sent with LEAVE (None: the tracker's rule)
        self.lost: dict[int, tuple[str, bool]] = {}  # planned rank given up -> (why, dead), until re-planned
        self.lost_reported: dict[int, float] = {}  # planned rank -> when we last sent ORPHAN for it
        self.probe_due = _probe_asked(probe)  # (sink port, bytes) to time our uplink with: now, or at a tick
        self.probe_sent = 0  # chunks we had sent when it began (sent more by its end: not ``alone``)
        self.beat_at, self.received = now, {}  # the last heartbeat, and each link's bytes by then
        self.publishes: tuple[str, bytes] | None = None  # (origin URL, manifest): published again to a restarted
        #                                                  standalone tracker before each HELLO
        self.reads: list[int] = []  # an origin reader's chunks held since the last READ
        self.again = Reintroduction()
        self.monitor = None  # an address of its own: the handshake's monitor of this socket may not be gone yet
        if isinstance(socket, zmq.Socket):
            self.monitor = socket.get_monitor_socket(LINK_EVENTS, f"inproc://p2pw-tracker-link-{os.urandom(6).hex()}")
        if self.probe_due:  # before we ask anyone for a chunk (see ``probe``)
            self.probe()

    def post(self, frame: bytes) -> bool:
        """``frame`` to the tracker, unless the link is down (queued, it would reach a restarted tracker late)."""
        return self.again.up and send_nowait(self.socket, frame)

    def _watch_link(self) -> None:
        """The monitor's news of the tracker link: dropped, or (back) up."""
        while self.monitor is not None and self.monitor.poll(0, zmq.POLLIN):
            event = keys.monitor_event(self.monitor)
            if event == zmq.EVENT_DISCONNECTED:
                self.again.dropped()
            elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):  # what we send now is delivered
                self.again.connected()

    def heartbeat(self) -> None:
        """What we hold and, of each partner, the rate it delivers while asked (``links``) and the
        bytes/s it delivered since the last heartbeat (``got``), both in bytes/s: the tracker's view
        of the fleet."""
        now, links = self.node.clock(), self.node.pull.links
        rates = {str(r): round(lk.rate) for r, lk in links.items() if lk.rate > 0}
        span, before = now - self.beat_at, self.received
        got = {str(r): round((lk.received - before.get(r, 0)) / span) for r, lk in links.items()
               if lk.received > before.get(r, 0)} if span > 0 else {}
        self.beat_at, self.received = now, {r: lk.received for r, lk in links.items()}
        self.post(protocol.control(Msg.HEARTBEAT, have=self.node.store.count, links=rates, got=got))

    def heard_from(self, now: float) -> None:
        self.heard = now

    def probe(self) -> None:
        """Time our uplink for the tracker (WELCOME asked): ``probe_due`` bytes to the seeder's probe
        sink, timed by our kernel on a thread of its own (``uplink``); the loop reports the rate
        (``timed``).  It demotes a host whose uplink runs far slower than the others'.  Started as we
        attach; having sent nothing yet, we forward nothing until it ends (``serve.hold``, at most
        ``PROBE_HOLD``), so it has the uplink to itself whoever is placed under us meanwhile."""
        (port, size), self.probe_due = self.probe_due, None
        try:
            host = split_host_port(self.addr)[0]
        except ValueError:
            return
        node = self.node
        self.probe_sent = node.stats.chunks_sent
        if not self.probe_sent:
            node.serve.hold(node.clock() + PROBE_HOLD)
        probe_in_background(host, port, size,
                            lambda t: node.post(b"uplink", b"" if t is None else TIMED.pack(t.rate, t.took, t.after)))

    def timed(self, body: bytes) -> None:
        """Our probe's result (the inbox's b"uplink"; empty: it failed): tell the tracker, and whether the
        probe had our uplink to itself (``alone``): its last byte was acknowledged while our uploads were
        held, or we forwarded nothing until now.  (Reported late on a busy machine, a probe held past
        ``PROBE_HOLD`` was counted as sharing the uplink, and two slow hosts went unjudged.)"""
        self.node.serve.hold(0.0)
        if body:
            rate, took, after = TIMED.unpack(body)
            alone = not self.probe_sent and after <= PROBE_HOLD or self.node.stats.chunks_sent == self.probe_sent
            self.post(protocol.control(Msg.PROBE, rate=round(rate), took=round(took, 6), alone=alone))

    def shared(self, chunks) -> None:
        """SHARE: read ``chunks`` from the origin; those held already are reported at once."""
        node = self.node
        if any(i >= node.manifest.n_chunks for i in chunks):
            node.stats.malformed += 1
            log.warning("tracker sent a share naming chunk %d; the blob has %d: ignored", max(chunks),
                        node.manifest.n_chunks)
            return
        self.reads += [i for i in chunks if node.store.has(i)]
        todo = [i for i in chunks if not node.store.has(i)]
        if todo and node.origin is not None:
            node.origin.share(todo)

    def read(self, index: int) -> None:
        """Chunk ``index`` of our share is held now: READ tells the tracker at the next tick."""
        self.reads.append(index)

    def report_held(self) -> None:
        """An origin reader (re)welcomed: the tracker hears of every chunk it holds (its pool is rebuilt)."""
        self.reads = [i for i, held in enumerate(self.node.store.have) if held]

    def _report_reads(self) -> None:
        self.reads = list(dict.fromkeys(self.reads))  # one chunk read and published is reported once
        while self.reads and self.again.up and not self.hello_sent:  # held for the tracker that welcomes us
            batch, self.reads = self.reads[:protocol.MAX_REQUEST], self.reads[protocol.MAX_REQUEST:]
            self.post(protocol.control(Msg.READ, chunks=batch))

    def welcomed_again(self, rank: int, probe=None) -> None:
        """A restarted tracker took us back (as ``rank``)."""
        if self.hello_fields.get("origin"):
            self.report_held()
        self.probe_due = _probe_asked(probe)
        if self.hello_sent and not self.asked_plan:
            log.info("tracker %s is back: we are rank %d", self.addr, rank)
        self.hello_sent = 0.0
        self.again.welcomed()
        self.done_reported = False  # tell the (new) tracker again

    def tick(self, now: float) -> None:
        """Reports due now; nothing from anyone for too long ends the download."""
        node = self.node
        if self.probe_due:
            self.probe()
        self._watch_link()
        self._watch_progress(now)
        if self.again.due(now, now - self.heard > self.tracker_timeout):
            self.reintroduce(now)
        self._report_reads()
        for rank, (why, dead) in self.lost.items():
            self._orphan(rank, why, dead, now)
        if node.store.complete and all(ok() for ok in node.extra_done):
            if not self.done_reported:
                self.done_reported = True
                self.post(protocol.control(Msg.DONE, rank=node.rank))
                for rank in list(node.partners.links):  # nothing more to pull: only serve from now on
                    node.partners.close(rank)
            silent = now - self.heard
            if node.leave_when_done and (silent > self.tracker_timeout or not node.children and tracker_away(
                    self.heard, now, self.tracker_timeout)):
                log.warning("tracker %s silent for %.0f s: leaving without its word (%s)", self.addr, silent,
                            "nobody pulls from us now" if not node.children else
                            "nobody can tell us who still depends on this copy")
                node.left.set()
                node.stop_event.set()
            elif node.leave_when_done and now >= self.leave_next:
                self.leave_next = now + LEAVE_POLL
                self.post(protocol.control(Msg.LEAVE, rank=node.rank,
                                           **({} if self.linger is None else {"linger": self.linger})))

    def progressed(self, now: float, index: int | None = None) -> None:
        """Chunk ``index`` is verified: an origin reader tells the tracker it holds it, from a peer too (a second
        reader's READ vouches for the claim of the reader that read it: ``shares``)."""
        self.progress_at = now
        if index is not None and self.hello_fields.get("origin"):
            self.reads.append(index)

    def _watch_progress(self, now: float) -> None:
        """Nothing verified for a while: say what we wait for every WAIT_REPORT s, give up at the end."""
        node = self.node
        idle = now - self.progress_at
        if node.store.complete or idle < min(WAIT_REPORT, self.give_up_after):
            return
        if idle > self.give_up_after:
            node._fail(f"no chunk arrived for {self.give_up_after:.0f} s: {node.pull.missing()} of "
                       f"{node.manifest.n_chunks} chunks missing and no partner serves them "
                       f"(verified chunks are kept: join again to resume)"
                       + (f"; last, {node.partners.refusal}" if node.partners.refusal else ""))
        elif now - self.reported_wait >= WAIT_REPORT and idle >= WAIT_REPORT:
            self.reported_wait = now
            orphaned = node.pull.waiting_for()
            log.warning("waiting %.0f s for chunks: %d missing, %d of them held by no live partner "
                        "(first %s); partners %s; giving up after %.0f s", idle, node.pull.missing(),
                        len(orphaned), orphaned[:8], sorted(node.partners.links) or "none", self.give_up_after)

    def lose(self, rank: int, why: str, dead: bool) -> None:
        """Planned source ``rank`` was given up: ask the tracker for another until it names one."""
        self.lost[rank] = (why, dead)

    def replanned(self, planned: list) -> None:
        self.lost = {r: v for r, v in self.lost.items() if r in planned}

    def _orphan(self, rank: int, why: str, dead: bool, now: float) -> None:
        if now - self.lost_reported.get(rank, 0.0) <= RETRY_INTERVAL or now - self.heard > self.tracker_timeout:
            return
        self.lost_reported[rank] = now
        for p in self.node.partners.plan:
            if p["rank"] == rank:
                self.post(protocol.control(Msg.ORPHAN, rank=self.node.rank, stripe=p["stripe"], parent=rank,
                                           reason=why, dead=dead))

    def reintroduce(self, now: float, why: str | None = None) -> None:
        """The tracker went quiet (restarted?), or ``why``, our sources refuse us: HELLO again with our rank and
        what we hold (its WELCOME carries a new plan)."""
        if not self.again.up or why is None and not self.again.due(now, True):  # the link is down (HELLO when it
            return  # comes back), or one is on its way
        self.asked_plan = why is not None
        first = self.again.said(now)
        if why is not None:
            log.info("asking tracker %s for a new plan: %s", self.addr, why)
        elif first:
            log.warning("tracker %s restarted or silent (last heard %.0f s ago): introducing ourselves again",
                        self.addr, now - self.heard)
        self.hello_sent = now
        if self.publishes is not None:  # a restarted standalone tracker knows no manifest: tell it ours first
            url, manifest = self.publishes
            try:
                self.socket.send_multipart([protocol.control(Msg.PUBLISH, url=url), manifest], zmq.NOBLOCK)
            except zmq.Again:
                pass
        self.post(protocol.control(Msg.HELLO, **self.hello_fields, rank=self.node.rank,
                                   have=self.node.store.count, secret=self.node.secret))

    def close(self) -> None:
        """Tell the tracker we are gone, so no joiner is sent to us; also once it let us leave: our connection
        then holds no place under our address's cap there (the context's end waits for it, a little)."""
        sent = False
        try:
            sent = self.post(protocol.control(Msg.BYE, rank=self.node.rank))
        except zmq.ZMQError:
            pass
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(0)
        self.socket.close(BYE_LINGER_MS if sent else 0)


def _probe_asked(asked) -> tuple[int, int] | None:
    """(sink port, bytes) of the probe a WELCOME asked for, if a sane one (else none is sent)."""
    if not isinstance(asked, dict):
        return None
    port, size = asked.get("port"), asked.get("bytes")
    if type(port) is int and 0 < port < 65536 and type(size) is int and 0 < size <= MAX_PROBE:
        return port, size
    return None
