"""Topology: pure rules that place peer ranks in the distribution tree(s).

Rank 0 is the seeder (the root of every tree); peers get ranks 1, 2, 3, ... in
join order.  A topology has ``stripes`` trees; chunk ``i`` travels down tree
``i % stripes``.  ``parents(rank)`` gives one parent rank per stripe and must
never change when later ranks join (N is not known in advance), and every
parent is an earlier rank (so it has already joined and the trees have no
cycles).  ``live_parent`` re-attaches a peer whose parent is gone by walking up
to the nearest live ancestor.

The rules (``r`` is a peer rank, ``k`` a parameter):

* ``binomial``  parent = ``r`` with its highest set bit cleared; the seeder has
  about log2(N+1) children, so its uplink carries that many copies.
* ``chain``     parent = ``r - 1``: every uplink carries one copy; depth N, so
  the pipeline fill costs N-1 chunk-times.
* ``kary:k``    heap: parent = ``(r - 1) // k``; the seeder has ``k`` children,
  every interior peer uploads ``k`` copies; depth about log_k(N).
* ``striped:k`` k stripe trees (SplitStream-like, see :class:`Striped`): every
  peer is interior in at most one stripe tree, so it uploads about one copy.
* ``star``      parent = 0 for everyone (no forwarding): the baseline.
* ``forest:k``  k interior-disjoint stripe trees placed as peers join (see
  :class:`Forest`): every uplink carries about one copy, the seeder exactly
  one, depth about log_k(N); slow hosts are leaves.  The default.

The rule-based plans above are pure functions of the rank; ``Forest`` keeps
the state of its placement (who has free slots where) and is changed only
through its verbs (``place``, ``remove``, ``demote``), each returning the moves
the tracker must announce.

``auto(n_expected)`` picks one of them for a fleet size (see its docstring).
No sockets here: the tracker applies these rules, the simulator predicts them.
"""
from __future__ import annotations

import math
from collections import deque

from ...errors import UserError
from .slotindex import UNPLACED, SlotIndex


class PlanError(UserError, ValueError):
    """A plan (topology) name or parameter that does not exist."""


class Binomial:
    """Binomial tree: a rank's parent is the rank with its highest set bit cleared."""

    name = "binomial"
    stripes = 1

    def parents(self, rank: int) -> list[int]:
        _check_rank(rank)
        return [rank & ~(1 << (rank.bit_length() - 1))]


class Chain:
    """Chain: rank r's parent is r - 1 (one copy per uplink, depth N)."""

    name = "chain"
    stripes = 1

    def parents(self, rank: int) -> list[int]:
        _check_rank(rank)
        return [rank - 1]


class Star:
    """Star: every peer's parent is the seeder, nobody forwards (the benchmark baseline)."""

    name = "star"
    stripes = 1

    def parents(self, rank: int) -> list[int]:
        _check_rank(rank)
        return [0]


