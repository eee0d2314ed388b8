"""Help: partners other than a stripe's planned source are asked for its chunks while that source lags.

Three questions, each a rule of its own:

- which chunks (``lag``, ``help_mask``): those of a stripe whose planned source is gone, has not
  attached within ``ATTACH_PATIENCE``, is demoted once its stripe is all we miss, stalled with
  nothing since, delivers under ``SLOW_LINK`` of the other links, lacks what partners hold, or holds
  more than we keep up with; requests parked too long at a source that lacks them (``stuck``, or
  any at a slow one, ``parked``); in the end phase (``end_phase``) every stripe's;
- who (``helpers``): only the cheapest holders (``cost``: not slow, then feeding fewest peers
  downstream, never more than ``HELP_DOWNSTREAM``), each chunk to the soonest to deliver it (``eta``);
- how many (``budget``): ``HELP_WINDOW`` per helping link and per planned source, so help never
  crowds out a partner's own children; ``HELP_WINDOW`` from each cheap partner where a planned source
  is demoted; every helper's whole window in the end phase.
"""
from __future__ import annotations

from ...wire.chunkset import bitset_of
from .link import SEEDER, STALL_MIN, Link, held_by, median

LAG_CHUNKS = 8  # a planned source lacking more than this (or 2 windows) of what partners hold is lagging
SLOW_LINK = 0.3  # a planned source delivering below this share of the other links' median is slow
ATTACH_PATIENCE = 1.0  # seconds a planned source may take to attach before partners help with its stripe
SLOW_HELPER = 0.5  # a partner delivering below this share of the links' median helps only if none is faster
HELP_DOWNSTREAM = 2  # a partner whose uplink feeds more peers than this beyond its children never helps
#                    (a stripe's root helping others starved its own children, so the whole stripe lagged)
HELP_WINDOW = 2  # requests a helping (non-planned) link carries at once

# Why a stripe's planned source needs help (``lag``); the slow ones also give up their parked requests.
GONE, UNATTACHED, DEMOTED, STARVED, SLOW, LACKS, AHEAD = \
    "gone", "unattached", "demoted", "starved", "slow", "lacks", "ahead"
SLOW_REASONS = (DEMOTED, STARVED, SLOW)


# ----- which chunks ----------------------------------------------------------

def lag(sched, s: int) -> str | None:
    """Why stripe ``s``'s planned source needs help, or None while it keeps up."""
    rank = sched.plan[s]
    src = sched.links.get(rank) if rank is not None else None
    if src is None:  # given up, or never named (every slot taken): every holder shares the stripe
        return GONE
    if not src.ready:  # still attaching: wait for it a moment (a silent one is given up, then gone)
        return UNATTACHED if sched.clock() - src.opened > ATTACH_PATIENCE else None
    in_stripe = sched.in_stripe[s]
    if rank in sched.slow and not sched.full & ~(sched.have | in_stripe):
        return DEMOTED  # its pace set the plan's share; the partners done with their own stripes have uplink now
    if src.starved:
        return STARVED
    rates = [lk.rate for lk in sched.links.values() if lk.rate > 0 and lk is not src]
    if src.rate > 0 and rates and src.rate < SLOW_LINK * median(rates):
        return SLOW
    missing = in_stripe & ~sched.have
    if (missing & held_by(sched.links, (SEEDER, rank)) & ~src.holds).bit_count() > max(LAG_CHUNKS, 2 * src.window):
        return LACKS
    if (missing & src.holds & ~sched.inflight).bit_count() > 2 * src.window:
        return AHEAD  # it holds more than we keep up with
    return None


def stuck(sched, src: Link) -> int:
    """Requests parked at ``src`` over ``STALL_MIN`` though partners hold them: its window waits on
    holes it must fill first, so they are taken from the partners."""
    now, others = sched.clock(), held_by(sched.links, (SEEDER, src.rank))
    return bitset_of(i for i, t in src.outstanding.items() if not src.holds >> i & 1 and others >> i & 1
                     and now - t > STALL_MIN and len(sched.asked[i]) == 1)


def parked(sched, src: Link) -> int:
    """Requests parked at ``src`` (asked before it holds them) and asked of nobody else."""
    return bitset_of(i for i in src.outstanding if not src.holds >> i & 1 and len(sched.asked[i]) == 1)


def end_phase(sched) -> bool:
    """Every chunk we miss is at a partner: the seeder is done with us and no pipeline grows any
    more (always so once one holds every chunk: the drain), so every stripe is helped."""
    wanted = sched.full & ~sched.have
    return bool(wanted) and not wanted & ~held_by(sched.links)


def help_mask(sched) -> tuple[int, int]:
    """Chunks partners may be asked for, and the subset whose planned source is gone (the seeder
    may serve those too); sets ``sched.ending`` and ``sched.movable`` (requests to move)."""
    mask = orphaned = sched.movable = 0
    sched.ending = end_phase(sched)
    for s, rank in enumerate(sched.plan):
        missing = sched.in_stripe[s] & ~sched.have
        why = lag(sched, s)
        if why == GONE:
            orphaned |= missing & ~sched.inflight
        src = sched.links.get(rank) if rank is not None else None
        if src is not None and src.ready:
            moved = stuck(sched, src) | (parked(sched, src) if why in SLOW_REASONS else 0)
            mask |= moved
            sched.movable |= moved
        if why or sched.ending:
            mask |= missing & ~sched.inflight
    return mask & ~sched.have, orphaned


