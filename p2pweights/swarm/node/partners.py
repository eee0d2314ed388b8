"""Partners: the links a peer pulls over, one DEALER per partner (the loop's thread only).

The tracker's plan names a planned source per stripe and a few more partners;
``set_plan`` opens a link to each one not yet linked and closes the links to
those no longer named (their requests are asked elsewhere).  A partner whose
connection drops (its process died: the kernel closed its sockets) is given
up at once (``dropped``, from a socket monitor on each link); ``watch`` gives
up a partner gone silent, or a planned source that answers but sends nothing.
A planned source given up is reported to the tracker, which names another.
Each plan entry carries the ticket that admits us at that partner
(``membership``); one refused as not placed there (a restarted tracker's
partner) is dropped until the tracker's next plan, which carries a new one.
A link to a partner that takes lanes gets up to ``node.pull_lanes`` - 1 more
connections once ATTACHED (``lanes``): chunks only, sent on whichever the
partner chooses; requests and control stay on the link.
"""
from __future__ import annotations

import logging

import zmq

from ...wire import keys, protocol
from ...wire.protocol import CLIENT_TRANSITIONS, LANE_TRANSITIONS, Connection, Msg
from ..policy.backtosource import tracker_away
from ..policy.serve import MAX_PARKED

log = logging.getLogger("p2pw")

BYE_LINGER_MS = 200  # a socket closed after a BYE keeps it this long at most, to send it (the context's end waits)
SILENT_PATIENCE = 6  # parent timeouts a partner with our requests queued may stay silent before it is given up


def tcp(addr: str) -> str:
    return addr if "://" in addr else f"tcp://{addr}"


class PartnerLink:
    """This peer's DEALER to one partner it pulls from; ``monitor``: EVENT_DISCONNECTED of ``socket``
    (not on the seeder's link); ``lanes``: its other connections to that partner, chunks only."""

    def __init__(self, rank: int, addr: str, socket: zmq.Socket, conn: Connection, last_heard: float,
                 last_chunk: float, orphan_sent: float = 0.0, monitor: zmq.Socket | None = None):
        self.rank, self.addr, self.socket, self.conn = rank, addr, socket, conn
        self.last_heard, self.last_chunk, self.orphan_sent, self.monitor = last_heard, last_chunk, orphan_sent, monitor
        self.lanes: list[Lane] = []
        self.ticket: str | None = None  # the ticket it admitted us with: our lanes show the same


class Lane:
    """Another DEALER to a partner, number ``number`` (the link's own is 0), that carries chunks to us."""

    __slots__ = ("number", "socket", "conn")

    def __init__(self, number: int, socket: zmq.Socket):
        self.number, self.socket, self.conn = number, socket, Connection(LANE_TRANSITIONS, "attaching")


def send_nowait(sock: zmq.Socket, frame: bytes) -> bool:
    """Send one frame to a partner or the tracker without ever blocking the loop.

    A DEALER whose peer is down queues up to its high-water mark and then
    would block; dropping is right for these messages (requests are re-asked,
    heartbeats and reports are repeated)."""
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


