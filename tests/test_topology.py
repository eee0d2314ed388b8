"""Topology rules: one parent per stripe, no cycles, stable under joins, depths,
the striped one-interior-tree rule, and re-parenting after deaths."""
import math
import random

import pytest

from p2pweights.swarm.tracker import topology as T

NAMES = ["binomial", "chain", "star", "kary:2", "kary:3", "kary:4",
         "striped:1", "striped:2", "striped:3", "striped:4", "striped:5"]
SIZES = [1, 2, 3, 7, 16, 33, 200]


def interior(topo, n, alive=None):
    """{stripe: set of ranks that have a child} for ranks 1..n (or the alive ones, re-parented)."""
    ranks = range(1, n + 1) if alive is None else sorted(alive)
    out = {s: set() for s in range(topo.stripes)}
    for r in ranks:
        for s in range(topo.stripes):
            p = topo.parents(r)[s] if alive is None else T.live_parent(topo, r, s, alive)
            if p != 0:
                out[s].add(p)
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", SIZES)
def test_one_parent_per_stripe_earlier_rank_no_cycles(name, n):
    topo = T.make(name)
    for r in range(1, n + 1):
        ps = topo.parents(r)
        assert len(ps) == topo.stripes
        assert all(0 <= p < r for p in ps)  # an earlier rank: it has joined, and no cycle is possible
        for s in range(topo.stripes):       # walking up reaches the seeder
            x, steps = r, 0
            while x != 0:
                x = topo.parents(x)[s]
                steps += 1
                assert steps <= r


@pytest.mark.parametrize("name", NAMES)
def test_rule_is_stable_under_later_joins(name):
    topo = T.make(name)
    small, big = T.parent_table(topo, 20), T.parent_table(topo, 200)
    assert [col[:21] for col in big] == small
    # children of a rank only grow as ranks join
    for s in range(topo.stripes):
        for r in range(0, 20):
            assert set(T.children(topo, r, s, 20)) <= set(T.children(topo, r, s, 200))


@pytest.mark.parametrize("name", NAMES)
def test_children_agree_with_parents(name):
    topo, n = T.make(name), 60
    for s in range(topo.stripes):
        seen = []
        for r in range(0, n + 1):
            kids = T.children(topo, r, s, n)
            assert all(topo.parents(c)[s] == r for c in kids)
            seen += kids
        assert sorted(seen) == list(range(1, n + 1))  # every peer exactly once per stripe


def kary_depth(k, n):
    d, total = 0, 0
    while total < n:
        d += 1
        total += k ** d
    return d


@pytest.mark.parametrize("n", SIZES)
def test_depths(n):
    assert T.depth(T.Chain(), n) == n
    assert T.depth(T.Star(), n) == 1
    assert T.depth(T.Binomial(), n) == (n + 1).bit_length() - 1  # most set bits among 1..n
    for k in (2, 3, 4):
        assert T.depth(T.KAry(k), n) == kary_depth(k, n)
    for k in (1, 2, 3, 4):
        topo = T.Striped(k)
        for s in range(k):
            heads = len(range(s + 1, n + 1, k))
            d = T.depth(topo, n, s)
            if heads == 0:
                assert d == 1  # only round-0 peers, all under the seeder
            else:
                assert 1 + int(math.log2(heads)) <= d <= 2 + int(math.log2(heads))
    assert T.depth(T.Chain(), 0) == 0


@pytest.mark.parametrize("k", [2, 3, 4])
def test_kary_fanout(k):
    topo, n = T.KAry(k), 200
    assert T.children(topo, 0, 0, n) == list(range(1, k + 1))
    assert all(len(T.children(topo, r, 0, n)) <= k for r in range(n + 1))


def test_binomial_root_fanout_is_log():
    for n in (1, 2, 4, 8, 16, 100):
        assert len(T.children(T.Binomial(), 0, 0, n)) == n.bit_length()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", SIZES)
