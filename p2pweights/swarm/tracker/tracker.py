"""Tracker: fleet membership, kept by the seeder; it never moves chunk bytes.

It gives each joining peer a rank in join order, its planned parent in every
stripe tree (the plan: a ``Forest`` placed as peers join, or a rule-based
topology, skipping parents that have left), and a few partners: other peers
it may also pull from.  Peers report what each partner delivers to them; a
host whose uplink, as they see it (``uplinks``), falls well below the fleet's
is demoted to a leaf (``slow_hosts``), and so is one that feeds nobody yet
whose probe at join (``PROBE_BYTES`` sent to the seeder's probe sink, timed by
the joiner's kernel: ``uplink``, ``probed``) ran well below the others', before
it forwards anything.  In a
joiner's first ``protocol.YOUNG`` seconds it reports, and is reviewed, twice
as often, and a probe that ran at half the others' or better clears it (a
fast host still starting delivers as slowly as a slow uplink).  It
records who is done and lets a peer leave only once no unfinished peer
depends on it, so a relay never strands its subtree.  Pure state with an
injected clock: the endpoint (``endpoint.TrackerEndpoint``) feeds it events
and sends what it returns.
"""
from __future__ import annotations

import bisect
import random
import time
from dataclasses import dataclass, field

from ...errors import UserError
from ...wire.protocol import YOUNG
from .membership import Seal
from .topology import live_parent

ROOT = 0
PARTNERS = 4  # partners a joiner is given besides its planned parents
PARTNER_SILENCE = 3.0  # seconds: a done peer waits to leave for an unfinished partner heard from this lately
PARTNER_LINGER = 0.25  # and at most this share of its own download's time (its user waits for its exit)
MAX_PARTNERS = 8  # partners one peer is given at joins (newcomers also partner with earlier peers; finished peers lent
#                   to it at the end, ``Roster.lend``, come on top)
SLOW_FRACTION = 0.33  # a host delivering below this share of the fleet's median uplink is demoted
END_SHARE = 0.75  # a forwarder whose planned children all hold this share of the chunks is no longer judged
SLOW_EVIDENCE = 1  # consecutive rate reviews (one per heartbeat, 0.5 s) that must find a host slow before it is demoted
#                   (one: each judges both what its children get while asking and what all its partners got)
PROBE_BYTES = 1 << 20  # a joiner sends the seeder's probe sink this much (WELCOME asks); its kernel times it
PROBE_MIN_TIME = 0.02  # seconds: a probe that took less proves nothing slow (the kernel times it in jiffies, 1-4 ms;
#                      400 Mbit/s moves PROBE_BYTES in 16-20 ms, htb's burst included, a quarter of it in 72-76)
PROBE_SLOW = 0.3  # a judged probe below this share of the probes' upper quartile demotes its host (kernel-timed
#                  on the bench's bed: 52-87 MB/s on 50 MB/s uplinks, 13.8-14.6 on 12.5, and fast ones probing
#                  while seven more interpreters start 19-29: they drag a median down, not the upper quartile;
#                  replayed over 200 recorded runs, 2 fast hosts demoted and 4 slow ones left to the reviews,
#                  against 11 and 7 judged by 0.4 of the median)
PROBE_REFERENCE = 0.75  # the quantile of the probes in that a probe is judged against
PROBE_CLEARS = 0.5  # a joiner whose probe ran at this share of the probes' median or better is not demoted
#                    by its first rates (while ``protocol.YOUNG``): a fast host still starting delivers slowly
PROBE_QUORUM = 5  # probes in before a probe judged against them is settled (earlier ones are judged again)
ROOT_LOANS = 4  # peers furthest behind the seeder's uplink is lent to once every chunk has left it
ROOT_LOAN_SHARE = 0.08  # it serves them until it has sent this share of the blob beyond one copy (<= 1.1 S)


