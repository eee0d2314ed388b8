"""Pull scheduler: which chunk this peer asks of which partner, and when (sans-IO).

One owner of the download's request state, changed only through named verbs
(``ready``, ``has``, ``arrived``, ``drop``, ``prioritize`` ...), with the clock
injected, so that it is tested without sockets (as Kraken tests its
``dispatch/piecerequest`` and libtorrent its ``piece_picker``).  The node feeds
it what partners say and sends what ``requests`` / ``stalled`` return.

Policy, per link (one partner), each with its own credit window sized from the
rate measured on that link (``QUEUE_TIME`` seconds of it, clamped):

1. chunks a waiter asked for (``prioritize``: ``wait_range`` / ``wait_tensor``),
   lowest index first, from any holder;
2. the link's planned share: the chunks of the stripes whose planned source it
   is, in index order, up to ``PARK_AHEAD`` asked before the source holds them
   (it parks them and forwards each the moment it is verified, so a tree
   pipelines); a stripe whose planned source is gone (or that has none: every
   slot is taken) is shared by the partners that hold it, in random order and
   at most ``SHARE_WINDOW`` each from partners that plan nothing for us (else
   the first partner listed carried it all), and by the seeder what no
   partner holds.  A peer more than two windows behind what its
   (non-seeder) source holds takes the rarest of the lowest candidates first,
   ties broken at random, so siblings catching up on one source take
   different chunks and can give each other the rest;
3. help: chunks of a stripe whose planned source lags behind what
   the other partners hold (``LAG_CHUNKS``), is much slower than the other
   links (``SLOW_LINK``), holds more than two windows we lack, was demoted
   by the tracker once that stripe is all we miss, stalled with nothing
   arriving since, has not attached within ``ATTACH_PATIENCE`` of its
   link opening, or, the end phase, when every chunk we miss is at some
   partner (the seeder is done with us, no pipeline grows), taken from the
   partners that hold them: only the cheapest (not slow: demoted by the
   tracker or below ``SLOW_HELPER`` of the typical link; then feeding fewest
   peers through its children, ``downstream``, and never one feeding more
   than ``HELP_DOWNSTREAM``: help from a stripe's root slows its whole
   tree), each chunk from the one that would deliver it
   soonest (its requests there over its rate: an idle fast partner before a
   busy or slow one; ties at random, so requesters spread), rarest first
   among the lowest candidates, at most ``HELP_WINDOW`` per helping link and
   per planned source in all, so help never crowds out a partner's own
   children; where a planned source is demoted (its quarter-rate spare slot
   gives its stripe at half the others' pace), ``HELP_WINDOW`` from each
   of the cheapest partners; in the end phase every partner that holds one
   (a finished one among them) helps with its whole window, the slow ones
   only where no fast one holds the chunks;
4. endgame: once nothing is left to ask, each missing chunk may be asked of a
   second holder; the first copy to arrive cancels the other request.

A request outstanding far longer than its link's rate explains is re-asked
elsewhere (``stalled``); a dropped link gives its requests back at once.

Sets of chunks (what we hold, what a partner holds, what is in flight) are
``chunkset`` bitsets: Python ints, bit i for chunk i.
"""
from __future__ import annotations

import math
import random
import time

from ..wire.chunkset import bitset, bitset_of, indices_of, lowest_of, stripe_mask