def test_striped_each_peer_interior_in_at_most_one_tree(k, n):
    topo = T.Striped(k)
    inner = interior(topo, n)
    for s, ranks in inner.items():
        assert all(topo.group(r) == s for r in ranks)
    for r in range(1, n + 1):
        assert sum(r in inner[s] for s in range(k)) <= 1


@pytest.mark.parametrize("k", [2, 3, 4])
def test_striped_upload_about_one_copy(k):
    topo, n = T.Striped(k), 200
    for s in range(k):
        # the seeder: head 0 and the round-0 peers that joined before it
        assert T.children(topo, 0, s, n) == list(range(1, s + 2))
        for r in range(1, n + 1):
            # k - 1 leaves and at most 2 heads: at most (k + 1)/k copies of the model
            assert len(T.children(topo, r, s, n)) <= (k + 1 if topo.group(r) == s else 0)
    upload = [sum(len(T.children(topo, r, s, n)) for s in range(k)) / k for r in range(1, n + 1)]
    assert sum(upload) / len(upload) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("frac", [0.1, 0.3, 0.6])
def test_reparenting_after_random_deaths_keeps_the_rules(name, frac):
    topo, n = T.make(name), 200
    rng = random.Random(f"{name}/{frac}")
    for _ in range(5):
        alive = {r for r in range(1, n + 1) if rng.random() >= frac}
        for r in alive:
            for s in range(topo.stripes):
                p = T.live_parent(topo, r, s, alive)
                assert p == 0 or p in alive
                assert p < r  # still an earlier rank: no cycles
                # p is an ancestor of r in the original tree
                x = topo.parents(r)[s]
                while x != p:
                    assert x not in alive and x != 0
                    x = topo.parents(x)[s]
        if isinstance(topo, T.Striped):
            inner = interior(topo, n, alive)
            for s, ranks in inner.items():
                assert all(topo.group(r) == s for r in ranks)
            for r in alive:
                assert sum(r in inner[s] for s in range(topo.stripes)) <= 1


def test_reparenting_a_dead_head_moves_its_children_up():
    topo = T.Striped(2)
    # stripe 0 heads: 1, 3, 5, 7, ...; head 3 (m=1) has heads 7, 9 (m=3, 4) and leaf 4
    assert T.children(topo, 3, 0, 12) == [4, 7, 9]
    alive = set(range(1, 13)) - {3}
    assert [T.live_parent(topo, r, 0, alive) for r in (4, 7, 9)] == [1, 1, 1]
    assert T.live_parent(topo, 7, 0, alive - {1}) == 0


def test_make_parses_names():
    assert T.make("binomial").name == "binomial"
    assert T.make("kary:4").name == "kary:4" and T.make("kary:4").k == 4
    assert T.make("KARY:3").k == 3
    assert T.make("kary", k=5).name == "kary:5"
    s = T.make("striped:4")
    assert s.stripes == 4 and s.name == "striped:4"
    assert T.make("striped").stripes == 2
    assert T.make("chain").parents(5) == [4]
    assert T.make("star").parents(5) == [0]
    for topo in (T.make(n) for n in NAMES):   # names round-trip
        assert T.make(topo.name).name == topo.name
    assert T.make("auto", n_expected=8).name == "chain"
    assert T.make("auto:1000").name == "striped:2"


@pytest.mark.parametrize("bad", ["foo", "chain:3", "kary:x", "kary:0", "striped:-1", ""])
def test_make_rejects_bad_names(bad):
    with pytest.raises(ValueError):
        T.make(bad)


def test_auto():
    assert T.auto(1).name == "chain"
    assert T.auto(16).name == "chain"
    assert T.auto(33).name == "chain"
    assert T.auto(34).name == "striped:2"
    assert T.auto(10_000).name == "striped:2"
    assert T.auto(100, chunks=1024).name == "chain"
    assert T.auto.__doc__ and "simulate" in T.auto.__doc__
    with pytest.raises(ValueError):
        T.auto(0)


