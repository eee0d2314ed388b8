"""Tracker endpoint: the seeder's handlers for its members' messages (sans-IO).

It turns a member's HELLO, DONE, LEAVE, BYE, ORPHAN and HEARTBEAT into calls
on the ``Tracker`` and returns the messages to send (``(ident, frames)``
pairs, taken with ``take``): WELCOME with the manifest and the joiner's plan,
REPARENT to every member whose plan changed, LEAVE_OK / LEAVE_WAIT, ERROR.
A member told to wait is sent LEAVE_OK the moment its last dependent is done,
gone, or moved elsewhere by a plan change (it also asks again each second).
A member is bound to the connection that said HELLO (one member per
connection); a HELLO from another connection is that member again only with
the secret its WELCOME carried (``membership``).  Members silent for
``member_timeout`` are dropped, and a report (ORPHAN's dead parent, a
HEARTBEAT's rates) counts only about the reporter's own parents and partners.
It also reviews the reported rates (``review``) and demotes slow hosts, and
publishes the fleet as an immutable ``fleet.Fleet`` (``publish``) that other
threads read and STATUS is answered from.  The node only routes frames to it
and sends what it returns.
"""
from __future__ import annotations

import logging
import math
import statistics
import time

from . import fleet
from ...wire import protocol
from ...wire.protocol import MAX_NAME, YOUNG, Msg, ProtocolError
from .admission import MEMBER_TIMEOUT
from .tracker import PROBE_BYTES, PROBE_MIN_TIME, ROOT, ROOT_LOAN_SHARE, TrackerError, probe_reference

log = logging.getLogger("p2pw")

REVIEW_INTERVAL = 0.5  # seconds between reviews of the reported rates (one heartbeat)
YOUNG_REVIEW_INTERVAL = REVIEW_INTERVAL / 2  # while a peer that joined within ``protocol.YOUNG`` reports as often
SNAPSHOT_INTERVAL = 0.5  # seconds between fleet snapshots (sooner, at most every SNAPSHOT_MIN, on a change)
SNAPSHOT_MIN = 0.1
SNAPSHOT_SHARE = 0.05  # and never more often than keeps the loop's time spent on them under this share
MAX_RATE = 1e13  # bytes/s: a PROBE claiming more is garbage
MAX_PROBE_TIME = 3600.0  # seconds: and so is one that took longer