# ----- who -------------------------------------------------------------------

def cost(sched, lk: Link, typical: float) -> tuple[bool, int]:
    """What asking ``lk`` for help costs the fleet, cheapest first: whether it is slow (the tracker
    demoted it, or its link delivers below ``SLOW_HELPER`` of the ``typical`` link's rate: one
    carrying many flows; a request there waits seconds), then the peers its uplink feeds beyond its
    children (``downstream``), none once it holds every chunk (its children then keep up with it)."""
    slow = lk.rank in sched.slow or (not lk.complete and 0 < lk.rate < SLOW_HELPER * typical)  # a complete
    #   one's rate was measured while it forwarded: the tracker's word alone judges it now
    return slow, 0 if lk.complete else sched.downstream.get(lk.rank, 0)


def eta(lk: Link, typical: float) -> float:
    """When ``lk`` would deliver one more chunk asked of it now: the chunks it would have outstanding over its
    rate (seconds per byte of a chunk; only ever compared with another link's)."""
    rate = lk.rate or typical
    return (len(lk.outstanding) + 1) / rate if rate > 0 else 0.0


def cheapest(sched, links: list[Link], wanted: int, typical: float) -> tuple[bool, int]:
    """The lowest ``cost`` of the ``links`` that can be asked now (the seeder aside) and hold some
    ``wanted`` chunk: only partners that cheap help or share, so no stripe's root gives its
    children's uplink away and no slow uplink is asked while a fast one holds the chunks.  A
    partner with no credit free (a planned source whose window waits on chunks it lacks) does not
    set the bar: it would shut every other holder out."""
    return min((cost(sched, lk, typical) for lk in links
                if lk.free() and lk.rank != SEEDER and wanted & lk.holds), default=(False, 0))


def cheapest_first(sched, links: list[Link], typical: float) -> list[Link]:
    """``links`` cheapest first (``cost``), and among equals the soonest to deliver one more chunk
    (``eta``: an idle fast partner before a busy one), ties in random order so requesters spread."""
    return sorted(sched.rng.sample(links, len(links)), key=lambda lk: (cost(sched, lk, typical), eta(lk, typical)))


def helpers(sched, ready: list[Link], lagging: int, typical: float) -> list[Link]:
    """Who may help with ``lagging``, in random order: the cheapest holders feeding at most
    ``HELP_DOWNSTREAM`` peers; in the end phase any as fast as the cheapest, and the seeder if lent."""
    bar = cheapest(sched, ready, lagging & sched.avail, typical)  # among holders of what is still to ask
    return [lk for lk in sched.rng.sample(ready, len(ready))  # random: ``min`` keeps the first of equals
            if lk.rank != SEEDER and ((c := cost(sched, lk, typical)) <= bar and c[1] <= HELP_DOWNSTREAM
                                      or sched.ending and c[0] <= bar[0])
            or lk.rank == SEEDER and sched.ending and sched.seeder_lent]  # lent: its uplink idles otherwise


# ----- how many --------------------------------------------------------------

def budget(sched, cands: list[Link], helping: dict[int, int]) -> int:
    """Help requests to add now: ``HELP_WINDOW`` per planned source (twice for a demoted one) less
    those in flight; ``HELP_WINDOW`` from each candidate where a planned source is demoted (its
    quarter-rate spare slot gives its stripe at half the others' pace: the peer so fed finished last,
    two helpers at two requests while finished hosts idled); in the end phase every candidate's free
    window besides (the last peers took their backlog from one source while finished ones waited)."""
    planned = set(sched.plan)
    n = HELP_WINDOW * (max(1, len(planned)) + len(planned & sched.slow)) - sum(helping.values())
    if planned & sched.slow:
        n = max(n, HELP_WINDOW * len(cands) - sum(helping[lk.rank] for lk in cands))
    if sched.ending:
        n += sum(lk.free() for lk in cands)
    return n


def help_lagging(sched, ready: list[Link], lagging: int, typical: float, out: dict) -> None:
    """Rule 3: each chunk of help to the candidate soonest to deliver it, rarest first among the lowest
    ``lagging`` chunks it holds, at most ``HELP_WINDOW`` per link (its free window in the end phase)."""
    helping = {r: lk.helping_now() for r, lk in sched.links.items()}  # in flight
    cands = helpers(sched, ready, lagging, typical)
    left = budget(sched, cands, helping)
    while left > 0 and cands:
        lk = min(cands, key=lambda x: eta(x, typical))  # all as cheap: the soonest to deliver
        cap = lk.free() if sched.ending else min(lk.free(), HELP_WINDOW - helping[lk.rank])
        chunks = sched.pick(lk, lagging & lk.holds, min(cap, 1), rarest=True)
        if not chunks:
            cands.remove(lk)
            continue
        lk.helping.add(chunks[0])
        helping[lk.rank] += 1
        left -= 1
        sched.ask(lk, chunks, out)