def test_rank_zero_has_no_parent():
    for name in NAMES:
        with pytest.raises(ValueError):
            T.make(name).parents(0)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 16, 33])
def test_striped_adoptions_settle_and_keep_the_rules(k, n):
    """Applying ``adopts`` join by join gives ``settled_parents``; parents stay earlier-or-adopting
    heads of the stripe, every peer is interior in at most one stripe, and the seeder has
    one child per stripe once a round is full."""
    topo = T.Striped(k)
    cur = {}
    for r in range(1, n + 1):
        cur[r] = topo.parents(r)
        for child, s in topo.adopts(r):
            assert child < r and topo.group(r) == s
            cur[child][s] = r
    for r in range(1, n + 1):
        assert cur[r] == topo.settled_parents(r, n)
        for s, p in enumerate(cur[r]):
            assert p == 0 or topo.group(p) == s  # only heads of s forward stripe s
    if n >= k:
        for s in range(k):
            assert sum(cur[r][s] == 0 for r in cur) == 1


def test_tracker_adoptions_move_early_peers_to_their_round_head():
    from p2pweights.swarm.tracker.tracker import Tracker

    tr = Tracker(T.Striped(2), "seed:1")
    a = tr.join("a", "a:1")
    assert a.parents == [0, 0] and tr.adoptions(a) == []
    b = tr.join("b", "b:1")
    assert b.parents == [1, 0]
    assert tr.adoptions(b) == [a] and a.parents == [0, 2]
    entry = tr.parent_addrs(a)[1]
    assert entry.pop("ticket") and entry == {"rank": 2, "addr": "b:1", "stripe": 1}  # the ticket admits a at b
    assert tr.dependents(2) == [1] and sorted(tr.dependents(0)) == [1, 2]
    tr.done(1)
    c, d = tr.join("c", "c:1"), tr.join("d", "d:1")
    assert tr.adoptions(c) == [] and tr.adoptions(d) == [c] and c.parents == [1, 4]


@pytest.mark.parametrize("first", [1, 2])
def test_a_slow_first_joiner_demoted_before_the_fleet_arrives_gives_up_the_seeders_slot(first):
    # the first joiners hold the seeder's slots; one is found slow and demoted before the others
    # join: it may serve a leaf in its spare slot, but a forwarder that joins later takes its place
    # under the seeder, so every peer has a planned source in every stripe
    f = T.Forest(2)
    for r in range(1, first + 1):
        f.place(r)
    f.demote(1)
    for r in range(first + 1, 9):
        f.place(r)
    for s in range(2):
        assert all(f.parent[s][r] is not None for r in range(1, 9))
        assert all(f.parent[s][r] != 1 or f.spare.get(1) == s for r in range(2, 9))  # 1 feeds at most its spare leaf
        assert 1 not in f.kids[s][0] or not any(f.interior_in(r, s) and f.depth[s][r] > 1 for r in range(2, 9))


@pytest.mark.parametrize("k, n", [(3, 6), (4, 8), (8, 8), (4, 16), (8, 16)])
def test_a_forwarder_lent_to_a_stripe_before_its_member_came_gives_the_slot_back(k, n):
    # the first joiner is every stripe's first receiver: a stripe whose member is not there yet borrows
    # one of its slots.  Once the member comes, the member takes the seeder's slot there and the loan
    # ends: the seeder's children are the k members, each of one stripe, and nobody forwards two
    f = T.Forest(k)
    for r in range(1, n + 1):
        f.place(r)
    assert f.lent == {}
    for s in range(k):
        (root,) = f.kids[s][0]
        assert f.group[root] == s
        assert all(f.parent[s][r] is not None for r in range(1, n + 1))
        assert all(f.load(r, s) <= f.capacity(r, s) for r in range(1, n + 1))
    assert all(sum(f.load(r, s) > 0 for s in range(k)) <= 1 for r in range(1, n + 1))
