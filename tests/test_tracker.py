"""Tracker membership as pure state: placement, leaving, repair after deaths, restarts."""
from p2pweights.topology import Binomial, make
from p2pweights.tracker import Tracker


def tracker_with(n, topology="binomial"):
    t = Tracker(make(topology), "")
    for i in range(1, n + 1):
        t.join(f"p{i}", f"10.0.0.{i}:7000")
    return t


def test_join_order_gives_binomial_places_and_rejoin_keeps_rank():
    t = tracker_with(7)
    assert t.tree() == {r: Binomial().parents(r) for r in range(1, 8)}
    again = t.join("p3", "10.0.0.33:7000")  # same peer, new address
    assert again.rank == 3 and t.listen_of(3) == "10.0.0.33:7000"


def test_a_peer_leaves_only_when_nobody_depends_on_it():
    t = tracker_with(3)  # 3 hangs under 1
    assert t.leave(1) == [3]
    t.done(3)
    assert t.leave(1) == []
    assert t.members[1].left
    late = t.join("p4", "10.0.0.4:7000")  # rank 4's rule-parent is 0 anyway
    late5 = t.join("p5", "10.0.0.5:7000")  # rank 5's rule-parent (1) left: its nearest live ancestor
    assert late.parents == [0] and late5.parents == [0]


def test_death_reattaches_the_whole_subtree_under_live_ancestors():
    t = tracker_with(7)  # 1 -> 3, 5; 3 -> 7
    moved = t.gone(1)
    assert sorted(moved) == [(3, 0), (5, 0)]
    assert t.members[3].parents == [0] and t.members[5].parents == [0]
    assert t.members[7].parents == [3]  # the subtree below stays under its own root
    moved = t.gone(3)
    assert moved == [(7, 0)] and t.members[7].parents == [0]


def test_reparent_a_corrupting_parent_moves_up_without_declaring_it_dead():
    t = tracker_with(7)
    assert t.reparent(7, 0, 3, dead=False) == 1  # 3's parent
    assert not t.members[3].left and t.members[7].parents == [1]
    assert t.reparent(5, 0, 1, dead=True) == 0
    assert t.members[1].left


def test_restarted_tracker_takes_peers_back_at_their_old_ranks():
    t = Tracker(make("binomial"), "")
    a = t.join("p5", "10.0.0.5:7000", rank=5)  # a peer re-introducing itself
    b = t.join("p2", "10.0.0.2:7000", rank=2)
    c = t.join("new", "10.0.0.9:7000")  # a newcomer gets a fresh rank after the highest known
    clash = t.join("other", "10.0.0.8:7000", rank=5)  # rank taken: a fresh one instead
    assert (a.rank, b.rank, c.rank, clash.rank) == (5, 2, 6, 7)
    assert a.parents == [0]  # 5's rule-parent 1 never came back: nearest live ancestor