@dataclass
class Member:
    """One peer as the tracker knows it."""

    rank: int
    peer_id: str
    listen: str
    parents: list[int]
    joined: float = field(default_factory=time.monotonic)
    done: bool = False
    left: bool = False
    seconds: float | None = None
    done_at: float = 0.0
    seen: float = field(default_factory=time.monotonic)
    partners: list[int] = field(default_factory=list)
    rates: dict[int, float] = field(default_factory=dict)  # partner rank -> bytes/s it delivers while asked
    delivered: dict[int, float] = field(default_factory=dict)  # partner rank -> bytes/s it delivered lately
    have: int = 0  # chunks verified, as last reported
    slow_seen: int = 0  # consecutive reviews that found its uplink slow
    demoted: bool = False
    probe: float = 0.0  # bytes/s its uplink sent PROBE_BYTES to the probe sink at join (0: not yet)
    linger: float | None = None  # seconds it stays for unfinished partners once done (its LEAVE says; None: the rule)


class TrackerError(UserError, ValueError):
    """A membership request the tracker refuses."""


def uplinks(members) -> dict[int, float]:
    """Each forwarder's upload rate as ``members`` see it: the larger of what the peers it is the
    planned parent of get from it while they ask, and what all its partners got from it lately.
    The first alone misses a fast host busy helping many partners (its children get a share); the
    rates of its help links are no measure, since each is taken while a request or two is served
    alone on the uplink, so their sum counted a quarter-rate host several times over; the bytes
    all its partners got cannot exceed its uplink."""
    planned: dict[int, float] = {}
    got: dict[int, float] = {}
    for m in members:
        for r in set(m.parents):
            rate = m.rates.get(r)
            if r != ROOT and rate is not None:
                planned[r] = planned.get(r, 0.0) + rate
        for r, v in m.delivered.items():
            got[r] = got.get(r, 0.0) + v
    return {r: max(rate, got.get(r, 0.0)) for r, rate in planned.items()}


def median_without(ordered: list[float], x: float) -> float:
    """``statistics.median`` of the sorted list ``ordered`` with one ``x`` taken out, without
    copying it: a review judges every forwarder against the others (2,000 forwarders cost 0.3 CPU
    s a review, every half second, when each took its own median)."""
    j, m = bisect.bisect_left(ordered, x), len(ordered) - 1
    lo, hi = (m - 1) // 2, m // 2
    return (ordered[lo + (lo >= j)] + ordered[hi + (hi >= j)]) / 2


def _sample(rng: random.Random, ranks: list[int], k: int, skip: set, full) -> list[int]:
    """Up to ``k`` distinct ranks of ``ranks`` (sorted) not in ``skip``, at random, those not
    ``full`` first (else the first joiners of a large fleet gathered dozens of partners: about
    4 ln(N / rank)).  O(k) draws for a large fleet: a copy of every live rank per join made
    10,000 joins slow."""
    if len(ranks) <= 4 * (k + len(skip)):
        pool = [r for r in ranks if r not in skip]
        room = [r for r in pool if not full(r)]
        picked = rng.sample(room, min(k, len(room)))
        rest = [r for r in pool if full(r)]
        return picked + rng.sample(rest, min(k - len(picked), len(rest)))
    out: list[int] = []
    for tries in range(1000 * k):
        r = ranks[rng.randrange(len(ranks))]
        if r not in skip and r not in out and (tries >= 100 * k or not full(r)):
            out.append(r)
            if len(out) == k:
                break
    return out