class TrackerEndpoint:
    """Member connections of the seeder's ROUTER, by ZeroMQ identity."""

    def __init__(self, tracker, manifest, clock):
        self.tracker = tracker
        self.manifest = manifest
        self.manifest_frame = manifest.wire_bytes()  # canonical: a pinned joiner hashes it before parsing
        self.clock = clock
        self.members: dict[bytes, int] = {}  # ident -> rank: one member per connection
        self.idents: dict[int, bytes] = {}  # rank -> the connection it speaks on now
        self.member_timeout = MEMBER_TIMEOUT
        self.keyed = False  # links are keyed (--key): STATUS may name peer ids
        self.out: list[tuple[bytes, list]] = []
        self.next_review = 0.0
        self.fleet: fleet.Fleet = fleet.snapshot(tracker, manifest)  # read by other threads: replaced, never changed
        self.fleet_frame: bytes | None = None  # the STATUS_REPLY payload of ``fleet``, encoded on first ask
        self.changed, self.snapshot_at, self.snapshot_cost = False, clock(), 0.0
        self.probe_port = 0  # the seeder's ``uplink.ProbeSink``, which WELCOME names (0: none, no probes asked)
        self.leaving: dict[int, bytes] = {}  # rank -> ident: told LEAVE_WAIT, let go once nobody depends on it

    def take(self) -> list[tuple[bytes, list]]:
        out, self.out = self.out, []
        return out

    def _send(self, ident: bytes, *frames) -> None:
        self.out.append((ident, list(frames)))

    def ident_of(self, rank: int) -> bytes | None:
        return self.idents.get(rank)

    def who(self, ident: bytes) -> str | None:
        rank = self.members.get(ident)
        return None if rank is None else f"peer {self.tracker.members[rank].peer_id} (rank {rank})"

    # ----- events ------------------------------------------------------------

    def hello(self, ident: bytes, f: dict) -> bool:
        """A joiner (or a peer re-introducing itself); False if refused (forget the connection)."""
        want = f.get("model_id")
        if want and not self.manifest.model_id.startswith(str(want).lower()):
            self._send(ident, protocol.control(
                Msg.ERROR, message=f"model id mismatch: you want {want}, this seeder serves "
                                   f"{self.manifest.model_id}", fatal=True))
            return False
        if len(f["peer_id"]) > MAX_NAME or len(f["listen"]) > MAX_NAME:
            raise ProtocolError(f"HELLO peer_id or listen address longer than {MAX_NAME} characters")
        rank, secret = f.get("rank"), f.get("secret")
        bound = self.members.get(ident)
        if bound is not None:  # one member per connection: a HELLO on it is that member's again
            if f["peer_id"] != self.tracker.members[bound].peer_id:
                raise ProtocolError("HELLO for another peer on a connection that joined already")
            rank, secret = bound, self.tracker.seal.secret(bound)
        try:
            member = self.tracker.join(f["peer_id"], f["listen"], rank=rank, secret=secret)
        except TrackerError as e:
            self._send(ident, protocol.control(Msg.ERROR, message=str(e), fatal=True))
            return False
        self._bind(ident, member.rank)
        log.info("peer %s joined as rank %d under %s", f["peer_id"], member.rank,
                 ", ".join(f"rank {p}" for p in member.parents))
        self._send(ident, protocol.control(
            Msg.WELCOME, rank=member.rank, parents=self.tracker.parent_addrs(member),
            partners=self.tracker.partner_addrs(member), stripes=self.tracker.topology.stripes,
            tracker=self.tracker.root_listen, secret=self.tracker.seal.secret(member.rank),
            **self._probe_asked(member)), self.manifest_frame)
        for moved in self.tracker.adoptions(member):
            self.tracker.moved.append(moved.rank)
        self._announce(skip=member.rank)
        return True

    def _bind(self, ident: bytes, rank: int) -> None:
        """``rank`` speaks on connection ``ident`` from now on; a connection it spoke on before, for nobody."""
        old = self.idents.get(rank)
        if old is not None and old != ident:
            self.members.pop(old, None)
        self.members[ident], self.idents[rank] = rank, ident
        self.changed = True

    def _unbind(self, ident: bytes) -> int | None:
        rank = self.members.pop(ident, None)
        if rank is not None and self.idents.get(rank) == ident:
            del self.idents[rank]
        return rank

    def _probe_asked(self, member) -> dict:
        """WELCOME's ask for a probe of the joiner's uplink: where our sink listens and how much to send."""
        if not self.probe_port or not self.tracker.placed or member.probe:
            return {}
        return {"uplink_probe": {"port": self.probe_port, "bytes": PROBE_BYTES}}

    def probe(self, ident: bytes, f: dict) -> None:
        """PROBE: the member's uplink as its kernel timed ``PROBE_BYTES`` sent to the seeder's probe
        sink (``uplink``): ``rate`` bytes/s over ``took`` seconds, ``alone`` if the probe had its uplink
        to itself (``member.Membership.timed``).  A host far below the others is demoted now."""
        rank = self.members.get(ident)
        if rank is None:
            raise ProtocolError("PROBE from a connection that never joined")
        rate, took, alone = f["rate"], f["took"], f.get("alone")
        if not (0 < rate < MAX_RATE and 0 <= took < MAX_PROBE_TIME):  # NaN fails both
            raise ProtocolError(f"PROBE of {rate!r} bytes/s over {took!r} s")
        log.info("peer rank %d probe %.1f MB/s over %.0f ms", rank, rate / 1e6, took * 1e3)
        for r in self.tracker.probed(rank, float(rate), long=took >= PROBE_MIN_TIME,
                                     alone=alone if type(alone) is bool else None):
            log.warning("peer rank %d sent its probe at %.1f MB/s, well below the fleet's %.1f (upper quartile): "
                        "it becomes a leaf", r, self.tracker.members[r].probe / 1e6,
                        probe_reference(self.tracker.probes) / 1e6)
        self._announce()

    def done(self, ident: bytes, f: dict) -> None:
        rank = self.members.get(ident)
        if rank is not None and rank in self.tracker.members:
            m = self.tracker.members[rank]
            lendable = self.tracker.loan.open
            if not m.done:  # the mean rate of its download, for status
                self.tracker.done(rank, seconds=max(self.tracker.clock() - m.joined, 1e-9))
            self.changed = True
            log.info("peer rank %d is done", rank)
            if lendable and self.tracker.loan.to:
                log.info("every chunk has left the seeder: its uplink is lent to ranks %s", self.tracker.loan.to)
            self._announce()  # whom it pulled from may be waiting to leave (``Tracker.take_unparented``)

    def leave(self, ident: bytes, f: dict) -> None:
        rank = self.members.get(ident)
        if rank is None:
            raise ProtocolError("LEAVE from a connection that never joined")
        waiting = self.tracker.leave(rank, f.get("linger"))
        self.changed = True
        if waiting:
            self.leaving[rank] = ident
        else:
            self.leaving.pop(rank, None)
        self._send(ident, protocol.control(Msg.LEAVE_WAIT, waiting_for=waiting) if waiting
                   else protocol.control(Msg.LEAVE_OK))
        self._announce()

    def bye(self, ident: bytes, f: dict | None = None) -> bool:
        """The member left now (BYE: its connection holds nothing here any more, False), or its connection is
        gone."""
        rank = self._unbind(ident)
        if rank is not None:
            self._gone(rank, "left" if f is not None else "disconnected")
        return False

    def orphan(self, ident: bytes, f: dict) -> None:
        rank = self.members.get(ident)
        if rank is None or rank != f["rank"] or rank not in self.tracker.members:
            raise ProtocolError("ORPHAN from a connection that is not that member")
        member = self.tracker.members[rank]
        if not 0 <= f["stripe"] < len(member.parents):
            raise ProtocolError(f"ORPHAN for stripe {f['stripe']}, which does not exist")
        # a parent's death counts only from a peer that pulls from it (its plan or its partners)
        dead = f.get("dead") is True and f["parent"] in (*member.parents, *member.partners)
        if dead and f["parent"] in self.tracker.members and not self.tracker.members[f["parent"]].left:
            self._gone(f["parent"], f"reported silent by rank {rank}")
        new = self.tracker.reparent(rank, f["stripe"], f["parent"], dead)
        log.info("rank %d lost parent rank %d in stripe %d (%s): %s", rank, f["parent"], f["stripe"], f["reason"],
                 "its partners share the stripe" if new is None else f"now under rank {new}")
        self.tracker.moved.append(rank)
        self._announce()  # the parent it left may be waiting to leave (``Tracker.take_unparented``)

    def heartbeat(self, ident: bytes, f: dict) -> None:
        rank = self.members.get(ident)
        if rank is None:
            return
        m = self.tracker.members.get(rank)
        if m is None:
            return
        own = {ROOT, *m.parents, *m.partners}  # rates count only of links it has
        rates, got = _rate_map(f, "links", own), _rate_map(f, "got", own)
        have = f.get("have") if type(f.get("have")) is int and 0 <= f["have"] <= self.manifest.n_chunks else None
        self.tracker.touch(rank, have=have, rates=rates, delivered=got)

    def status(self, ident: bytes, f: dict) -> bool:
        """Anyone (no join needed) asks for the fleet: at most fleet.MAX_LISTED peers of a snapshot taken
        now where something changed since the last (unless snapshots would take over ``SNAPSHOT_SHARE``
        of the loop), else the latest: a peer that just exited is shown as it left."""
        now = self.clock()
        if self.changed and now >= self.snapshot_at + self.snapshot_cost / SNAPSHOT_SHARE:
            self._snapshot(now)
        if self.fleet_frame is None:  # peer ids only to a keyed fleet: nobody else needs them
            self.fleet_frame = self.fleet.encode(ids=self.keyed)
        self._send(ident, protocol.control(Msg.STATUS_REPLY, peers=len(self.fleet.peers),
                                           shown=min(len(self.fleet.peers), fleet.MAX_LISTED)), self.fleet_frame)
        return False  # answered: the asker holds no state here (nor a place under its address's cap)

    def publish(self, now: float) -> fleet.Fleet | None:
        """Take a new fleet snapshot if one is due (a change, or SNAPSHOT_INTERVAL); the loop's thread only."""
        wait = max(SNAPSHOT_MIN if self.changed else SNAPSHOT_INTERVAL, self.snapshot_cost / SNAPSHOT_SHARE)
        if now < self.snapshot_at + wait:
            return None
        return self._snapshot(now)

    def _snapshot(self, now: float) -> fleet.Fleet:
        t0 = time.perf_counter()
        self.changed, self.snapshot_at = False, now
        self.fleet, self.fleet_frame = fleet.snapshot(self.tracker, self.manifest), None
        self.snapshot_cost = time.perf_counter() - t0  # 10,000 members: about 0.1 s, so one every 2 s
        return self.fleet

    def review(self, sent: int = 0) -> None:
        """Every REVIEW_INTERVAL (YOUNG_REVIEW_INTERVAL within YOUNG of a join): demote hosts whose uplink
        delivers well below the fleet's.  Each time: once the seeder has ``sent`` its loan's budget of
        chunks, the peers it was lent to are told it is no partner of theirs any more."""
        if self.tracker.loan.to and sent >= (1 + ROOT_LOAN_SHARE) * self.manifest.n_chunks:
            log.info("the seeder's uplink, lent to ranks %s, has sent its budget", self.tracker.loan.to)
            self.tracker.moved.extend(self.tracker.loan.spent())
            self._announce()
        now = self.clock()
        if now < self.next_review:
            return
        for rank in self.tracker.silent(self.member_timeout):
            ident = self.idents.get(rank)
            if ident is not None:
                self._unbind(ident)
            self._gone(rank, f"silent for over {self.member_timeout:g} s: dropped")
        self.next_review = now + (YOUNG_REVIEW_INTERVAL if now - self.tracker.last_join < YOUNG else REVIEW_INTERVAL)
        demoted = self.tracker.slow_hosts(self.manifest.n_chunks)
        up = self.tracker.judged  # what they were judged on (before their moves), for the log
        for rank in demoted:
            log.warning("peer rank %d delivers %.1f MB/s, well below the fleet's %.1f (median): it becomes a leaf",
                        rank, up.get(rank, 0.0) / 1e6, statistics.median(v for r, v in up.items() if r != rank) / 1e6)
        self._announce()

    # ----- internals ---------------------------------------------------------

    def _gone(self, rank: int, why: str) -> None:
        self.leaving.pop(rank, None)
        if rank not in self.tracker.members or self.tracker.members[rank].left:
            return
        moved = self.tracker.gone(rank)
        self.changed = True
        log.info("peer rank %d %s%s", rank, why,
                 f"; re-placing {', '.join(f'rank {r}' for r, _ in moved)}" if moved else "")
        for r, _ in moved:
            self.tracker.moved.append(r)
        self._announce()

    def _announce(self, skip: int | None = None) -> None:
        """LEAVE_OK to each member waiting to leave that lost its last dependent (done, gone, or moved
        by a plan change); then tell every member whose parents or partners changed (REPARENT)."""
        while ready := self.tracker.take_unparented() & self.leaving.keys():
            for rank in sorted(ready):
                if not self.tracker.leave(rank):  # letting it go may move its children: look again
                    self._send(self.leaving.pop(rank), protocol.control(Msg.LEAVE_OK))
        for rank in self.tracker.take_moved():
            ident = self.ident_of(rank)
            if ident is None or rank == skip:
                continue
            m = self.tracker.members[rank]
            self._send(ident, protocol.control(Msg.REPARENT, parents=self.tracker.parent_addrs(m),
                                               partners=self.tracker.partner_addrs(m)))

    HANDLERS = {Msg.HELLO: hello, Msg.PROBE: probe, Msg.DONE: done, Msg.LEAVE: leave, Msg.BYE: bye,
                Msg.ORPHAN: orphan, Msg.HEARTBEAT: heartbeat, Msg.STATUS: status}


def _rate_map(f: dict, key: str, own) -> dict[int, float] | None:
    """A HEARTBEAT's map of partner rank -> bytes/s under ``key`` (None: not sent), of the ranks in ``own``
    only, and only finite rates of 0 up to MAX_RATE."""
    rates = f.get(key)
    try:
        got = {int(r): float(v) for r, v in rates.items()} if isinstance(rates, dict) else None
    except (TypeError, ValueError, OverflowError):
        raise ProtocolError(f"HEARTBEAT {key} is not a map of rank to rate") from None
    return None if got is None else {r: v for r, v in got.items()
                                     if r in own and math.isfinite(v) and 0 <= v < MAX_RATE}