DEFAULT_WINDOW = 2  # a link's credit window until its first chunk measures its rate
MIN_WINDOW = 2
MAX_WINDOW = 32
QUEUE_TIME = 0.25  # seconds of a link's measured rate that its window keeps asked for
RATE_TIME = 0.25  # seconds: a link's rate is the bytes it delivered over the time it was asked, time that
#                  long ago weighing 1/e (not an average of per-chunk rates: chunks read back to back after
#                  a pause of this process, one sample spanning the pause and the rest a fraction of a
#                  millisecond each, made such an average read several times the uplink)
BUNCHED = 0.1  # a parked chunk verified within this share of a chunk-time (at the link's rate) of its
#               HAVE was read with it after a pause of this process: no rate sample (it read many uplinks)
LAG_CHUNKS = 8  # a planned source lacking more than this (or 2 windows) of what partners hold is lagging
SLOW_LINK = 0.3  # a planned source delivering below this share of the other links' median is slow
SLOW_HELPER = 0.5  # a partner delivering below this share of the links' median helps only if none is faster
HELP_DOWNSTREAM = 2  # a partner whose uplink feeds more peers than this beyond its children never helps
#                    (a stripe's root helping others starved its own children, so the whole stripe lagged)
HELP_WINDOW = 2  # requests a helping (non-planned) link carries at once
SHARE_WINDOW = 3  # requests for orphaned stripes a partner that plans none of ours carries at once
RAREST_AMONG = 16  # help picks the rarest of this many lowest candidates
STALL_MIN = 2.0  # seconds: no request is called stalled sooner
STALL_MAX = 10.0  # seconds: a request is called stalled after this long whatever the rate says
STALL_WINDOWS = 4  # a request is stalled after this many windows' worth of time at the link's rate
PARK_AHEAD = 2  # chunks a planned source is asked for before it holds them (it forwards them at once)
ENDGAME_LATE = 2.0  # a request this many times later than its link's queue explains is overdue
ENDGAME_PER_LINK = 2  # endgame duplicates one link carries at once
SEEDER_PATIENCE = 1.0  # seconds an orphaned chunk no partner holds waits before the seeder serves it
ATTACH_PATIENCE = 1.0  # seconds a planned source may take to attach before partners help with its stripe
SEEDER = 0  # rank of the seeder: serves beyond its planned stripes only what no partner holds,
#             so its uplink carries each chunk about once


class Link:
    """What this peer knows of one partner: holdings, requests, measured rate."""

    def __init__(self, rank: int, n_chunks: int, window: int = DEFAULT_WINDOW, opened: float = 0.0):
        self.rank, self.n_chunks, self.window = rank, n_chunks, window
        self.holds: int | None = None  # bitset of the chunks it holds; None until its bitfield arrives
        self.held = 0  # how many chunks it holds
        self.outstanding: dict[int, float] = {}  # chunk -> when asked
        self.rate = 0.0  # bytes/s while it had requests to serve: ``carried`` over ``busy``
        self.carried = 0.0  # bytes it delivered, each weighted by how recent (in time asked) it is
        self.busy = 0.0  # seconds it had requests to serve, weighted alike
        self.last_arrival = 0.0
        self.received = 0  # bytes that verified
        self.bad = 0  # chunks that failed verification
        self.helping: set[int] = set()  # chunks asked of it to help a lagging stripe
        self.unparked: set[int] = set()  # parked chunks its HAVE named: timed from that HAVE
        self.withdrawn: set[int] = set()  # chunks cancelled there; a copy already on its way is taken
        self.opened = opened  # when the link was added (attaching since then until its bitfield arrives)
        self.starved = False  # its requests stalled and nothing arrived since: its stripes are helped

    @property
    def ready(self) -> bool:
        return self.holds is not None

    @property
    def complete(self) -> bool:
        """It holds every chunk (a complete partner hears of every chunk it holds)."""
        return self.held >= self.n_chunks

    def unpark(self, index: int) -> bool:
        """Whether ``index`` was parked here until its HAVE (forgetting it)."""
        was = index in self.unparked
        self.unparked.discard(index)
        return was

    def measure(self, size: int, took: float, timed_by_have: bool) -> None:
        """A chunk of ``size`` bytes was served in ``took`` seconds: a rate sample, unless it was timed
        from its HAVE and came far sooner than the rate explains (read with that HAVE after a pause of
        this process: at N = 16 on 2 cores such samples made uplinks read 485 MB/s on 25 MB/s links)."""
        if timed_by_have and self.rate > 0 and took < BUNCHED * size / self.rate:
            return
        decay = math.exp(-took / RATE_TIME)  # the first sample: 0 carried over 0 s before it
        self.carried = self.carried * decay + size
        self.busy = self.busy * decay + took
        self.rate = self.carried / max(self.busy, 1e-4)

    def free(self, cap: int | None = None) -> int:
        return max(0, min(self.window, cap if cap is not None else self.window) - len(self.outstanding))


