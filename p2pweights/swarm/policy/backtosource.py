"""Back to source: what an origin reader reads while its tracker is away (pure, clock injected).

With the tracker up, it hands each reader a share of the chunks nobody holds
(``tracker.shares``).  With it away (silent for ``AWAY_AFTER``), a member that
can read the origin reads what no live partner holds itself, by three rules:

1. the split: the chunks are cut into blocks of ``BLOCK``, dealt in turn to the
   readers this member knows (itself and its live partners, by rank: a plan
   sent before a partner said it reads the origin cannot tell), each reading
   its own blocks, so the origin is still read about once in all;
2. the takeover: a reader whose blocks gained no chunk held by us or a live
   partner for ``STUCK_AFTER`` s (it cannot read the origin, or reads nothing)
   is stuck; its blocks are dealt again among the others (a gone link is no
   reader at all);
3. once: a chunk is asked of the origin at most once per host, by a share or
   back to source, unless its read failed.

Nothing is read while the tracker speaks: its shares rule then.
"""
from __future__ import annotations

import time

from ...wire.chunkset import indices_of

AWAY_AFTER = 5.0  # seconds the tracker may be silent (it heartbeats every 0.5 s) before readers go back to source
#                  (ten beats: a tracker slowed by a busy host does not cost the origin a second read)
STUCK_AFTER = 5.0  # seconds a reader's blocks may gain nothing before the others read them
BLOCK = 8  # consecutive chunks dealt to one reader (a few ranged GETs' worth)


def tracker_away(heard: float, now: float, tracker_timeout: float) -> bool:
    """Whether a tracker last heard at ``heard`` is away: silent ``AWAY_AFTER`` s (or its timeout, if shorter)."""
    return now - heard > min(AWAY_AFTER, tracker_timeout)


class BackToSource:
    """The chunks one origin reader reads while its tracker is away; ``asked``: bit i once chunk i was asked."""

    def __init__(self, n_chunks: int, clock=time.monotonic, block: int = BLOCK, stuck_after: float = STUCK_AFTER):
        self.n, self.clock, self.block, self.stuck_after = n_chunks, clock, block, stuck_after
        self.asked = 0
        self.gained: dict[int, tuple[int, float]] = {}  # reader rank -> (its blocks' chunks held, when that grew)
        self._masks: tuple[tuple, dict[int, int]] = ((), {})  # the split of the last readers: rank -> its bitset

    def first_asks(self, chunks) -> list[int]:
        """Of ``chunks`` (a tracker's share), those not asked of the origin before, now asked (rule 3)."""
        out = [i for i in dict.fromkeys(chunks) if not self.asked >> i & 1]
        for i in out:
            self.asked |= 1 << i
        return out

    def failed(self, index: int) -> None:
        """Chunk ``index`` could not be read (or did not match): it may be asked again (a share)."""
        self.asked &= ~(1 << index)

    def split(self, ranks: tuple) -> dict[int, int]:
        """Rule 1: reader rank -> the bitset of its blocks (block k to ``ranks[k % len(ranks)]``)."""
        if self._masks[0] != ranks:
            m, full = len(ranks), (1 << self.n) - 1
            unit = self.block * m
            self._masks = ranks, {r: _every(self.n, unit, p * self.block, self.block) & full
                                  for p, r in enumerate(ranks)}
        return self._masks[1]

    def reads(self, me: int, readers, known: int) -> list[int]:
        """Chunks ``me`` asks of the origin now, lowest first; ``readers``: the other readers it knows with a
        live link; ``known``: bitset of the chunks held by us or a live partner."""
        now = self.clock()
        ranks = tuple(sorted({me, *readers}))
        masks = self.split(ranks)
        stuck = []
        for r in ranks:
            if r == me:
                continue
            held = (known & masks[r]).bit_count()
            before = self.gained.get(r)
            if before is None or held > before[0]:
                self.gained[r] = before = (held, now)
            if now - before[1] > self.stuck_after and masks[r] & ~known:
                stuck.append(r)
        self.gained = {r: v for r, v in self.gained.items() if r in masks}
        live = [r for r in ranks if r not in stuck]
        mine = masks[me]
        for r in stuck:  # rule 2: its blocks dealt again among the live readers
            for k in range(ranks.index(r), -(-self.n // self.block), len(ranks)):
                if live[k % len(live)] == me:
                    mine |= ((1 << self.block) - 1) << (k * self.block)
        todo = mine & ~known & ~self.asked & ((1 << self.n) - 1)
        self.asked |= todo
        return indices_of(todo)


def _every(n: int, period: int, start: int, width: int) -> int:
    """Bits ``start`` .. ``start + width`` - 1 of every ``period`` bits, below bit ``n``."""
    unit = "0" * start + "1" * width + "0" * (period - start - width)  # lowest bit first
    text = (unit * (n // period + 1))[:n]
    return int(text[::-1], 2) if text else 0