class KAry:
    """k-ary heap: rank r's parent is (r - 1) // k; the seeder has children 1..k."""

    stripes = 1

    def __init__(self, k: int = 2):
        self.k = _check_k(k, "kary")
        self.name = f"kary:{self.k}"

    def parents(self, rank: int) -> list[int]:
        _check_rank(rank)
        return [(rank - 1) // self.k]


class Striped:
    """k stripe trees, every peer interior in at most one of them (SplitStream-like).

    Peers are dealt round-robin into k groups: rank r is in group
    ``g = (r - 1) % k`` and round ``m = (r - 1) // k`` (each round holds one
    member of every group).  In stripe tree ``s``:

    * the members of group ``s`` ("heads"; the head of round m is rank
      ``m*k + s + 1``) are the interior nodes, linked as a binary heap: head m's
      parent is head ``(m - 1) // 2``, head 0's parent is the seeder;
    * every other peer is a leaf under the most recent head that joined before
      it: its own round's head if that head joined earlier (g > s), else the
      previous round's head (g < s), or the seeder in round 0.

    So a head has k - 1 leaf children plus at most 2 head children in its own
    stripe and nothing in the others: it uploads at most (k + 1)/k copies of
    the model; a stripe tree is 2 + log2(N/k) deep.  The seeder has 1 + s
    children in stripe s (head 0 and the round-0 peers that joined before it),
    (k + 1)/2 copies in all, whatever N is: the first k peers can only get
    a stripe whose head has not joined yet from the seeder, so (k + 1)/2 is the
    least any stable rule with one interior tree per peer can do.
    Re-parenting by walking up the ancestors keeps the rule: the ancestors of
    anyone in stripe s are heads of s (or the seeder).
    """

    def __init__(self, k: int = 2):
        self.k = self.stripes = _check_k(k, "striped")
        self.name = f"striped:{self.k}"

    def group(self, rank: int) -> int:
        """The stripe in which ``rank`` is interior (may forward chunks)."""
        _check_rank(rank)
        return (rank - 1) % self.k

    def head(self, stripe: int, m: int) -> int:
        """Rank of the ``m``-th member of group ``stripe``."""
        return m * self.k + stripe + 1

    def parents(self, rank: int) -> list[int]:
        _check_rank(rank)
        k = self.k
        m, g = divmod(rank - 1, k)
        out = []
        for s in range(k):
            if g == s:
                out.append(0 if m == 0 else self.head(s, (m - 1) // 2))
            elif g > s:
                out.append(self.head(s, m))
            else:
                out.append(0 if m == 0 else self.head(s, m - 1))
        return out

    def adopts(self, rank: int) -> list[tuple[int, int]]:
        """``(child, stripe)`` pairs that the tracker re-parents to ``rank`` when it joins.

        ``rank`` is the head of its round in stripe ``g``; the peers of the same
        round that joined before it (groups < g) had to take stripe g from the
        previous round's head (or the seeder in round 0).  Moving them under
        their own round's head makes the seeder send one copy in all (instead
        of (k + 1)/2) and leaves every head with k - 1 leaf children, as before.
        """
        m, g = divmod(rank - 1, self.k)
        return [(self.head(s, m), g) for s in range(g)]

    def settled_parents(self, rank: int, n: int) -> list[int]:
        """``parents(rank)`` once ranks 1..n have joined and every adoption happened."""
        out = self.parents(rank)
        m, g = divmod(rank - 1, self.k)
        for s in range(g + 1, self.k):
            if self.head(s, m) <= n:
                out[s] = self.head(s, m)
        return out


class Forest:
    """k stripe trees in which every peer is interior in at most one (SplitStream), placed greedily.

    A peer joins group ``g``, the group with the fewest members, and is interior only in stripe
    tree ``g``, with ``k * share`` child slots (``share``: its uplink over the fleet's, 1 unless
    the tracker knows better), so its uplink carries about one copy.  The seeder has one slot per
    stripe: it sends each chunk once.  In every stripe a newcomer takes the shallowest free slot;
    where none is free, the least loaded one.  A group member that joins adopts leaves from
    overloaded parents of its stripe (``place`` returns the moves).  ``demote`` makes a slow host
    a leaf everywhere; ``remove`` re-places a departed peer's children.  When a stripe has a peer
    no slot serves while another has a slot free (a demotion leaves groups of 4 and 3), a
    forwarder with a free slot lends it to that stripe, still one copy in all (``lent``).  Where
    none can lend, a demoted host serves one such peer there (``spare``): its quarter-rate uplink
    carries half a stripe, the peer's partners help with the rest.  Only a leaf of that stripe is
    placed under it.
    """

    def __init__(self, k: int = 2):
        self.k = self.stripes = _check_k(k, "forest")
        self.name = f"forest:{self.k}"
        self.group: dict[int, int | None] = {}  # rank -> stripe it is interior in (None: leaf everywhere)
        self.slots: dict[int, int] = {0: 1}  # rank -> child slots in its interior stripe
        self.lent: dict[int, int] = {}  # rank -> the stripe one of its slots serves (see the class doc)
        self.spare: dict[int, int] = {}  # demoted rank -> the stripe in which it serves one leaf
        self.parent: list[dict[int, int]] = [{} for _ in range(self.k)]  # per stripe: rank -> parent
        self.kids: list[dict[int, set]] = [{0: set()} for _ in range(self.k)]
        self.depth: list[dict[int, int]] = [{0: 0} for _ in range(self.k)]
        self.index = SlotIndex(self.k)  # what the verbs look up instead of scanning every peer
        self.index.update(self, 0)

    # ----- queries -----------------------------------------------------------

    def parents(self, rank: int) -> list[int]:
        _check_rank(rank)
        return [self.parent[s][rank] for s in range(self.k)]

    def interior_in(self, rank: int, stripe: int) -> bool:
        return rank == 0 or self.group.get(rank) == stripe or self.lent.get(rank) == stripe

    def load(self, rank: int, stripe: int) -> int:
        return len(self.kids[stripe].get(rank, ()))

    def feeds(self, rank: int) -> bool:
        """Whether ``rank`` is a planned parent in any stripe."""
        return any(self.kids[s].get(rank) for s in range(self.k))

    def capacity(self, rank: int, stripe: int) -> int:
        slots, lent = self.slots.get(rank, 0), self.lent.get(rank)
        if rank == 0:
            return slots
        if rank in self.spare:
            return 1 if stripe == self.spare[rank] else 0
        if stripe == self.group.get(rank):
            return slots - (lent is not None)
        return 1 if stripe == lent else 0

    def downstream(self, rank: int) -> int:
        """Peers that get a stripe through ``rank``'s children (its descendants below them, in every
        stripe): whom a slower uplink at ``rank`` holds back besides its own children."""
        size = self.index.size
        return sum(size[s][c] - 1 for s in range(self.k) for c in self.kids[s].get(rank, ()))

    # ----- verbs -------------------------------------------------------------

    def place(self, rank: int, share: float = 1.0) -> list[tuple[int, int]]:
        """Place newcomer ``rank``; returns the ``(rank, stripe)`` moves of others this caused."""
        _check_rank(rank)
        if rank in self.group:
            raise ValueError(f"rank {rank} is placed already")
        slots = max(0, round(self.k * share))
        members = self.index.members
        self.group[rank] = min(range(self.k), key=lambda s: (members[s], s)) if slots else None
        self.slots[rank] = slots
        self.index.update(self, rank)
        for s in range(self.k):
            self.kids[s][rank] = set()
            self._attach(rank, s, self._best_parent(s, exclude={rank}))
        return self._settle()

    def remove(self, rank: int) -> list[tuple[int, int]]:
        """``rank`` is gone: re-place its children; returns the ``(child, stripe)`` moves."""
        if rank not in self.group:
            return []
        moves = []
        for s in range(self.k):
            self._detach(rank, s)
            self.depth[s].pop(rank)
            for c in sorted(self.kids[s].pop(rank)):
                del self.parent[s][c]
                moves.append(self._move(c, s))
        del self.group[rank], self.slots[rank]
        self.lent.pop(rank, None)
        self.spare.pop(rank, None)
        self.index.update(self, rank)
        self.index.forget(rank)
        return _unique(moves + self._balance_groups() + self._settle())

    def demote(self, rank: int) -> list[tuple[int, int]]:
        """``rank``'s uplink is too slow to forward: make it a leaf everywhere; returns the moves."""
        g = self.group.get(rank)
        if g is None or rank not in self.group:
            return []
        self.group[rank], self.slots[rank] = None, 0
        self.index.update(self, rank)
        moves = [self._move(c, g) for c in sorted(self.kids[g][rank])]
        moves += [m for r in sorted(self.lent) for m in self._unlend(r)]  # lent for the old shape:
        return _unique(moves + self._balance_groups() + self._settle())  # lent again where now needed

    def _balance_groups(self) -> list[tuple[int, int]]:
        """Keep the groups' forwarder counts within one of each other (after a demotion or a
        departure): the forwarder with the fewest children in the largest group changes stripe."""
        moves = []
        while True:
            count = self.index.members
            big, small = max(range(self.k), key=count.__getitem__), min(range(self.k), key=count.__getitem__)
            if count[big] - count[small] < 2:
                return moves
            r = min((r for r, g in self.group.items() if g == big),
                    key=lambda r: (self.load(r, big), -self.depth[big][r], -r))
            moves.extend(self._unlend(r))
            self.group[r] = small
            self.index.update(self, r)
            moves.extend(self._move(c, big) for c in sorted(self.kids[big][r]))
            if self.parent[small].get(r) in self.spare:  # a forwarder now: not under a slow uplink
                moves.append(self._move(r, small))

    def move(self, rank: int, stripe: int, avoid: int) -> tuple[int, int]:
        """``rank`` gives up its parent ``avoid`` in ``stripe`` (bad chunks): the best other parent."""
        exclude = self._subtree(rank, stripe) | {avoid}
        self._detach(rank, stripe)
        self._attach(rank, stripe, self._best_parent(stripe, exclude))
        return rank, stripe

    # ----- internals ---------------------------------------------------------

    def _attach(self, rank: int, s: int, parent: int | None) -> None:
        """``rank`` pulls stripe ``s`` from ``parent``; None: from no planned source (every slot is
        taken: its partners share the stripe until a slot frees up)."""
        self.parent[s][rank] = parent
        self.index.attach(self, rank, s)
        if parent is None:
            self._set_depth(rank, s, UNPLACED)
            return
        self.kids[s][parent].add(rank)
        self.index.update(self, parent)
        self._set_depth(rank, s, self.depth[s][parent] + 1)

    def _detach(self, rank: int, s: int) -> None:
        parent = self.parent[s].pop(rank)
        if parent is not None:
            self.kids[s][parent].discard(rank)
            self.index.detach(self, rank, s, parent)
            self.index.update(self, parent)
        self.index.update(self, rank)

    def _move(self, rank: int, s: int, to: int | None = None) -> tuple[int, int]:
        """Re-attach ``rank`` (with its subtree) in stripe ``s``: under ``to``, else the best parent."""
        if rank in self.parent[s]:
            self._detach(rank, s)
        self._attach(rank, s, to if to is not None else self._best_parent(s, exclude=self._subtree(rank, s)))
        return rank, s

    def _set_depth(self, rank: int, s: int, d: int) -> None:
        todo = [(rank, d)]
        while todo:
            r, d = todo.pop()
            self.depth[s][r] = d
            self.index.update(self, r)
            todo.extend((c, d + 1) for c in self.kids[s].get(r, ()))

    def _subtree(self, rank: int, s: int) -> set[int]:
        out, todo = set(), [rank]
        while todo:
            r = todo.pop()
            out.add(r)
            todo.extend(self.kids[s].get(r, ()))
        return out

    def _best_parent(self, s: int, exclude: set) -> int | None:
        """The shallowest placed parent with a free slot in stripe ``s``; None when every slot is
        taken (nobody is overloaded: the uplinks are balanced, partners carry the rest)."""
        depth = self.depth[s]
        cands = [r for r in self.index.free(self, s) if depth.get(r, UNPLACED) < UNPLACED and r not in exclude]
        return min(cands, key=lambda r: (depth[r], r), default=None)

    def _settle(self) -> list[tuple[int, int]]:
        """Restore the invariants after a change; returns the moves.

        In every stripe: no leaf sits shallower than a forwarder (they swap
        places), and no parent is over its slots while another has one free."""
        moves = []
        for s in range(self.k):
            for _ in range(4 * len(self.kids[s])):  # each step strictly improves; bound it anyway
                step = _end_loan(self, s) or self._swap_up(s) or self._unload(s) or self._place_unplaced(s) \
                    or self._lend(s) or _lend_spare(self, s)
                if not step:
                    break
                moves.extend(step)
        return _unique(moves)

    def _swap_up(self, s: int) -> list[tuple[int, int]]:
        """A forwarder deeper than a leaf of stripe ``s`` trades places with it; one with no planned
        source there takes the slot of a demoted host serving a spare leaf (placed again): else a
        slow first joiner, demoted before the fleet came, kept the seeder's slot in ``s``."""
        kids, parent, group, lent, index = self.kids[s], self.parent[s], self.group, self.lent, self.index

        def inner(r):
            return r in kids and (group.get(r) == s or lent.get(r) == s) and self.slots.get(r)

        def leaf_(r):  # a demoted host's slot takes no forwarder
            return r in kids and not kids[r] and group.get(r) != s and lent.get(r) != s and \
                parent.get(r) not in self.spare
        leaf = next((-r for _, r in index.leaves[s].after((-1, 0)) if leaf_(-r)), None)
        deep = None if leaf is None else \
            next((r for _, r in index.inner[s].after((self.depth[s][leaf], math.inf)) if inner(r)), None)
        moves = []
        if deep is None:
            if s not in self.spare.values():
                return []  # no demoted host's slot to take
            deep = next((r for d, r in index.inner[s].after((UNPLACED - 1, math.inf)) if d == UNPLACED and inner(r)
                         and self.parent[s][r] is None), None)  # the lowest rank: (UNPLACED, r) come first
            if deep is None:
                return []
            below = self._subtree(deep, s)  # never under it: no cycle
            leaf = min((r for r, g in self.spare.items() if g == s and r not in below
                        and self.depth[s].get(r, UNPLACED) < UNPLACED), key=lambda r: (self.depth[s][r], r), default=None)
            if leaf is None:
                return []
            del self.spare[leaf]
            self.index.update(self, leaf)
            for c in sorted(self.kids[s][leaf]):
                self._detach(c, s)
                self._attach(c, s, None)
                moves.append((c, s))
        up, down = self.parent[s][leaf], self.parent[s][deep]
        self._detach(leaf, s)
        self._detach(deep, s)
        self._attach(deep, s, up)
        self._attach(leaf, s, down if down != leaf else deep)
        return moves + [(deep, s), (leaf, s)]

    def _place_unplaced(self, s: int) -> list[tuple[int, int]]:
        """A peer without a planned source in stripe ``s`` (or under a demoted host's spare slot)
        takes a forwarder's slot that freed up."""
        parent = self.parent[s]
        if self._best_parent(s, exclude=set()) is None:
            return []  # no slot free anywhere: nobody can be placed
        for r in sorted((r for r in self.index.unplaced[s] if r in parent and (parent[r] is None or parent[r] in
                         self.spare)), key=lambda r: (parent[r] is not None, not self.interior_in(r, s), r)):
            dst = self._best_parent(s, exclude=self._subtree(r, s))
            if dst is not None:
                return [self._move(r, s, to=dst)]
        return []

    def _lend(self, s: int) -> list[tuple[int, int]]:
        """A peer in stripe ``s`` has no slot and none is free there: a forwarder of another stripe
        with a slot free lends it to ``s`` (the shallowest in ``s``, outside that peer's subtree)."""
        first = self.index.first_unplaced(self, s)
        if first is None:
            return []
        room = [self.index.slots[g] - len(self.parent[g]) for g in range(self.k)]  # a slot per receiver stays
        free = [r for g in range(self.k) if g != s and room[g] > 0 for r in self.index.free(self, g) if r]
        if not free:  # nobody has a slot to lend
            return []
        mine = self._subtree(first, s)
        cands = [r for r in free if (g := self.group.get(r)) is not None and g != s and room[g] > 0
                 and r not in self.lent and r not in mine and self.slots[r] >= 2  # ``free``: a slot in g
                 and self.depth[s].get(r, UNPLACED) < UNPLACED
                 and self.parent[s].get(r) not in self.spare]
        if not cands:
            return []
        r = min(cands, key=lambda r: (self.depth[s][r], r))
        self.lent[r] = s
        self.index.update(self, r)
        return [(r, s)]

    def _unlend(self, rank: int) -> list[tuple[int, int]]:
        """``rank`` takes its lent slot back; the child it served there is placed again."""
        s = self.lent.pop(rank, None)
        self.index.update(self, rank)
        return [] if s is None else [self._move(c, s) for c in sorted(self.kids[s][rank])]

    def _unload(self, s: int) -> list[tuple[int, int]]:
        kids = self.kids[s]
        over = [r for r in self.index.over[s] if kids.get(r) and len(kids[r]) > self.capacity(r, s)]
        if not over:  # the usual case: no sort of the free slots
            return []
        free = sorted((r for r in self.index.free(self, s) if r not in self.spare), key=lambda r: (self.depth[s][r], r))
        for src in sorted(over, key=lambda r: (r != 0, r)):
            for child in sorted(self.kids[s][src], key=lambda c: (bool(self.kids[s][c]), -c)):
                subtree = self._subtree(child, s)
                dst = next((r for r in free if r not in subtree), None)
                if dst is not None and (src == 0 or self.depth[s][dst] <= self.depth[s][src] + 1):
                    return [self._move(child, s, to=dst)]
                if dst is None and not self.kids[s][child]:  # no slot: it pulls from partners instead
                    self._detach(child, s)
                    self._attach(child, s, None)
                    return [(child, s)]
        return []


def _end_loan(f: Forest, s: int) -> list[tuple[int, int]]:
    """``Forest._settle``'s first step: a forwarder lent to stripe ``s`` above one of the stripe's own
    members takes its slot back (it is a leaf of ``s`` then, and ``_swap_up`` puts the member in its
    place).  Else the first joiner, lent a stripe before that stripe's member came, kept the seeder's
    slot there: the seeder sent two stripes down one connection at one child's share of its uplink
    (forest:8 at N = 8, 1.39)."""
    for r in sorted((r for r, g in f.lent.items() if g == s), key=lambda r: (f.depth[s][r], r)):
        if any(f.group.get(m) == s for _, m in f.index.inner[s].after((f.depth[s][r], math.inf))):
            return f._unlend(r)
    return []


def _lend_spare(f: Forest, s: int) -> list[tuple[int, int]]:
    """``Forest._settle``'s last step: a leaf of stripe ``s`` without a planned source goes under a
    demoted host with no child (the shallowest in ``s``): its uplink is slow, but better than none
    in the plan.  Where that leaf is the only such host, it trades places with a demoted host that
    holds a forwarder's slot in ``s`` and serves it there: two slow hosts feed each other."""
    def demoted(r):
        return r != 0 and f.group.get(r) is None and f.slots.get(r) == 0

    def idle(r):
        return demoted(r) and not any(f.kids[x].get(r) for x in range(f.k))

    def fed_by_forwarder(r):
        return f.parent[s].get(r) is not None and f.parent[s][r] not in f.spare

    leaves = [r for r in f.index.unparented(f, s) if not f.interior_in(r, s) and not f.kids[s][r]]
    if not leaves:
        return []
    leaf = min(leaves, key=lambda r: (idle(r), r))  # keep idle demoted hosts free to serve
    servers = [r for r in f.index.idle if r in f.kids[s] and r != leaf and idle(r) and fed_by_forwarder(r)]
    if servers:
        d = min(servers, key=lambda r: (f.depth[s][r], r))
        f.spare[d] = s
        f.index.update(f, d)
        return [f._move(leaf, s, to=d)]
    if not idle(leaf):
        return []
    trade = [r for r in f.index.demoted if r in f.kids[s] and r != leaf and demoted(r) and not f.kids[s][r]
             and fed_by_forwarder(r)]
    if not trade:
        return []
    d = min(trade)
    up = f.parent[s][d]
    f._detach(d, s)
    f._move(leaf, s, to=up)
    f.spare[leaf] = s
    f.index.update(f, leaf)
    return [(leaf, s), f._move(d, s, to=leaf)]


def settled_forest(k: int, n: int, slots=None) -> list[list[int]]:
    """``table[s][r]``: the forest ranks 1..n settle into (what ``Forest.place`` / ``demote`` converge to).

    Built directly, breadth first, in O(n k): in stripe s the forwarders of
    group s take the shallowest free slots in rank order, then every other
    peer does; once slots run out, forwarders take one more each in turn.
    ``slots[r]`` (default k): child slots of rank r; 0 makes it a leaf.
    ``p2pweights.swarm.simulate`` predicts the swarm on this table."""
    slots = slots if slots is not None else [k] * (n + 1)
    forwarders = [r for r in range(1, n + 1) if slots[r] > 0]
    group = {r: i % k for i, r in enumerate(forwarders)}
    table = [[-1] * (n + 1) for _ in range(k)]
    for s in range(k):
        inner = [r for r in forwarders if group[r] == s]
        free = deque([(0, 1)])
        extra = deque(inner or [0])
        for r in inner + [r for r in range(1, n + 1) if group.get(r) != s]:
            while free and free[0][1] == 0:
                free.popleft()
            if free:
                p, left = free.popleft()
                free.appendleft((p, left - 1))
            else:
                p = extra[0]
                extra.rotate(-1)
            table[s][r] = p
            if group.get(r) == s:
                free.append((r, slots[r]))
    return table


def _unique(moves: list) -> list:
    return list(dict.fromkeys(moves))


TOPOLOGIES = {"binomial": Binomial, "chain": Chain, "star": Star, "kary": KAry, "striped": Striped, "forest": Forest}


def make(name: str, **opts):
    """The topology called ``name`` (``binomial``, ``chain``, ``star``, ``kary:4``,
    ``striped:4``, ``auto``); ValueError naming the known ones otherwise.

    ``opts`` go to the constructor (``make("kary", k=4)``); ``auto`` takes
    ``n_expected`` (default 16).
    """
    if not isinstance(name, str):
        raise PlanError(f"topology name must be a string, not {name!r}")
    base, _, arg = name.strip().lower().partition(":")
    if base == "auto":
        return auto(int(arg) if arg else opts.pop("n_expected", 16), **opts)
    cls = TOPOLOGIES.get(base)
    if cls is None:
        raise PlanError(f"unknown topology {name!r}; known: "
                         f"{', '.join(sorted(TOPOLOGIES))}, kary:K, striped:K, forest:K, auto")
    if arg:
        if cls not in (KAry, Striped, Forest):
            raise PlanError(f"topology {base!r} takes no parameter (got {name!r})")
        try:
            opts["k"] = int(arg)
        except ValueError:
            raise PlanError(f"topology {name!r}: {arg!r} is not an integer") from None
    try:
        return cls(**opts)
    except TypeError as e:
        raise PlanError(f"topology {name!r}: bad options {opts!r} ({e})") from None


def auto(n_expected: int, chunks: int = 64):
    """The topology to use for about ``n_expected`` peers (``chunks`` per model).

    Why (from ``p2pweights.swarm.simulate``: equal uplinks B, no latency, a model of
    size S cut into ``chunks`` chunks; floor S/B): a chain takes
    S/B * (1 + (N - 1)/chunks), since every uplink carries one copy and only
    the pipeline fill grows with N, so it is the best layout while N - 1 is a
    small fraction of the chunk count; it is kept up to N - 1 = chunks/2
    (33 peers at 256 MiB / 4 MiB, 1.5 S/B), a little short of the simulated
    crossover (about N = 45) because every real hop adds latency and CPU.
    Beyond that ``striped:2`` wins: 1.7 S/B at N = 64, 1.9 at 1,000, 2.2 at
    10,000 (its seeder sends 1.5 copies, a head uploads at most 1.5; the rest
    is fill), against log2(N + 1) S/B for binomial (10.7 at 1,000), about 2.2-2.5
    for ``kary:2`` and (k + 1)/2 or more for ``striped:k``, bound by its seeder.
    Refine from benchmark results.
    """
    n = int(n_expected)
    if n < 1:
        raise ValueError(f"n_expected must be >= 1, got {n_expected!r}")
    if n - 1 <= max(1, chunks) // 2:
        return Chain()
    return Striped(2)


def live_parent(topology, rank: int, stripe: int, alive) -> int:
    """Nearest ancestor of ``rank`` in tree ``stripe`` that is in ``alive`` (rank 0 always is)."""
    parent = topology.parents(rank)[stripe]
    while parent != 0 and parent not in alive:
        parent = topology.parents(parent)[stripe]
    return parent


def parent_table(topology, n: int, settled: bool = False):
    """``table[s][r]`` = parent of rank r in stripe s for ranks 1..n (``table[s][0]`` = -1).

    ``settled``: after the tracker's adoptions (``adopts``), for topologies that
    have them; else the parents each rank was given when it joined.
    """
    table = [[-1] * (n + 1) for _ in range(topology.stripes)]
    settle = getattr(topology, "settled_parents", None) if settled else None
    for r in range(1, n + 1):
        for s, p in enumerate(settle(r, n) if settle else topology.parents(r)):
            table[s][r] = p
    return table


def children(topology, rank: int, stripe: int, n: int) -> list[int]:
    """Ranks among 1..n whose parent in tree ``stripe`` is ``rank`` (ascending)."""
    return [r for r in range(max(1, rank + 1), n + 1) if topology.parents(r)[stripe] == rank]


def depth(topology, n: int, stripe: int = 0) -> int:
    """Largest number of hops from the seeder to any of ranks 1..n in tree ``stripe`` (0 if n == 0)."""
    d = [0] * (n + 1)
    for r in range(1, n + 1):
        d[r] = d[topology.parents(r)[stripe]] + 1
    return max(d)


def _check_rank(rank: int) -> None:
    if rank < 1:
        raise ValueError("rank 0 is the root and has no parent")


def _check_k(k, what: str) -> int:
    k = int(k)
    if k < 1:
        raise PlanError(f"{what}: k must be >= 1, got {k}")
    return k