class PullScheduler:
    """Request state of one download: links, chunks in flight, priorities."""

    def __init__(self, n_chunks: int, chunk_size: int, have=None, stripes: int = 1,
                 window: int = DEFAULT_WINDOW, clock=time.monotonic, rng: random.Random | None = None):
        self.n = n_chunks
        self.rng = rng if rng is not None else random.Random(0)  # breaks ties between equally rare chunks
        self.chunk_size = chunk_size
        self.stripes = stripes
        self.default_window = max(MIN_WINDOW, min(MAX_WINDOW, window))
        self.clock = clock
        self.full = (1 << n_chunks) - 1  # every chunk
        self.have = 0 if have is None else bitset(have)  # bitsets, bit i for chunk i
        self.inflight = 0  # asked of at least one link
        self.asked: dict[int, set[int]] = {}  # chunk -> ranks it is asked of
        self.urgent = 0
        self.movable = 0  # in flight, parked at a lagging source that lacks it
        self.orphan_at: dict[int, float] = {}  # orphaned chunk no partner holds -> since when
        self.holders = [0] * n_chunks  # ready links holding each chunk
        self._avail = 0  # during ``requests``: what a pick may still take
        self.links: dict[int, Link] = {}
        self.downstream, self.seeder_lent = {}, False  # rank -> peers its uplink feeds through its children;
        #                                               whether the tracker lent us the seeder (``set_downstream``)
        self.slow: set[int] = set()  # ranks the tracker demoted (slow uplinks): asked for help last
        self.ending = False  # every chunk we miss is held by a partner (see ``_help_mask``)
        self.plan: list[int | None] = [None] * stripes
        self.set_stripes(stripes)
        self.cancels: dict[int, list[int]] = {}  # rank -> chunks to CANCEL there (see take_cancels)
        self.dirty = True  # something changed since the last ``requests``: decide again

    # ----- links -------------------------------------------------------------

    def add(self, rank: int) -> None:
        """A link to partner ``rank`` is opening (nothing is asked of it before ``ready``)."""
        self.dirty = True
        if rank not in self.links:
            self.links[rank] = Link(rank, self.n, window=self.default_window, opened=self.clock())

    def ready(self, rank: int, holds) -> None:
        """Partner ``rank`` attached us and holds the chunks set in ``holds``."""
        self.dirty = True
        link = self.links[rank]
        if link.holds is not None:
            _count(self.holders, link.holds, -1)
        link.holds = bitset(holds) & self.full
        link.held = link.holds.bit_count()
        _count(self.holders, link.holds, 1)

    def has(self, rank: int, indices) -> None:
        """Partner ``rank`` verified ``indices`` (a HAVE).  Only one that offers a chunk still to ask,
        holds one parked there, or completes it makes ``requests`` decide again (most do not)."""
        link = self.links.get(rank)
        if link is None or link.holds is None:
            return
        holds, outstanding, now = link.holds, link.outstanding, self.clock()
        taken = self.have | self.inflight
        for i in indices:
            bit = 1 << i
            if not holds & bit:
                holds |= bit
                link.held += 1
                self.holders[i] += 1
                if i in outstanding:  # parked there until now: its service starts now (for the rate)
                    outstanding[i] = now
                    link.unparked.add(i)
                    self.dirty = True
                elif not taken & bit:
                    self.dirty = True
        link.holds = holds
        if link.held >= self.n:
            self.dirty = True

    def drop(self, rank: int) -> list[int]:
        """Forget partner ``rank`` (gone or given up); its requests are free to ask elsewhere."""
        self.dirty = True
        link = self.links.pop(rank, None)
        if link is None:
            return []
        if link.holds is not None:
            _count(self.holders, link.holds, -1)
        back = sorted(link.outstanding)
        for i in back:
            self._unask(i, rank)
        return back

    def set_stripes(self, stripes: int) -> None:
        """Chunk i belongs to stripe i mod ``stripes`` (the plan's, from the WELCOME)."""
        self.stripes = stripes
        self.in_stripe = [stripe_mask(self.n, stripes, s) for s in range(stripes)]  # built once
        self.plan = (list(self.plan) + [None] * stripes)[:stripes]

    def set_plan(self, plan: list[int | None]) -> None:
        """The planned source (partner rank) of each stripe.

        A stripe's requests still waiting at its former source are withdrawn
        there (a copy already on its way is still taken) and asked of the new one."""
        self.dirty = True
        for s, (old, new) in enumerate(zip(self.plan, plan)):
            lk = self.links.get(old) if old is not None and old != new else None
            if lk is None:
                continue
            moved = sorted(i for i in lk.outstanding if i % self.stripes == s and i not in lk.helping)
            for i in moved:
                del lk.outstanding[i]
                self._unask(i, lk.rank)
            if moved:
                self._withdraw(lk, moved)
        self.plan = list(plan)

    def set_downstream(self, downstream: dict[int, int], slow=(), lent: bool = False) -> None:
        """Peers each partner's uplink feeds beyond its children, the partners the tracker found slow
        (demoted), whether it lent us the seeder (in the end phase it helps as partners do): the tracker's."""
        self.dirty, self.downstream, self.slow, self.seeder_lent = True, dict(downstream), set(slow), lent

    # ----- chunks ------------------------------------------------------------

    def expects(self, rank: int, index: int) -> bool:
        """Whether ``index`` may be taken from ``rank``: asked of it, or withdrawn from it (a stall
        re-request, an endgame loser) and still missing; a late copy is as good as any."""
        link = self.links.get(rank)
        return link is not None and (index in link.outstanding or (index in link.withdrawn and not self.got(index)))

    def arrived(self, rank: int, index: int, ok: bool) -> None:
        """Chunk ``index`` came from ``rank``; ``ok``: it verified (else it is asked again)."""
        self.dirty = True
        now = self.clock()
        link = self.links[rank]
        asked_at = link.outstanding.pop(index, link.last_arrival)
        link.withdrawn.discard(index)
        link.helping.discard(index)
        self._unask(index, rank)
        busy_since = max(link.last_arrival, asked_at)
        timed_by_have, link.last_arrival, link.starved = link.unpark(index) and busy_since == asked_at, now, False
        if not ok:
            link.bad += 1
            return
        link.measure(self.chunk_size, now - busy_since, timed_by_have)
        link.window = max(MIN_WINDOW, min(MAX_WINDOW, math.ceil(link.rate * QUEUE_TIME / self.chunk_size)))
        link.received += self.chunk_size
        self.verified(index)

    def verified(self, index: int) -> None:
        """We hold chunk ``index`` now; its other (endgame) requests are to be cancelled."""
        self.dirty = True
        self.have |= 1 << index
        self.urgent &= ~(1 << index)
        for r in sorted(self.asked.get(index, ())):
            self.links[r].outstanding.pop(index, None)
            self._unask(index, r)
            self.cancels.setdefault(r, []).append(index)

    def take_cancels(self) -> list[tuple[int, list[int]]]:
        """CANCELs to send: ``[(rank, [chunk, ...]), ...]`` (endgame losers, moved parked requests)."""
        out = sorted(self.cancels.items())
        self.cancels.clear()
        return out

    def prioritize(self, indices) -> None:
        """A reader waits for ``indices``: ask for them before anything else."""
        self.dirty = True
        self.urgent |= bitset_of(indices) & ~self.have

    def got(self, index: int) -> bool:
        """Whether chunk ``index`` is verified here."""
        return bool(self.have >> index & 1)

    @property
    def complete(self) -> bool:
        return self.have == self.full

    def missing(self) -> int:
        return self.n - self.have.bit_count()

    # ----- decisions ---------------------------------------------------------

    def requests(self) -> list[tuple[int, list[int]]]:
        """What to ask of whom now: ``[(rank, [chunk, ...]), ...]``, each within its link's credits;
        nothing is decided again until a verb changed something (``dirty``)."""
        if not self.dirty:
            return []
        self.dirty = False
        out: dict[int, list[int]] = {}
        ready = [lk for lk in self.links.values() if lk.ready and lk.free()]
        if not ready:  # every credit is taken: nothing to ask until one frees (which sets dirty)
            return []
        if self.urgent:  # 1. waiters first, from whoever holds them
            self._avail = self.full & ~self.have & (~self.inflight | self.movable)  # what a pick may take
            for lk in ready:  # (``_ask`` takes what it asks out of it)
                self._ask(lk, self._pick(lk, self.urgent & lk.holds, lk.free()), out)
        lagging, orphaned = _help_mask(self)
        self._avail = self.full & ~self.have & (~self.inflight | self.movable)
        any_orphaned = orphaned != 0
        spread = sum(lk.ready and lk.rank != SEEDER for lk in self.links.values()) > 1  # catching up on a
        #   backlog with partners around: rarest first, ties apart, so what we take we can give them
        typical = _typical_rate(self)
        order = _cheapest_first(self, ready, typical) if any_orphaned else ready  # sharers spread
        cheapest = _cheapest(self, ready, orphaned, typical)
        for lk in sorted(order, key=lambda x: x.rank == SEEDER):  # 2. planned share, and orphaned stripes
            k = lk.free()
            planned = self._planned_mask(lk.rank)
            if lk.rank == SEEDER:
                mine = _seeder_share(self, orphaned)
            else:
                mine = orphaned & lk.holds if any_orphaned else None
                if planned is None and mine is not None:  # it only shares: a few at a time, if cheapest
                    k = 0 if _cost(self, lk, typical) > cheapest else min(k, SHARE_WINDOW - sum(
                        1 for i in lk.outstanding if i not in lk.helping))
            mask = mine if planned is None else planned if mine is None else planned | mine
            if mask is not None:
                behind = 2 * lk.window if spread and lk.rank != SEEDER else None
                self._ask(lk, self._pick(lk, mask, k, park=PARK_AHEAD, spread_over=behind), out)
        lagging &= ~orphaned
        if lagging:  # 3. a stripe whose planned source lags: partners help, a few chunks each
            _help(self, ready, lagging, typical, out)
        if not self._wanted() and not self.complete:  # 4. endgame: a second holder
            _endgame(self, ready, out)
        return list(out.items())

    def stalled(self) -> list[tuple[int, list[int]]]:
        """Requests outstanding far longer than their link's rate explains: given back to ask
        elsewhere (and to CANCEL there).  Returns them per link, for the log."""
        return _stalled(self)

    def waiting_for(self) -> list[int]:
        """Missing chunks no live partner holds (what a peer with no source left waits for)."""
        return indices_of(self.full & ~self.have & ~_held_by(self.links, ()))

    # ----- internals ---------------------------------------------------------

    def _wanted(self) -> int:
        return self.full & ~self.have & ~self.inflight

    def _planned_mask(self, rank: int) -> int | None:
        """The chunks of ``rank``'s planned stripes not yet asked of anyone (None: it plans none)."""
        stripes = [s for s, r in enumerate(self.plan) if r == rank]
        if not stripes:
            return None
        mask = 0
        for s in stripes:
            mask |= self.in_stripe[s]
        return mask & ~self.inflight

    def _pick(self, lk: Link, mask: int, k: int, rarest: bool = False, park: int = 0,
              spread_over: int | None = None) -> list[int]:
        """Up to ``k`` chunks of ``mask`` to ask of ``lk``: lowest first (or rarest among the lowest);
        ``park``: how many it may hold parked (asked before it has them) at once; ``spread_over``: rarest
        first when ``lk`` holds more candidates than this (we are catching up on it)."""
        if k <= 0:
            return []
        mask &= self._avail
        if mask & self.movable:  # in flight elsewhere may be taken, not what is asked of ``lk`` already
            for i in lk.outstanding:
                mask &= ~(1 << i)
        if not mask:
            return []
        if park:
            held = mask & lk.holds
            parked = sum(1 for i in lk.outstanding if not lk.holds >> i & 1)
            ahead = lowest_of(mask & ~lk.holds, max(0, park - parked))
            rarest = rarest or (spread_over is not None and held.bit_count() > spread_over)
            mask = held | bitset_of(ahead)
        if not rarest:
            return lowest_of(mask, k)
        lowest = lowest_of(mask, max(k, RAREST_AMONG))
        ties = [self.rng.random() for _ in lowest]  # equally rare: peers pick apart
        order = sorted(range(len(lowest)), key=lambda j: (self.holders[lowest[j]], ties[j]))
        return [lowest[j] for j in order[:k]]

    def _ask(self, lk: Link, chunks: list[int], out: dict) -> None:
        now = self.clock()
        for i in chunks:
            for other in self.asked.get(i, ()):  # a parked request moved to a holder: the credit
                self.links[other].outstanding.pop(i, None)  # it frees there is decided next time
                self._withdraw(self.links[other], [i])
                self.dirty = True
            bit = 1 << i
            self.movable &= ~bit
            self._avail &= ~bit
            self.asked[i] = {lk.rank}
            self.inflight |= bit
            lk.outstanding[i] = now
            lk.unparked.discard(i)  # timed from now until a HAVE names it
            if i in self.cancels.get(lk.rank, ()):  # withdrawn there a moment ago and wanted again
                self.cancels[lk.rank].remove(i)
        if chunks:
            out.setdefault(lk.rank, []).extend(chunks)

    def _withdraw(self, lk: Link, chunks: list[int]) -> None:
        """CANCEL ``chunks`` at ``lk``; a copy it already sent is still taken (``expects``)."""
        self.cancels.setdefault(lk.rank, []).extend(chunks)
        lk.withdrawn.update(chunks)

    def _unask(self, index: int, rank: int) -> None:
        ranks = self.asked.get(index)
        if ranks is not None:
            ranks.discard(rank)
            if not ranks:
                del self.asked[index]
                self.inflight &= ~(1 << index)


