"""The forest's indexes (``slotindex``) answer what a scan of every peer would, through random
joins, demotions, departures and moves; and a large fleet's placement and partners keep their rules."""
import random

import pytest

from p2pweights.swarm.tracker.slotindex import Ranked
from p2pweights.swarm.tracker.topology import Forest, settled_forest
from p2pweights.swarm.tracker.tracker import MAX_PARTNERS, PARTNERS, Tracker


def scan_agrees(f: Forest) -> None:
    """Every rank a scan finds for a question is in the index for it, under its current depth."""
    ix = f.index
    for s in range(f.k):
        kids, parent = f.kids[s], f.parent[s]
        assert ix.slots[s] == sum(f.capacity(r, s) for r in kids)
        for r in kids:
            assert ix.size[s][r] == len(f._subtree(r, s))
            interior = r != 0 and f.interior_in(r, s)
            if interior and f.slots.get(r):
                assert ix.inner[s].key_of[r] == (f.depth[s][r], r)
            if r and not kids[r] and not interior and parent.get(r) not in f.spare:
                assert ix.leaves[s].key_of[r] == (f.depth[s][r], -r)
            if (r == 0 or interior) and len(kids[r]) < f.capacity(r, s):
                assert r in ix.open[s]
            if kids[r] and len(kids[r]) > f.capacity(r, s):
                assert r in ix.over[s]
        for r, p in parent.items():
            if p is None or p in f.spare:
                assert r in ix.unplaced[s]
        assert ix.inner[s].keys == sorted(ix.inner[s].key_of.values())
    assert ix.members == [sum(1 for g in f.group.values() if g == s) for s in range(f.k)]
    for r, g in f.group.items():
        if g is None and f.slots[r] == 0:
            assert r in ix.demoted
            if not any(f.kids[s][r] for s in range(f.k)):
                assert r in ix.idle


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_indexes_agree_with_a_scan_through_random_changes(k):
    for trial in range(40):
        rnd = random.Random(f"{k}/{trial}")
        f, live, nxt = Forest(k), [], 1
        for _ in range(80):
            x = rnd.random()
            if x < 0.6 or not live:
                f.place(nxt, rnd.choice([1.0, 1.0, 0.0, 0.5, 2.0]))
                live.append(nxt)
                nxt += 1
            elif x < 0.75:
                f.demote(rnd.choice(live))
            elif x < 0.9:
                victim = rnd.choice(live)
                live.remove(victim)
                f.remove(victim)
            else:
                r, s = rnd.choice(live), rnd.randrange(k)
                if f.parent[s].get(r) not in (None, 0):
                    f.move(r, s, avoid=f.parent[s][r])
            scan_agrees(f)
            for r in live:  # downstream from the subtree counts, as a walk gives it
                walk = sum(len(f._subtree(c, s)) for s in range(k) for c in f.kids[s][r]) - \
                    sum(f.load(r, s) for s in range(k))
                assert f.downstream(r) == walk


def test_ranked_keeps_each_rank_once_in_key_order():
    ix = Ranked()
    for r, key in [(3, (2, 3)), (1, (1, 1)), (2, (2, 2)), (3, (0, 3)), (1, (5, 1))]:
        ix.put(r, key)
    assert ix.keys == [(0, 3), (2, 2), (5, 1)]
    assert list(ix.after((2, 2))) == [(5, 1)]
    ix.discard(2)
    ix.discard(7)
    assert ix.keys == [(0, 3), (5, 1)] and set(ix.key_of) == {1, 3}


def test_two_thousand_joins_settle_as_the_breadth_first_table_does():
    n = 2000
    t = Tracker(Forest(2), "")
    for i in range(n):
        t.join(f"p{i}", f"tcp://h{i}:1")
    f, table = t.topology, settled_forest(2, n)
    for s in range(2):
        depth = {0: 0}

        def depth_of(r):
            if r not in depth:
                depth[r] = depth_of(table[s][r]) + 1
            return depth[r]
        assert max(f.depth[s].values()) <= max(depth_of(r) for r in range(1, n + 1))  # as shallow as the table
        assert all(f.load(r, s) <= f.capacity(r, s) for r in f.kids[s])
        assert sum(1 for r in range(1, n + 1) if f.parent[s][r] == 0) == 1  # the seeder sends one copy
    for r, m in t.members.items():
        assert r not in m.partners and 0 not in m.partners
        assert PARTNERS <= len(m.partners) <= MAX_PARTNERS + PARTNERS  # the cap is soft where all are full
        assert all(r in t.members[p].partners for p in m.partners)  # both ways


def test_a_gone_peer_leaves_its_partners_lists_and_they_take_new_ones():
    t = Tracker(Forest(2), "")
    for i in range(200):
        t.join(f"p{i}", f"tcp://h{i}:1")
    victim = 100
    friends = list(t.members[victim].partners)
    t.gone(victim)
    assert all(victim not in t.members[p].partners for p in friends)
    assert victim not in t.roster.live and len(t.roster.live) == 199
    lonely = [p for p in friends if len(t.members[p].partners) < PARTNERS]
    newcomer = t.join("late", "tcp://late:1")
    assert victim not in newcomer.partners
    assert all(newcomer.rank in t.members[p].partners or len(newcomer.partners) >= MAX_PARTNERS for p in lonely)
