"""Where a forest's next move is, without a scan of every peer (``topology.Forest``'s indexes).

``Forest`` asks, on every join, where the shallowest free slot is, which leaf
sits shallower than some forwarder, who is over its slots and who has no
planned source.  Scanning every peer for each made 10,000 joins cost the
seeder's loop 105 s of CPU (3 s now, ``bench/placement.py``).  ``SlotIndex`` keeps, per stripe,
the candidates for each question, brought up to date for one rank at a time
(``update``, called by the forest wherever a rank's children, depth, group,
lent or spare slot changes).  A candidate set may hold a rank that no longer
qualifies (the forest checks each answer), never miss one that does; the
depth-ordered ones also hold each rank's current depth, and a subtree's
counts (``size``) let ``Forest.downstream`` answer without walking it.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

UNPLACED = 1 << 20  # the depth of a peer without a planned source in a stripe
MISSING = object()


class Ranked:
    """Ranks in the order of a key that changes: a sorted list plus each rank's current key."""

    __slots__ = ("keys", "key_of")

    def __init__(self):
        self.keys: list[tuple] = []
        self.key_of: dict[int, tuple] = {}

    def put(self, rank: int, key: tuple) -> None:
        old = self.key_of.get(rank)
        if old == key:
            return
        if old is not None:
            del self.keys[bisect_left(self.keys, old)]
        insort(self.keys, key)
        self.key_of[rank] = key

    def discard(self, rank: int) -> None:
        old = self.key_of.pop(rank, None)
        if old is not None:
            del self.keys[bisect_left(self.keys, old)]

    def after(self, key: tuple):
        """The keys greater than ``key``, in order (the list may not change meanwhile)."""
        keys = self.keys
        return (keys[i] for i in range(bisect_right(keys, key), len(keys)))


class SlotIndex:
    """Per stripe: forwarders and leaves by depth, parents with a free slot or over their slots,
    peers without a planned source (or under a demoted host's spare slot), and subtree sizes."""

    def __init__(self, k: int):
        self.k = k
        self.inner = [Ranked() for _ in range(k)]  # key (depth, rank): interior in s, with slots
        self.leaves = [Ranked() for _ in range(k)]  # key (depth, -rank): no child, not interior in s
        self.open = [set() for _ in range(k)]  # may take one more child in s
        self.over = [set() for _ in range(k)]  # more children in s than slots
        self.unplaced = [set() for _ in range(k)]  # no parent in s, or a demoted host's spare slot
        self.attached = [{} for _ in range(k)]  # rank -> when it was last attached in s (a counter)
        self.size = [{0: 1} for _ in range(k)]  # rank -> peers in its subtree in s, itself included
        self.cap = [{} for _ in range(k)]  # rank -> its child slots in s
        self.slots = [0] * k  # child slots in s, in all
        self.demoted: set[int] = set()  # leaves everywhere (slots 0)
        self.idle: set[int] = set()  # demoted, and feeding nobody
        self.members = [0] * k  # forwarders per group
        self.group_of: dict[int, int | None] = {}
        self._ticks = 0

    def update(self, f, rank: int) -> None:
        """Bring ``rank``'s entries in line with forest ``f``."""
        g = f.group.get(rank)
        old = self.group_of.get(rank, MISSING)
        if old != g:
            if old is not MISSING and old is not None:
                self.members[old] -= 1
            if rank in f.group:
                self.group_of[rank] = g
                if g is not None:
                    self.members[g] += 1
            else:
                self.group_of.pop(rank, None)
        demoted = rank != 0 and rank in f.group and g is None and f.slots.get(rank) == 0
        _flag(self.demoted, rank, demoted)
        _flag(self.idle, rank, demoted and not any(f.kids[x].get(rank) for x in range(self.k)))
        for s in range(self.k):
            kids = f.kids[s].get(rank)
            placed = kids is not None
            interior = rank != 0 and (g == s or f.lent.get(rank) == s)
            depth = f.depth[s].get(rank, UNPLACED)
            parent = f.parent[s].get(rank, MISSING)
            _keep(self.inner[s], rank, (depth, rank), placed and interior and bool(f.slots.get(rank)))
            _keep(self.leaves[s], rank, (depth, -rank),
                  placed and rank != 0 and not kids and not interior and parent not in f.spare)
            cap = f.capacity(rank, s) if placed else 0
            self.slots[s] += cap - self.cap[s].get(rank, 0)
            self.cap[s][rank] = cap
            _flag(self.open[s], rank, placed and (rank == 0 or interior) and len(kids) < cap)
            _flag(self.over[s], rank, placed and bool(kids) and len(kids) > cap)
            _flag(self.unplaced[s], rank, parent is not MISSING and (parent is None or parent in f.spare))

    def attach(self, f, rank: int, s: int) -> None:
        """``rank`` (with its subtree) was just attached in stripe ``s``: count it up to the root."""
        self._ticks += 1
        self.attached[s][rank] = self._ticks
        self._carry(f, rank, s, self.size[s].setdefault(rank, 1))

    def detach(self, f, rank: int, s: int, parent) -> None:
        """``rank`` (with its subtree) left ``parent`` in stripe ``s``."""
        self._carry(f, parent, s, -self.size[s].get(rank, 1), start=True)

    def forget(self, rank: int) -> None:
        for s in range(self.k):
            self.size[s].pop(rank, None)
            self.attached[s].pop(rank, None)
            self.cap[s].pop(rank, None)

    def _carry(self, f, rank, s: int, n: int, start: bool = False) -> None:
        """Add ``n`` to the sizes of ``rank``'s ancestors in ``s`` (and of ``rank``, if ``start``)."""
        size, parent = self.size[s], f.parent[s]
        r = rank if start else parent.get(rank)
        seen = 0
        while r is not None and seen <= len(size):
            size[r] = size.get(r, 1) + n
            r = parent.get(r) if r != 0 else None
            seen += 1

    def free(self, f, s: int) -> list[int]:
        """The parents with a slot free in stripe ``s``: the seeder, its group, lenders."""
        kids, group, lent = f.kids[s], f.group, f.lent
        return [r for r in self.open[s] if r in kids and (group.get(r) == s or lent.get(r) == s or not r)
                and len(kids[r]) < f.capacity(r, s)]

    def unparented(self, f, s: int) -> list[int]:
        """The peers without a parent in stripe ``s``."""
        return [r for r in self.unplaced[s] if f.parent[s].get(r, MISSING) is None]

    def first_unplaced(self, f, s: int):
        """The peer without a parent in ``s`` attached longest ago (None if none)."""
        return min(self.unparented(f, s), key=lambda r: self.attached[s].get(r, 0), default=None)


def _keep(index: Ranked, rank: int, key: tuple, present: bool) -> None:
    if present:
        index.put(rank, key)
    else:
        index.discard(rank)


def _flag(members: set, rank: int, present: bool) -> None:
    if present:
        members.add(rank)
    else:
        members.discard(rank)