class Partners:
    """The links of one peer to the partners it pulls from, and its plan."""

    def __init__(self, node):
        self.node = node
        self.links: dict[int, PartnerLink] = {}
        self.owner: dict[zmq.Socket, tuple[PartnerLink, Lane | None]] = {}  # a link's or lane's socket -> them
        self.plan: list[dict] = []  # {stripe, rank, addr} per stripe, as the tracker said
        self.tickets: dict[int, str] = {}  # rank -> the ticket that admits us there (the tracker's plan entry's)
        self.pulls = True  # False: a seeder among peers serves what it reads and pulls from nobody
        self.refusal: str | None = None  # the last partner's refusal of our ATTACH, for a give-up's message

    def watch(self, now: float) -> None:
        for link in list(self.links.values()):
            self._watch(link, now)

    def beat(self, frame: bytes) -> None:
        """A heartbeat to every partner we pull from: we live (it drops a child silent too long)."""
        for link in self.links.values():
            send_nowait(link.socket, frame)  # (not on its lanes: a serving node keeps a lane while its link lives)

    def close_all(self) -> None:
        for rank in list(self.links):
            self.close(rank)

    def set_plan(self, parents: list[dict], partners: list[dict], stripes: int | None = None) -> None:
        """The tracker's plan for us: a planned source per stripe, and partners to pull from too.

        Links to partners no longer named are closed (their requests asked
        elsewhere); new ones are opened.  Entries are checked: a bad one is
        ignored, never trusted."""
        n = self.node
        if stripes is not None and stripes != n.pull.stripes:
            n.pull.set_stripes(stripes)
        plan, want, told = [None] * n.pull.stripes, {}, []  # told: the entries taken, for what they say
        for p in [*parents, *partners]:
            if isinstance(p, dict) and isinstance(p.get("ticket"), str):
                self.tickets[p.get("rank")] = p["ticket"]
        for p in parents:
            if not self._entry_ok(p, stripe=True):
                continue
            plan[p["stripe"]] = p["rank"]
            want[p["rank"]] = p["addr"] or n.tracker_addr
            told.append(p)
        for p in partners:
            if self._entry_ok(p) and p["rank"] != n.rank:
                want.setdefault(p["rank"], p["addr"] or n.tracker_addr)
                told.append(p)
        downstream = {p["rank"]: p.get("downstream") for p in told}
        n.pull.set_downstream({r: d for r, d in downstream.items() if isinstance(d, int) and d >= 0},
                              {p["rank"] for p in told if p.get("slow") is True},
                              lent=any(p["rank"] == 0 and p.get("lent") is True for p in told))
        if [x for x in plan if x is not None] != [x for x in n.pull.plan if x is not None]:
            n.stats.reparented += 1 if self.plan else 0
        self.plan = [{"stripe": s, "rank": r, "addr": want.get(r, "")} for s, r in enumerate(plan) if r is not None]
        n.pull.set_plan(plan)
        if n.member is not None:
            n.member.replanned(plan)
        for rank in [r for r in self.links if r not in want or self.links[r].addr != want[r]]:
            self.close(rank)
        for rank, addr in want.items():
            if rank not in self.links and not n.store.complete and self.pulls:
                self.open(rank, addr)

    def _entry_ok(self, p, stripe: bool = False) -> bool:
        n = self.node
        ok = isinstance(p, dict) and isinstance(p.get("rank"), int) \
            and (p.get("addr", "") == "" or protocol.valid_addr(p.get("addr"))) \
            and (not stripe or (isinstance(p.get("stripe"), int) and 0 <= p["stripe"] < n.pull.stripes))
        if not ok:
            n.stats.malformed += 1
            log.warning("tracker sent a bad plan entry %r: ignored", p)
        return ok

    def open(self, rank: int, addr: str) -> None:
        """Connect to partner ``rank`` at ``addr`` and ATTACH; nothing is asked of it before ATTACHED."""
        n = self.node
        if not protocol.valid_addr(addr):  # plan entries are checked: never one a peer could make us dial
            log.warning("partner rank %d at %r: not HOST:PORT, not connecting", rank, addr[:80])
            return
        sock = self._socket()
        # the seeder's link is kept through a drop (zmq reconnects): it alone may hold what nobody else does
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if rank != 0 else None
        sock.connect(tcp(addr))
        now = n.clock()
        self.links[rank] = PartnerLink(rank, addr, sock, Connection(CLIENT_TRANSITIONS, "attaching"), now, now,
                                       monitor=monitor)
        self.owner[sock] = (self.links[rank], None)
        self.links[rank].ticket = self.tickets.get(rank)
        n.pull.add(rank)
        n.poller.register(sock, zmq.POLLIN)
        if monitor is not None:
            n.poller.register(monitor, zmq.POLLIN)
        send_nowait(sock, protocol.control(Msg.ATTACH, peer_id=n.peer_id, rank=n.rank, model_id=n.model_id,
                                           ticket=self.links[rank].ticket))

    def _socket(self) -> zmq.Socket:
        """A DEALER to a partner: chunks up to the manifest's size, a few windows of them queued."""
        n = self.node
        sock = n.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max(n.manifest.chunk_size, protocol.MAX_CONTROL_BODY) + 4096)
        sock.setsockopt(zmq.RCVHWM, 4 * MAX_PARKED)
        keys.secure_client(sock, n.key)
        return sock

    def open_lanes(self, link: PartnerLink, taken: int) -> None:
        """``link``'s partner takes ``taken`` connections from us: open lanes up to that or ``pull_lanes``."""
        n = self.node
        for number in range(len(link.lanes) + 1, min(n.pull_lanes, taken)):
            sock = self._socket()
            sock.connect(tcp(link.addr))
            lane = Lane(number, sock)
            link.lanes.append(lane)
            self.owner[sock] = (link, lane)
            n.poller.register(sock, zmq.POLLIN)
            send_nowait(sock, protocol.control(Msg.LANE, peer_id=n.peer_id, rank=n.rank, model_id=n.model_id,
                                               ticket=link.ticket, lane=number))

    def close_lane(self, link: PartnerLink, lane: Lane) -> None:
        """Close one lane of ``link``; the partner sends on the link and the others."""
        if lane in link.lanes:
            link.lanes.remove(lane)
            self._close_socket(lane.socket)

    def _close_socket(self, sock: zmq.Socket, linger: int = 0) -> None:
        self.owner.pop(sock, None)
        self.node.poller.unregister(sock)
        sock.close(linger)

    def close(self, rank: int) -> None:
        """Close the link to ``rank`` and its lanes; its outstanding requests are free to ask elsewhere.  An
        attached partner hears BYE on the link: it forgets us and our lanes at once, and our places under
        its cap on connections from one address are free (else only once it finds us silent)."""
        n = self.node
        link = self.links.pop(rank, None)
        if link is not None:
            bye = link.conn.state == "attached" and send_nowait(link.socket, protocol.control(Msg.BYE, rank=n.rank))
            for lane in link.lanes:
                self._close_socket(lane.socket)
            if link.monitor is not None:
                n.poller.unregister(link.monitor)
                try:
                    link.socket.disable_monitor()
                except zmq.ZMQError:
                    pass
                link.monitor.close(0)
            self._close_socket(link.socket, BYE_LINGER_MS if bye else 0)
        n.pull.drop(rank)

    def refused(self, rank: int, why: str = "it does not admit us (not placed there)") -> None:
        """Partner ``rank`` refuses our ATTACH (a ticket its tracker did not give, or a newer one of our rank
        attached, or it is full): drop the link until a plan names it again, and pull from the others; the
        seeder refusing, or nobody left to pull from, asks the tracker for a new plan now."""
        n = self.node
        self.refusal = f"partner rank {rank} refused us: {why}"
        if rank == 0 and n.member is not None:
            self.close(rank)
        else:
            self.give_up(rank, f"refused us: {why}", level=logging.INFO)
        if (rank == 0 or not self.links) and n.member is not None and n.clock() - n.member.hello_sent > 1.0:
            n.member.reintroduce(n.clock(), self.refusal)

    def dropped(self, link: PartnerLink) -> None:
        """``link``'s monitor has events: if its connection dropped, give the partner up now (its
        requests are asked elsewhere at once), not after ``parent_timeout`` of silence."""
        gone = False
        while link.monitor is not None and link.monitor.poll(0, zmq.POLLIN):
            gone = keys.monitor_event(link.monitor) == zmq.EVENT_DISCONNECTED or gone
        if gone and link.rank in self.links:
            self.give_up(link.rank, "its connection dropped", dead=True)

    def parents(self) -> list[dict]:
        """Our planned source in each stripe now (the tracker may have moved us since we joined)."""
        return list(self.plan)

    def _watch(self, link: PartnerLink, now: float) -> None:
        """Give up a silent partner, or a planned source that answers but sends nothing (kept while the tracker
        is away: no plan would replace it, and it may yet read from the origin what we ask of it)."""
        n = self.node
        lk = n.pull.links.get(link.rank)
        silent = now - link.last_heard
        if silent > n.parent_timeout and not self._busy_not_dead(link, lk, silent, now):
            self.give_up(link.rank, f"silent for {silent:.1f} s", dead=True)
            return
        planned = any(p["rank"] == link.rank for p in self.plan)
        if planned and link.rank != 0 and lk is not None and lk.outstanding \
                and now - link.last_chunk > 3 * n.parent_timeout and n.member is not None \
                and not tracker_away(n.member.heard, now, n.member.tracker_timeout):
            self.give_up(link.rank, f"stalled: no chunk for {now - link.last_chunk:.1f} s though it is alive")

    def _busy_not_dead(self, link: PartnerLink, lk, silent: float, now: float) -> bool:
        """Whether a partner silent for ``silent`` s is only slow: its heartbeats queue behind the
        chunks we asked of it (a few MiB each, over an uplink shared by many), not lost.

        The seeder is alive while its tracker link speaks to us.  Another partner with our requests
        outstanding gets twice the time its measured rate needs for them (at most
        ``SILENT_PATIENCE`` timeouts); the pull scheduler re-asks stalled requests elsewhere
        meanwhile, and a partner whose process died is given up at once by its connection drop."""
        n = self.node
        if link.rank == 0 and n.member is not None and now - n.member.heard <= n.parent_timeout:
            return True
        if lk is None or not lk.outstanding:
            return False
        need = 2 * len(lk.outstanding) * n.manifest.chunk_size / lk.rate if lk.rate > 0 else float("inf")
        return silent <= min(SILENT_PATIENCE * n.parent_timeout, max(n.parent_timeout, need))

    def give_up(self, rank: int, reason: str, dead: bool = False, level: int = logging.WARNING) -> None:
        """Stop pulling from partner ``rank``; if it was a planned source, ask the tracker for another."""
        n = self.node
        log.log(level, "giving up partner rank %d: %s", rank, reason)
        self.close(rank)
        if any(p["rank"] == rank for p in self.plan):
            if n.member is None:
                n._fail(f"parent rank {rank} {reason}")
            else:
                n.member.lose(rank, reason, dead)