def _held_by(links: dict[int, Link], besides=(SEEDER,)) -> int:
    """The chunks some ready partner holds, the ranks ``besides`` aside."""
    held = 0
    for lk in links.values():
        if lk.holds is not None and lk.rank not in besides:
            held |= lk.holds
    return held


def _count(holders: list[int], holds: int, step: int) -> None:
    """Add ``step`` to the holder count of each chunk in ``holds``."""
    for i in indices_of(holds):
        holders[i] += step


def _median(values: list[float]) -> float:
    """The median of a non-empty list (``statistics`` costs a join 5 ms of start-up to import)."""
    ordered, mid = sorted(values), len(values) // 2
    return ordered[mid] if len(values) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _typical_rate(sched: PullScheduler) -> float:
    """The median rate of the links that measured one (bytes/s; 0 if none has)."""
    rates = [lk.rate for lk in sched.links.values() if lk.rate > 0]
    return _median(rates) if rates else 0.0


def _seeder_share(sched: PullScheduler, orphaned: int) -> int:
    """Orphaned chunks the seeder may serve: those no partner has held for ``SEEDER_PATIENCE``
    seconds (at the front of a stripe a partner usually has it a moment later)."""
    now = sched.clock()
    since = sched.orphan_at
    sched.orphan_at = {i: since.get(i, now) for i in indices_of(orphaned & ~_held_by(sched.links))}
    return bitset_of(i for i, t in sched.orphan_at.items() if now - t >= SEEDER_PATIENCE)


