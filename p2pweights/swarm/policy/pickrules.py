"""The pull policy's rules besides help (``help``), each asking what it picks of whom: a reader's
waiters, each link's planned share (with orphaned stripes, and what the seeder serves), the endgame."""
from __future__ import annotations

from ...wire.chunkset import bitset_of, indices_of
from .help import cheapest, cheapest_first, cost
from .link import SEEDER, STALL_MIN, Link, held_by

PARK_AHEAD = 2  # chunks a planned source is asked for before it holds them (it forwards them at once)
SHARE_WINDOW = 3  # requests for orphaned stripes a partner that plans none of ours carries at once
SEEDER_PATIENCE = 1.0  # seconds an orphaned chunk no partner holds waits before the seeder serves it
ENDGAME_LATE = 2.0  # a request this many times later than its link's queue explains is overdue
ENDGAME_PER_LINK = 2  # endgame duplicates one link carries at once


def waiters(sched, ready: list[Link], out: dict) -> None:
    """Rule 1: the chunks a reader waits for (``prioritize``), lowest first, from any holder."""
    if not sched.urgent:
        return
    sched.avail = sched.full & ~sched.have & (~sched.inflight | sched.movable)  # (``ask`` takes from it)
    for lk in ready:
        sched.ask(lk, sched.pick(lk, sched.urgent & lk.holds, lk.free()), out)


def planned_mask(sched, rank: int) -> int | None:
    """The chunks of ``rank``'s planned stripes not yet asked of anyone (None: it plans none)."""
    stripes = [s for s, r in enumerate(sched.plan) if r == rank]
    if not stripes:
        return None
    mask = 0
    for s in stripes:
        mask |= sched.in_stripe[s]
    return mask & ~sched.inflight


def seeder_share(sched, orphaned: int) -> int:
    """Orphaned chunks the seeder may serve: those no partner has held for ``SEEDER_PATIENCE``
    seconds (at the front of a stripe a partner usually has it a moment later)."""
    now = sched.clock()
    since = sched.orphan_at
    sched.orphan_at = {i: since.get(i, now) for i in indices_of(orphaned & ~held_by(sched.links))}
    return bitset_of(i for i, t in sched.orphan_at.items() if now - t >= SEEDER_PATIENCE)


def share_of(sched, lk: Link, orphaned: int, bar: tuple[bool, int], typical: float) -> tuple[int | None, int]:
    """What ``lk`` is asked for in rule 2 and how many: its planned stripes, and of an orphaned one
    what it holds (at most ``SHARE_WINDOW`` in flight, and only if it is as cheap as ``bar``, where
    it plans none of ours) or, the seeder, what no partner holds (``seeder_share``)."""
    k, planned = lk.free(), planned_mask(sched, lk.rank)
    if lk.rank == SEEDER:
        mine = seeder_share(sched, orphaned)
    else:
        mine = orphaned & lk.holds if orphaned else None
        if planned is None and mine is not None:  # it only shares: a few at a time, if cheapest
            k = 0 if cost(sched, lk, typical) > bar else min(k, SHARE_WINDOW - (len(lk.outstanding) - lk.helping_now()))
    return (mine if planned is None else planned if mine is None else planned | mine), k


def planned_share(sched, ready: list[Link], orphaned: int, typical: float, out: dict) -> None:
    """Rule 2: each link's share, first what peers wait for at us (``PullScheduler.awaited``: a peer placed
    under us while we catch up is fed what it lacks, not our backlog, which it holds), then in index order,
    up to ``PARK_AHEAD`` parked ahead of what it holds (it forwards each the moment it verifies, so a tree
    pipelines); the seeder last.  Sharers of an
    orphaned stripe go cheapest first in random order (else the first listed carried it all); a peer
    more than two windows behind a source takes the rarest of the lowest first, ties apart, so
    siblings catching up on one source take different chunks and can give each other the rest."""
    spread = sum(lk.ready and lk.rank != SEEDER for lk in sched.links.values()) > 1  # partners around
    order = cheapest_first(sched, ready, typical) if orphaned else ready  # sharers spread
    bar = cheapest(sched, ready, orphaned, typical)
    for lk in sorted(order, key=lambda x: x.rank == SEEDER):
        mask, k = share_of(sched, lk, orphaned, bar, typical)
        if mask is not None:
            behind = 2 * lk.window if spread and lk.rank != SEEDER else None
            first = sched.pick(lk, mask & sched.below & lk.holds, k) if sched.below else []  # what waits on us
            sched.ask(lk, first, out)
            sched.ask(lk, sched.pick(lk, mask, k - len(first), park=PARK_AHEAD, spread_over=behind), out)


def endgame(sched, ready: list[Link], out: dict) -> None:
    """Rule 4: a missing chunk whose request is overdue (over ``ENDGAME_LATE`` times what its link's
    queue and rate explain) is asked of a second holder, never the seeder, at most ``ENDGAME_PER_LINK``
    per link; the first copy cancels the other.  A chunk is a few MiB: only where it saves time."""
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