class Roster:
    """Who is live (ranks sorted), and whom each peer partners with: links go both ways."""

    def __init__(self, members: dict[int, Member], rng: random.Random):
        self.members = members
        self.rng = rng
        self.live: list[int] = []
        self.lonely: set[int] = set()  # live ranks with fewer than PARTNERS partners
        self.top = 0  # the highest rank that arrived

    def arrive(self, m: Member) -> None:
        m.left = False
        self.top = max(self.top, m.rank)
        i = bisect.bisect_left(self.live, m.rank)
        if i == len(self.live) or self.live[i] != m.rank:
            self.live.insert(i, m.rank)
        if len(m.partners) < PARTNERS:
            self.lonely.add(m.rank)

    def depart(self, m: Member, unlink: bool = False) -> None:
        """``m`` left; ``unlink``: for good (gone), so its partners forget it."""
        m.left = True
        i = bisect.bisect_left(self.live, m.rank)
        if i < len(self.live) and self.live[i] == m.rank:
            del self.live[i]
        self.lonely.discard(m.rank)
        for p in m.partners if unlink else ():
            x = self.members.get(p)
            if x is not None and m.rank in x.partners:
                x.partners.remove(m.rank)
                if not x.left and len(x.partners) < PARTNERS:
                    self.lonely.add(p)

    def partner(self, m: Member, first: list[int] = ()) -> list[int]:
        """Give newcomer ``m`` up to PARTNERS partners among the live peers, and it to them, those in
        ``first`` before any other; returns the others whose partners changed (each must be told)."""
        skip, told = {m.rank, *m.parents}, []
        full = lambda r: len(self.members[r].partners) >= MAX_PARTNERS  # noqa: E731
        for r in first[:PARTNERS]:
            told += self._link(m.rank, r)
        skip.update(m.partners)
        for r in _sample(self.rng, self.live, max(PARTNERS - len(m.partners), 0), skip, full):
            told += self._link(m.rank, r)
        for r in sorted(self.lonely - skip):  # early peers had nobody to partner with: fill them up too
            if len(m.partners) >= MAX_PARTNERS:
                break
            if len(self.members[r].partners) < PARTNERS:
                told += self._link(m.rank, r)
        return told

    def lend(self, m: Member, k: int = PARTNERS) -> list[int]:
        """``m`` holds every chunk now: make it a partner of up to ``k`` live peers furthest behind
        (fewest chunks, among a sample) that it does not partner yet, so the last to finish take
        their backlog from every finished uplink, not only from the few partners given at their
        join (it waits to leave for them: ``Tracker.leave``); returns the ranks to tell."""
        unfinished = [r for r in _sample(self.rng, self.live, 4 * k, {m.rank, *m.partners},
                                         lambda r: self.members[r].done) if not self.members[r].done]
        told = []
        for r in sorted(unfinished, key=lambda r: (self.members[r].have, r))[:k]:
            told += self._link(m.rank, r)
        return told

    def _link(self, a: int, b: int) -> list[int]:
        told = []
        for x, y in ((a, b), (b, a)):
            if y not in self.members[x].partners:
                self.members[x].partners.append(y)
                if len(self.members[x].partners) >= PARTNERS:
                    self.lonely.discard(x)
                if x != a:
                    told.append(x)
        return told


class RootLoan:
    """The seeder's uplink lent to the peers furthest behind once every chunk has left it (the
    first peer done holds them all): from then on it idled while the last peers took their
    backlog from partners alone.  Lent once, until ``spent`` (the endpoint counts what it sent)."""

    def __init__(self):
        self.to: list[int] = []
        self.open = True

    def lend(self, members: dict[int, Member], live: list[int]) -> list[int]:
        """Lend it to up to ``ROOT_LOANS`` unfinished peers with the fewest chunks that do not pull
        from it by plan; returns them (each must be told)."""
        if not self.open:
            return []
        self.open = False
        behind = [r for r in live if not members[r].done and ROOT not in members[r].parents]
        self.to = sorted(behind, key=lambda r: (members[r].have, r))[:ROOT_LOANS]
        return list(self.to)

    def entries(self, rank: int, root_listen: str) -> list[dict]:
        """The seeder as a partner entry (``Tracker.partner_addrs``) of ``rank``, if lent to it."""
        return [{"rank": ROOT, "addr": root_listen, "lent": True}] if rank in self.to else []

    def spent(self) -> list[int]:
        """The budget is spent: the peers it was lent to (each must be told)."""
        told, self.to = self.to, []
        return told


class Pullers:
    """Who pulls from whom; every change of a member's parents goes through here.

    ``by_rank``: rank -> the members that took it as a parent (a superset, pruned as it is read),
    so a forwarder waiting to leave is answered without a scan of every member (each asks every
    second at the end of a broadcast).  ``lost``: ranks a member stopped pulling from (it is done
    or gone, or a plan change moved it) since they were last taken: one waiting to leave may go."""

    def __init__(self):
        self.by_rank: dict[int, set[int]] = {}
        self.lost: set[int] = set()

    def assign(self, m: Member, parents: list) -> None:
        """``m`` pulls stripe s from ``parents[s]`` (its plan at join)."""
        self.stop(m)
        m.parents = parents
        for p in parents:
            self.by_rank.setdefault(p, set()).add(m.rank)

    def move(self, m: Member, stripe: int, parent) -> None:
        """``m`` pulls ``stripe`` from ``parent`` now."""
        self.lost.add(m.parents[stripe])
        m.parents[stripe] = parent
        self.by_rank.setdefault(parent, set()).add(m.rank)

    def stop(self, m: Member) -> None:
        """``m`` pulls from its parents no more (done, gone, or about to be given others), nor from
        its partners."""
        self.lost.update(m.parents)
        self.lost.update(m.partners)

    def take_lost(self) -> set[int]:
        out, self.lost = self.lost, set()
        return out

    def of(self, rank: int, members: dict[int, Member]) -> list[int]:
        """The unfinished members pulling from ``rank`` in some stripe."""
        out, pullers = [], self.by_rank.get(rank, set())
        for r in sorted(pullers):
            m = members.get(r)
            if m is None or rank not in m.parents:
                pullers.discard(r)  # it moved elsewhere since
            elif not m.left and not m.done:
                out.append(r)
        return out