def _stalled(sched: PullScheduler) -> list[tuple[int, list[int]]]:
    """``PullScheduler.stalled``: for each link whose requests wait far longer than its rate
    explains, give them back (and CANCEL them there)."""
    now = sched.clock()
    out = []
    if (sched.inflight and not sched._wanted()) or sched.orphan_at or \
            any(not lk.ready or any(not lk.holds >> i & 1 for i in lk.outstanding) for lk in sched.links.values()):
        sched.dirty = True  # the endgame, the seeder's, attach and parking patience depend on time: look again
    typical = None
    for lk in sched.links.values():
        if not lk.outstanding:
            continue
        if not lk.rate and typical is None:
            typical = _typical_rate(sched)
        rate = lk.rate or typical
        bound = STALL_MAX if rate <= 0 else \
            min(STALL_MAX, max(STALL_MIN, STALL_WINDOWS * lk.window * sched.chunk_size / rate))
        if not lk.outstanding or now - lk.last_arrival <= bound:
            continue  # it delivers: a long queue at a busy partner is not a stall
        late = [i for i, t in lk.outstanding.items()
                if now - t > bound and (lk.holds is not None and lk.holds >> i & 1)]
        if late:
            for i in late:
                del lk.outstanding[i]
                sched._unask(i, lk.rank)
            lk.rate /= 2
            lk.starved = sched.dirty = True
            sched._withdraw(lk, sorted(late))
            out.append((lk.rank, sorted(late)))
    return out


