"""Pull scheduler: which chunk this peer asks of which partner, and when (sans-IO).

One owner of the download's request state, changed only through named verbs
(``ready``, ``has``, ``arrived``, ``drop``, ``prioritize`` ...), with the clock
injected, so that it is tested without sockets (as Kraken tests its
``dispatch/piecerequest`` and libtorrent its ``piece_picker``).  The node feeds
it what partners say and sends what ``requests`` / ``stalled`` return.

The idea: each stripe of chunks comes from its planned source, down a tree
that pipelines; partners fill in where a source falls behind.  Each link
(one partner) has a credit window sized from the rate measured on it
(``link.Link``), and ``requests`` fills the windows by four rules, in order:

1. waiters (``pickrules.waiters``): chunks a reader waits for, from any holder;
2. the planned share (``pickrules.planned_share``): each link's planned
   stripes, parked a little ahead of what it holds; orphaned stripes shared
   by their holders, and by the seeder what no partner holds;
3. help (``help``): a stripe whose planned source lags is helped by the
   cheapest partners that hold it, a few chunks each (every stripe, with
   whole windows, in the end phase);
4. endgame (``pickrules.endgame``): an overdue request asked of a second
   holder; the first copy to arrive cancels the other.

A request outstanding far longer than its link's rate explains is re-asked
elsewhere (``stalled``); a dropped link gives its requests back at once.
Sets of chunks are ``chunkset`` bitsets: Python ints, bit i for chunk i.
"""
from __future__ import annotations

import random
import time

from ...wire.chunkset import bitset, bitset_of, indices_of, lowest_of, stripe_mask
from .help import HELP_WINDOW, help_lagging, help_mask
from .link import DEFAULT_WINDOW, MAX_WINDOW, MIN_WINDOW, SEEDER, STALL_MIN, Link, held_by, typical_rate
from .pickrules import SHARE_WINDOW, endgame, planned_share, waiters

__all__ = ["DEFAULT_WINDOW", "HELP_WINDOW", "MAX_WINDOW", "MIN_WINDOW", "RAREST_AMONG", "SEEDER", "SHARE_WINDOW",
           "Link", "PullScheduler"]

RAREST_AMONG = 16  # a rarest-first pick takes the rarest of this many lowest candidates
STALL_MAX = 10.0  # seconds: a request is called stalled after this long whatever the rate says
STALL_WINDOWS = 4  # a request is stalled after this many windows' worth of time at the link's rate


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
        self.below = 0  # chunks a peer waits for at us (parked here): asked of our planned sources first
        self.movable = 0  # in flight, parked at a lagging source that lacks it
        self.orphan_at: dict[int, float] = {}  # orphaned chunk no partner holds -> since when
        self.holders = [0] * n_chunks  # ready links holding each chunk
        self.avail = 0  # during ``requests``: what a pick may still take
        self.links: dict[int, Link] = {}
        self.downstream, self.seeder_lent = {}, False  # rank -> peers its uplink feeds through its children;
        #                                               whether the tracker lent us the seeder (``set_downstream``)
        self.slow: set[int] = set()  # ranks the tracker demoted (slow uplinks): asked for help last
        self.ending = False  # every chunk we miss is held by a partner (``help.end_phase``)
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
        link.resize(self.chunk_size)
        link.received += self.chunk_size
        self.verified(index)

    def verified(self, index: int) -> None:
        """We hold chunk ``index`` now; its other (endgame) requests are to be cancelled."""
        self.dirty = True
        self.have |= 1 << index
        self.urgent &= ~(1 << index)
        self.below &= ~(1 << index)
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

    def awaited(self, indices) -> None:
        """Peers asked us for ``indices`` before we hold them (parked here): ask our planned sources for them
        before the rest of their share (``pickrules.planned_share``)."""
        if indices:
            self.dirty = True
            self.below |= bitset_of(indices) & ~self.have

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
        waiters(self, ready, out)  # 1. a reader's chunks first
        lagging, orphaned = help_mask(self)  # (stripes whose source lags or is gone; the end phase)
        self.avail = self.full & ~self.have & (~self.inflight | self.movable)
        typical = typical_rate(self.links)
        planned_share(self, ready, orphaned, typical, out)  # 2. each link's share, orphaned stripes
        if lagging & ~orphaned:  # 3. partners help a stripe whose planned source lags
            help_lagging(self, ready, lagging & ~orphaned, typical, out)
        if not self.wanted() and not self.complete:  # 4. a second holder for what is overdue
            endgame(self, ready, out)
        return list(out.items())

    def stalled(self) -> list[tuple[int, list[int]]]:
        """Requests outstanding far longer than their link's rate explains: given back to ask
        elsewhere (and to CANCEL there).  Returns them per link, for the log."""
        return _stalled(self)

    def waiting_for(self) -> list[int]:
        """Missing chunks no live partner holds (what a peer with no source left waits for)."""
        return indices_of(self.full & ~self.have & ~held_by(self.links, ()))

    def wanted(self) -> int:
        """Missing chunks asked of nobody."""
        return self.full & ~self.have & ~self.inflight

    # ----- the rules' verbs ----------------------------------------------------

    def pick(self, lk: Link, mask: int, k: int, rarest: bool = False, park: int = 0,
             spread_over: int | None = None) -> list[int]:
        """Up to ``k`` chunks of ``mask`` to ask of ``lk``: lowest first (or rarest among the lowest);
        ``park``: how many it may hold parked (asked before it has them) at once; ``spread_over``: rarest
        first when ``lk`` holds more candidates than this (we are catching up on it)."""
        if k <= 0:
            return []
        mask &= self.avail
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

    def ask(self, lk: Link, chunks: list[int], out: dict) -> None:
        """Ask ``chunks`` of ``lk`` (into ``out``), moving any asked elsewhere (parked) here."""
        now = self.clock()
        for i in chunks:
            for other in self.asked.get(i, ()):  # a parked request moved to a holder: the credit
                self.links[other].outstanding.pop(i, None)  # it frees there is decided next time
                self._withdraw(self.links[other], [i])
                self.dirty = True
            bit = 1 << i
            self.movable &= ~bit
            self.avail &= ~bit
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


def _count(holders: list[int], holds: int, step: int) -> None:
    """Add ``step`` to the holder count of each chunk in ``holds``."""
    for i in indices_of(holds):
        holders[i] += step


def _stalled(sched: PullScheduler) -> list[tuple[int, list[int]]]:
    """``PullScheduler.stalled``: for each link whose requests wait far longer than its rate
    explains, give them back (and CANCEL them there)."""
    now = sched.clock()
    out = []
    if (sched.inflight and not sched.wanted()) or sched.orphan_at or \
            any(not lk.ready or any(not lk.holds >> i & 1 for i in lk.outstanding) for lk in sched.links.values()):
        sched.dirty = True  # the endgame, the seeder's, attach and parking patience depend on time: look again
    typical = None
    for lk in sched.links.values():
        if not lk.outstanding:
            continue
        if not lk.rate and typical is None:
            typical = typical_rate(sched.links)
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