def unfinished_partners(m: Member, members: dict[int, Member], now: float) -> list[int]:
    """``m``'s partners still missing chunks and heard from within ``PARTNER_SILENCE`` (one dead that nobody
    reported yet is not waited for), while ``m`` has been done for less than its ``linger`` seconds, by default
    ``PARTNER_LINGER`` of its download's time (a partner far behind is not worth its user's wait)."""
    since = now - m.done_at
    if m.done and (since > PARTNER_LINGER * (m.done_at - m.joined) if m.linger is None else since >= m.linger):
        return []
    return [p for p in m.partners if (x := members.get(p)) is not None and not x.done and not x.left
            and now - x.seen < PARTNER_SILENCE]


def complete_holders(members: dict[int, Member], live: list[int], rank: int) -> list[int]:
    """Live members other than ``rank`` that hold every chunk, fewest unfinished partners first, then by rank."""
    def load(r: int) -> int:
        return sum(1 for p in members[r].partners if p in members and not members[p].done and not members[p].left)

    return sorted((r for r in live if r != rank and members[r].done and not members[r].left),
                  key=lambda r: (load(r), r))


def quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of the sorted ``ordered`` (a list or an array), interpolated (0 if empty)."""
    if len(ordered) == 0:
        return 0.0
    at = (len(ordered) - 1) * q
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def probe_reference(ordered: list[float]) -> float:
    """What a probe is judged against: the ``PROBE_REFERENCE`` quantile of the sorted probe rates
    ``ordered`` (a host below ``PROBE_SLOW`` of it is demoted)."""
    return quantile(ordered, PROBE_REFERENCE)


class Tracker:
    """Membership and tree placement for one broadcast."""

    def __init__(self, topology, root_listen: str, max_peers: int = 10_000, clock=time.monotonic):
        self.topology = topology
        self.root_listen = root_listen
        self.max_peers = max_peers
        self.clock, self.last_join = clock, float("-inf")  # when a peer last (re-)joined: reviews come sooner
        self.members: dict[int, Member] = {}
        self.seal = Seal()  # members' secrets and their tickets at each other
        self.placed = hasattr(topology, "place")  # a stateful plan (Forest), not a rule of the rank
        self.moved: list[int] = []  # ranks whose plan changed as a side effect, not yet announced
        self.pullers = Pullers()  # who pulls from whom, and whom a peer stopped pulling from
        self.rng = random.Random(0x9E3779B9)
        self.roster = Roster(self.members, self.rng)  # who is live, and whom each partners with
        self.probes, self.unsettled = [], set()  # probe rates in, sorted; ranks probed before PROBE_QUORUM's in
        self.loan = RootLoan()  # the seeder's uplink, lent to the last peers once every chunk has left it
        self.judged: dict[int, float] = {}  # the uplinks the last review judged (rank -> bytes/s)

    def listen_of(self, rank: int) -> str:
        return self.root_listen if rank == ROOT else self.members[rank].listen

    def join(self, peer_id: str, listen: str, rank: int | None = None, secret: str | None = None) -> Member:
        """Place a joining peer.  One proving with ``secret`` (``membership.Seal``) that it is member
        ``rank`` is that member again, at its new address; a peer re-introducing itself with its old
        ``rank`` to a restarted tracker keeps it if nobody holds it; a peer id proves nothing."""
        m = self.members.get(rank) if self.seal.proves(rank, secret) else None
        if m is not None:
            was_left, m.listen = m.left, listen
            self.seal.begin(m.rank)
            self.roster.arrive(m)
            moves = self.topology.place(m.rank) if self.placed and was_left else []
            self.pullers.assign(m, self._place(m.rank))
            self._note(moves)
            m.seen = self.last_join = self.clock()
            return m
        if len(self.roster.live) >= self.max_peers:
            raise TrackerError(f"tracker is full ({self.max_peers} peers)")
        if type(rank) is not int or rank < 1 or rank in self.members:
            rank = self.roster.top + 1
        self.last_join = now = self.clock()
        self.members[rank] = m = Member(rank, peer_id, listen, [], joined=now, seen=now)
        self.seal.begin(rank)
        self.roster.arrive(m)
        moves = self.topology.place(rank) if self.placed else []
        self.pullers.assign(m, self._place(rank))
        self._note(moves)
        if self.placed:  # the swarm; a rule-based plan stays a pure tree, to compare against
            self.moved.extend(self.roster.partner(m, self.partners_first(m)))
        return m

    def partners_first(self, m: Member) -> list[int]:
        """Whom newcomer ``m`` partners with before a sample of the rest: the members holding every chunk, those
        feeding the fewest unfinished partners first, so a late arrival takes its backlog from every complete
        uplink at once, not from one partner still downloading (each waits to leave for it: ``leave``)."""
        return complete_holders(self.members, self.roster.live, m.rank)

    def silent(self, timeout: float) -> list[int]:
        """Live members not heard from for ``timeout`` seconds: each is to be dropped (``gone``)."""
        since = self.clock() - timeout
        return [r for r in self.roster.live if self.members[r].seen < since]

    def _note(self, moves) -> None:
        """Apply a plan's moves to the members' parent lists; remember whom to tell."""
        for rank, stripe in moves:
            m = self.members.get(rank)
            if m is not None and not m.left:
                self.pullers.move(m, stripe, self.topology.parent[stripe][rank])
                if not m.done:  # a done peer pulls nothing: no need to tell it
                    self.moved.append(rank)

    def take_unparented(self) -> set[int]:
        """Ranks that lost a dependent (done, gone, or moved by a plan change) since the last call:
        one waiting to leave may go now."""
        return self.pullers.take_lost()

    def take_moved(self) -> list[int]:
        """Ranks whose parents or partners changed since the last call (each must be told)."""
        out = list(dict.fromkeys(r for r in self.moved if r in self.members and not self.members[r].left))
        self.moved.clear()
        return out

    def adoptions(self, member: Member) -> list[Member]:
        """Move peers under the newcomer ``member`` where the topology says so (``adopts``).

        Updates their parents here and returns them; each must be sent a REPARENT with its new
        parent list.  Done or departed peers stay put."""
        adopts = getattr(self.topology, "adopts", None)
        if adopts is None or member.left:
            return []
        moved = []
        for child, stripe in adopts(member.rank):
            m = self.members.get(child)
            if m is None or m.left or m.done or m.parents[stripe] == member.rank:
                continue
            self.pullers.move(m, stripe, member.rank)
            if m not in moved:
                moved.append(m)
        return moved

    def _place(self, rank: int) -> list[int]:
        if self.placed:
            return self.topology.parents(rank)
        alive = set(self.roster.live)
        return [live_parent(self.topology, rank, s, alive) for s in range(self.topology.stripes)]

    def parent_addrs(self, member: Member) -> list[dict]:
        """Planned sources, each with the ``ticket`` that admits ``member`` there (so do partners')."""
        return [{"rank": p, "addr": self.listen_of(p), "stripe": s, "ticket": self.seal.ticket(p, member.rank),
                 **self._about(p)} for s, p in enumerate(member.parents)
                if p is not None]  # None: no planned source there (every slot taken): partners share it

    def partner_addrs(self, member: Member) -> list[dict]:
        """Partners, each with ``downstream`` (Forest plans): how many peers its uplink feeds through
        its children, so help is asked first of partners whose uplink holds back nobody further."""
        lent = self.loan.entries(member.rank, self.root_listen)
        return [{"rank": p, "addr": self.listen_of(p), "ticket": self.seal.ticket(p, member.rank), **self._about(p)}
                for p in member.partners if p in self.members and not self.members[p].left] + [
            dict(e, ticket=self.seal.ticket(ROOT, member.rank)) for e in lent]

    def _about(self, rank: int) -> dict:
        """What a peer is told of a partner: ``downstream``, and ``slow`` once it is demoted (help
        is asked of it last: its uplink is already taken by what the plan gives it)."""
        if not self.placed or rank == ROOT:
            return {}
        m = self.members.get(rank)
        return {"downstream": self.topology.downstream(rank), **({"slow": True} if m and m.demoted else {})}

    def done(self, rank: int, seconds: float | None = None) -> None:
        m = self._member(rank)
        m.done, m.seconds, m.done_at = True, seconds, self.clock()
        self.pullers.stop(m)
        if self.placed:  # its uplink to the peers furthest behind, and the seeder's (once: the first done)
            self.moved += [*self.roster.lend(m), *self.loan.lend(self.members, self.roster.live)]

    def dependents(self, rank: int) -> list[int]:
        """Unfinished peers that pull from ``rank`` in some stripe."""
        return self.pullers.of(rank, self.members)

    def leave(self, rank: int, linger: float | None = None) -> list[int]:
        """Let ``rank`` leave if nobody depends on it, in its plan or as a partner still missing chunks
        (the last peers to finish take their backlog from every finished partner at once, not from one
        planned source while the others have gone); returns who it must still wait for.  ``linger``: the
        seconds it stays for partners once done (its ``--linger``; None: ``PARTNER_LINGER`` of its download)."""
        m = self._member(rank)
        if linger is not None:
            m.linger = linger
        waiting = self.dependents(rank) or self._unfinished_partners(m)
        if not waiting and not self._member(rank).left:
            self.roster.depart(self._member(rank))
            if self.placed:
                self._note(self.topology.remove(rank))
        return waiting

    def _unfinished_partners(self, m: Member) -> list[int]:
        return unfinished_partners(m, self.members, self.clock())

    def gone(self, rank: int) -> list[tuple[int, int]]:
        """``rank`` left without asking (closed, or found dead): place nobody under it.

        Re-attaches its direct dependents to their nearest live ancestor (their own
        subtrees stay under them) and returns them as (rank, stripe) pairs to notify."""
        gone = self._member(rank)
        was_left = gone.left
        self.roster.depart(gone, unlink=True)
        self.pullers.stop(gone)
        if self.placed:
            moves = [] if was_left else self.topology.remove(rank)
            self._note(moves)
            return moves
        moved = []
        for m in self.members.values():
            if m.left:
                continue
            for stripe, parent in enumerate(m.parents):
                if parent == rank:
                    self.pullers.move(m, stripe, live_parent(self.topology, rank, stripe, set(self.roster.live)))
                    moved.append((m.rank, stripe))
        return moved

    def reparent(self, rank: int, stripe: int, parent: int, dead: bool) -> int:
        """``rank`` lost ``parent`` in ``stripe`` (dead, or sending bad chunks): its new parent there."""
        m = self._member(rank)
        if dead and parent != ROOT and parent in self.members:
            self.gone(parent)
        if m.parents[stripe] == parent:
            if self.placed:
                self._note([self.topology.move(rank, stripe, avoid=parent)])
            else:
                up = live_parent(self.topology, parent, stripe, set(self.roster.live)) if parent != ROOT else ROOT
                self.pullers.move(m, stripe, up)
        return m.parents[stripe]

    def touch(self, rank: int, have: int | None = None, rates: dict | None = None,
              delivered: dict | None = None) -> None:
        """``rank`` is alive; it holds ``have`` chunks and gets ``rates`` while it asks, and got
        ``delivered`` since its last report (both partner rank -> bytes/s)."""
        m = self.members.get(rank)
        if m is None:
            return
        m.seen = self.clock()
        if have is not None:
            m.have = have
        if rates is not None:
            m.rates = rates
        if delivered is not None:
            m.delivered = delivered

    def uplinks(self) -> dict[int, float]:
        """Each live forwarder's upload rate as its partners see it (``uplinks``)."""
        return uplinks(m for m in self.members.values() if not m.left and not m.done)

    def slow_hosts(self, n_chunks: int | None = None) -> list[int]:
        """Review the reported rates; demote hosts slow in SLOW_EVIDENCE reviews in a row.

        Returns the demoted ranks (their moves are in ``take_moved``).  Only
        forwarders are judged, against the median of the others' delivered rates,
        and (given ``n_chunks``) only while one of their planned children misses
        more than ``1 - END_SHARE`` of the chunks: a demotion then only moves
        children that are nearly done, and the last requests, few and far between,
        mislead (at N = 16, 2 of 5 runs demoted an honest host 0.5 s before the end).
        A host younger than ``YOUNG`` whose probe ran at ``PROBE_CLEARS`` of the probes'
        median or better is not judged yet: still starting, it delivers as slowly as a slow uplink."""
        if not self.placed:
            return []
        up = self.judged = self.uplinks()
        ordered = sorted(up.values())  # once: each host's reference is their median without it
        now, clears = self.clock(), PROBE_CLEARS * self.probe_median()  # a young host probed this fast is not judged
        demoted = []
        for r, rate in up.items():
            m = self.members.get(r)
            if m is None or m.left or m.demoted or len(up) < 3:
                continue
            least = min((self.members[c].have for c in self.dependents(r)), default=0) if n_chunks else 0
            if n_chunks and least >= END_SHARE * n_chunks:  # its children are nearly done
                m.slow_seen = 0
                continue
            ref = median_without(ordered, rate)
            slow = rate < SLOW_FRACTION * ref and not (0 < clears <= m.probe and now - m.joined < YOUNG)
            m.slow_seen = m.slow_seen + 1 if slow else 0
            if m.slow_seen >= SLOW_EVIDENCE:
                self._demote(m)
                demoted.append(r)
        return demoted

    def probed(self, rank: int, rate: float, long: bool = True, alone: bool | None = None) -> list[int]:
        """``rank``'s probe ran at ``rate`` bytes/s (``long``: it took ``PROBE_MIN_TIME`` or more):
        demote the probed hosts whose long probe ran below ``PROBE_SLOW`` of the probes' upper quartile,
        so a slow uplink is a leaf before it forwards anything (a review needs a chunk from it
        first: at a quarter of 100 Mbit/s, 2-3 s of a stripe held up).  Each is judged on its
        arrival, and again on every later one until ``PROBE_QUORUM`` probes are in (the first
        joiners have few to be judged against).  Only a probe ``alone`` on the uplink judges (all
        count in the median): sent while its host held no chunk to forward, or, where a peer does
        not say (``None``), from a host without children.  One sent while forwarding ran at a share
        of the uplink (a fast early joiner feeding two peers was demoted so); the reviews judge
        such a host.  Returns the demoted ranks (their moves are in ``take_moved``)."""
        m = self.members.get(rank)
        if m is None or not self.placed or rate <= 0 or m.probe:
            return []
        m.probe = rate
        bisect.insort(self.probes, rate)
        if long and (alone or alone is None and not self.topology.feeds(rank)):
            self.unsettled.add(rank)
        if len(self.probes) < 3:
            return []
        bar = PROBE_SLOW * probe_reference(self.probes)
        demoted = []
        for r in sorted(self.unsettled):
            x = self.members[r]
            if not x.left and not x.demoted and x.probe < bar:
                self._demote(x)
                demoted.append(r)
        if len(self.probes) >= PROBE_QUORUM:
            self.unsettled.clear()
        return demoted

    def probe_median(self) -> float:
        """The median of the probe rates in (bytes/s; 0 before any)."""
        return quantile(self.probes, 0.5)

    def _demote(self, m: Member) -> None:
        m.demoted = True
        moves = self.topology.demote(m.rank)
        self._note(moves)
        self.moved.extend(m.partners)  # they learn it feeds nobody further now (``downstream``),
        for rank, stripe in moves:  # and the partners of each peer above a moved one that it feeds more
            a = self.topology.parent[stripe].get(rank)  # (a stripe's new root, told nothing, helped
            while a is not None and a != ROOT:  # others, and the whole stripe lagged)
                self.moved.extend(self.members[a].partners if a in self.members else ())
                a = self.topology.parent[stripe].get(a)

    def _member(self, rank: int) -> Member:
        try:
            return self.members[rank]
        except KeyError:
            raise TrackerError(f"no peer has rank {rank}") from None

    def tree(self) -> dict[int, list[int]]:
        """Rank -> parent ranks, for every peer that joined."""
        return {r: list(m.parents) for r, m in self.members.items()}