def _cheapest_first(sched: PullScheduler, links: list[Link], typical: float) -> list[Link]:
    """``links`` cheapest first (``_cost``), and among equals the soonest to deliver one more chunk
    (``_eta``: an idle fast partner before a busy one), ties in random order so requesters spread."""
    return sorted(sched.rng.sample(links, len(links)),
                  key=lambda lk: (_cost(sched, lk, typical), _eta(lk, typical)))


def _eta(lk: Link, typical: float) -> float:
    """When ``lk`` would deliver one more chunk asked of it now: the chunks it would have outstanding over its
    rate (seconds per byte of a chunk; only ever compared with another link's)."""
    rate = lk.rate or typical
    return (len(lk.outstanding) + 1) / rate if rate > 0 else 0.0


def _cost(sched: PullScheduler, lk: Link, typical: float) -> tuple[bool, int]:
    """What asking ``lk`` for help costs the fleet, cheapest first: whether it is slow (the tracker
    demoted it, or its link delivers below ``SLOW_HELPER`` of the ``typical`` link's rate: one
    carrying many flows; a request there waits seconds), then the peers its uplink feeds beyond its
    children (``downstream``), none once it holds every chunk (its children then keep up with it)."""
    slow = lk.rank in sched.slow or (not lk.complete and 0 < lk.rate < SLOW_HELPER * typical)  # a complete
    #   one's rate was measured while it forwarded: the tracker's word alone judges it now
    return slow, 0 if lk.complete else sched.downstream.get(lk.rank, 0)


def _cheapest(sched: PullScheduler, links: list[Link], wanted: int, typical: float) -> tuple[bool, int]:
    """The lowest ``_cost`` of the ``links`` that can be asked now (the seeder aside) and hold some
    ``wanted`` chunk: only partners that cheap help or share, so no stripe's root gives its
    children's uplink away and no slow uplink is asked while a fast one holds the chunks.  A
    partner with no credit free (a planned source whose window waits on chunks it lacks) does not
    set the bar: it would shut every other holder out."""
    return min((_cost(sched, lk, typical) for lk in links
                if lk.free() and lk.rank != SEEDER and wanted & lk.holds), default=(False, 0))


def _help(sched: PullScheduler, ready: list[Link], lagging: int, typical: float, out: dict) -> None:
    """Step 3 of ``requests``: among the cheapest partners that hold lagging chunks, each chunk of
    help goes to the one that would deliver it soonest (``_eta``), ties in random order so
    requesters spread; rarest first among the lowest lagging chunks it holds, at most
    ``HELP_WINDOW`` per link and the budget in all."""
    helping = {r: sum(1 for i in lk.outstanding if i in lk.helping) for r, lk in sched.links.items()}  # in flight
    planned = set(sched.plan)
    budget = HELP_WINDOW * (max(1, len(planned)) + len(planned & sched.slow)) - sum(helping.values())
    cheapest = _cheapest(sched, ready, lagging & sched._avail, typical)  # what is still to ask
    cands = [lk for lk in sched.rng.sample(ready, len(ready))  # random: ``min`` below keeps the first of equals
             if lk.rank != SEEDER and ((cost := _cost(sched, lk, typical)) <= cheapest and cost[1] <= HELP_DOWNSTREAM
                                       or sched.ending and cost[0] <= cheapest[0])
             or lk.rank == SEEDER and sched.ending and sched.seeder_lent]  # lent: its uplink idles otherwise
    if planned & sched.slow:  # a demoted source's stripe comes mostly from partners: each cheap one helps (the
        #                       peer so fed finished last, two helpers at two requests while finished hosts idled)
        budget = max(budget, HELP_WINDOW * len(cands) - sum(helping[lk.rank] for lk in cands))
    if sched.ending:  # no pipeline to feed any more: each partner's whole window helps (the last peers to
        #             finish took their backlog from one source while finished or nearly idle ones waited)
        budget += sum(lk.free() for lk in cands)
    while budget > 0 and cands:
        lk = min(cands, key=lambda x: _eta(x, typical))  # all as cheap: the soonest to deliver
        cap = lk.free() if sched.ending else min(lk.free(), HELP_WINDOW - helping[lk.rank])
        chunks = sched._pick(lk, lagging & lk.holds, min(cap, 1), rarest=True)
        if not chunks:
            cands.remove(lk)
            continue
        lk.helping.add(chunks[0])
        helping[lk.rank] += 1
        budget -= 1
        sched._ask(lk, chunks, out)


def _help_mask(sched: PullScheduler) -> tuple[int, int]:
    """Chunks other partners may be asked for (stripes whose planned source lags), and the
    subset whose planned source is gone (which the seeder may serve too)."""
    mask = orphaned = sched.movable = 0
    wanted = sched.full & ~sched.have
    sched.ending = bool(wanted) and not wanted & ~_held_by(sched.links)  # the seeder is done with us: every
    #   chunk we miss is at a partner (always so once one holds every chunk: the drain), and no pipeline grows
    #   any more, so every stripe is helped, every partner holding one chunk of it with its whole window
    for s, rank in enumerate(sched.plan):
        src = sched.links.get(rank) if rank is not None else None
        in_stripe = sched.in_stripe[s]
        missing = in_stripe & ~sched.have
        slow = False
        if src is None:  # gone (given up, or never named): every holder shares the stripe
            lagging = True
            orphaned |= missing & ~sched.inflight
        elif not src.ready:  # still attaching: wait for it a moment, then let partners help meanwhile
            lagging = sched.clock() - src.opened > ATTACH_PATIENCE  # (a silent one is given up, then orphaned)
        else:
            others = _held_by(sched.links, (SEEDER, rank))  # partners besides the seeder and the source
            lacks = (missing & others & ~src.holds).bit_count()
            rates = [lk.rate for lk in sched.links.values() if lk.rate > 0 and lk is not src]
            # a demoted source holds us back once this stripe is all we miss (its pace set the plan's
            # share; the partners done with their own stripes have the uplink to spare now)
            slow = (rank in sched.slow and not sched.full & ~(sched.have | in_stripe)) or src.starved or \
                (src.rate > 0 and bool(rates) and src.rate < SLOW_LINK * _median(rates))
            # lagging: it lacks what others hold, it is slow, or it holds more than we keep up with
            lagging = lacks > max(LAG_CHUNKS, 2 * src.window) or slow or \
                (missing & src.holds & ~sched.inflight).bit_count() > 2 * src.window
            # parked for a while at a source that still lacks them, though partners hold them: its
            # window waits on holes it must fill first, so they are taken from the partners
            now = sched.clock()
            stuck = bitset_of(i for i, t in src.outstanding.items() if not src.holds >> i & 1 and others >> i & 1
                              and now - t > STALL_MIN and len(sched.asked[i]) == 1)
            mask |= stuck
            sched.movable |= stuck
        if lagging or sched.ending:
            mask |= missing & ~sched.inflight
            if slow:  # parked at a slow source
                parked = bitset_of(i for i in src.outstanding if not src.holds >> i & 1 and len(sched.asked[i]) == 1)
                mask |= parked
                sched.movable |= parked
    return mask & ~sched.have, orphaned


def _endgame(sched: PullScheduler, ready: list[Link], out: dict) -> None:
    """Ask a second holder for a missing chunk whose request is overdue: outstanding more than
    ``ENDGAME_LATE`` times what its link's queue and rate explain.  A chunk is a few MiB, so a
    duplicate is asked only where it saves time, at most ``ENDGAME_PER_LINK`` per link."""
    now = sched.clock()
    if sched.missing() > max(ENDGAME_PER_LINK, 2 * len(ready)):
        return
    overdue = []
    for i, ranks in sched.asked.items():
        if len(ranks) != 1 or sched.got(i):
            continue
        src = sched.links[next(iter(ranks))]
        if src.holds is None or not src.holds >> i & 1:
            continue  # parked: it waits for its own source, a second one would not be faster
        expect = len(src.outstanding) * sched.chunk_size / src.rate if src.rate > 0 else STALL_MIN
        t = src.outstanding.get(i, now)
        if now - t > ENDGAME_LATE * expect:
            overdue.append((t, i, src.rank))
    if not overdue:
        return
    for lk in sorted(ready, key=lambda x: -x.rate):
        if lk.rank == SEEDER:
            continue  # its uplink carries each chunk about once: no duplicates from it
        dup = sum(1 for i in lk.outstanding if len(sched.asked.get(i, ())) > 1)
        free = min(lk.free(), ENDGAME_PER_LINK - dup)
        picks = [i for _, i, r in sorted(overdue) if r != lk.rank and lk.holds >> i & 1 and len(sched.asked[i]) == 1]
        for i in picks[:max(0, free)]:
            sched.asked[i].add(lk.rank)
            lk.outstanding[i] = now
            out.setdefault(lk.rank, []).append(i)
