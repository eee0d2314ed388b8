"""Tracker membership as pure state: placement, leaving, repair after deaths, restarts."""
import time

from p2pweights.swarm.tracker.topology import Binomial, make
from p2pweights.swarm.tracker.tracker import Tracker, quantile


def tracker_with(n, topology="binomial", clock=time.monotonic):
    t = Tracker(make(topology), "", clock=clock)
    for i in range(1, n + 1):
        t.join(f"p{i}", f"10.0.0.{i}:7000")
    return t


def test_join_order_gives_binomial_places_and_rejoin_with_the_secret_keeps_rank():
    t = tracker_with(7)
    assert t.tree() == {r: Binomial().parents(r) for r in range(1, 8)}
    again = t.join("p3", "10.0.0.33:7000", rank=3, secret=t.seal.secret(3))  # same peer, new address
    assert again.rank == 3 and t.listen_of(3) == "10.0.0.33:7000"


def test_a_peer_id_or_a_wrong_secret_takes_over_nobody():
    t = tracker_with(7)
    for claim in ({}, {"rank": 3}, {"rank": 3, "secret": "0" * 32}, {"rank": 3, "secret": t.seal.secret(4)}):
        stranger = t.join("p3", "10.6.6.6:7000", **claim)
        assert stranger.rank > 7 and t.listen_of(3) == "10.0.0.3:7000"


def test_a_peer_leaves_only_when_nobody_depends_on_it():
    t = tracker_with(3)  # 3 hangs under 1
    assert t.leave(1) == [3]
    t.done(3)
    assert t.leave(1) == []
    assert t.members[1].left
    late = t.join("p4", "10.0.0.4:7000")  # rank 4's rule-parent is 0 anyway
    late5 = t.join("p5", "10.0.0.5:7000")  # rank 5's rule-parent (1) left: its nearest live ancestor
    assert late.parents == [0] and late5.parents == [0]


def test_a_done_peer_waits_to_leave_for_an_unfinished_partner_it_still_hears_from():
    clock = [0.0]
    t = tracker_with(8, "forest:2", clock=lambda: clock[0])
    leaver, partner = next((r, p) for r in range(1, 9) for p in t.members[r].partners if p not in t.dependents(r))
    for r in t.members:
        if r != partner:
            t.done(r)
    assert t.leave(leaver) == [partner]  # it may still take chunks from us
    clock[0] = 10.0  # silent that long (dead, and nobody noticed yet): we go
    assert t.leave(leaver) == [] and t.members[leaver].left


def test_a_done_peer_waits_for_an_unfinished_partner_a_quarter_of_its_download_s_time_at_most():
    from p2pweights.swarm.tracker.tracker import PARTNER_LINGER

    clock = [0.0]
    t = tracker_with(8, "forest:2", clock=lambda: clock[0])
    leaver, partner = next((r, p) for r in range(1, 9) for p in t.members[r].partners if p not in t.dependents(r))
    clock[0] = 8.0  # an 8 s download
    for r in t.members:
        if r != partner:
            t.done(r)
    t.members[partner].seen = clock[0] = 8.0 + 0.9 * PARTNER_LINGER * 8.0  # still heard from
    assert t.leave(leaver) == [partner]
    t.members[partner].seen = clock[0] = 8.0 + 1.1 * PARTNER_LINGER * 8.0  # still heard from, but far behind
    assert t.leave(leaver) == [] and t.members[leaver].left


def test_a_done_peer_s_linger_replaces_the_quarter_rule_both_ways():
    clock = [0.0]
    t = tracker_with(8, "forest:2", clock=lambda: clock[0])
    pairs = [(r, p) for r in range(1, 9) for p in t.members[r].partners if p not in t.dependents(r)]
    (a, pa), (b, pb) = pairs[0], next(x for x in pairs[1:] if x[0] != pairs[0][0] and x[1] == pairs[0][1])
    clock[0] = 8.0  # an 8 s download: the quarter rule would wait 2 s
    for r in t.members:
        if r != pa:
            t.done(r)
    t.members[pa].seen = clock[0] = 8.0 + 5.0  # 5 s after: past the quarter, within a 10 s linger
    assert t.leave(a, linger=10.0) == [pa]
    assert t.leave(a) == [pa]  # the linger it said is kept for its next LEAVE (and the endpoint's retries)
    t.members[pa].seen = clock[0] = 8.0 + 10.5
    assert t.leave(a) == [] and t.members[a].left
    assert t.leave(b, linger=0.0) == [] and t.members[b].left  # 0: no wait for partners at all


def test_a_late_arrival_to_a_seeded_swarm_partners_with_the_complete_holders_first():
    from p2pweights.swarm.tracker.tracker import PARTNERS, complete_holders

    t = tracker_with(8, "forest:2", clock=lambda: 0.0)
    for r in range(1, 6):
        t.done(r)
    t.take_moved()
    late = t.join("late", "10.0.0.100:7000")
    assert len(late.partners) >= PARTNERS
    assert set(late.partners[:PARTNERS]) <= set(range(1, 6))  # every one of its first partners holds every chunk
    assert set(t.take_moved()) >= set(late.partners[:PARTNERS])  # each holder is told of its new partner
    for r in (6, 7, 8):
        t.done(r)
    for r in late.partners[:PARTNERS]:  # and waits to leave for it, as for any unfinished partner
        assert late.rank in t.members[r].partners and t.leave(r) == [late.rank]
    assert set(complete_holders(t.members, t.roster.live, late.rank)) == set(range(1, 9))


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


def forest_tracker(n, k=2):
    return tracker_with(n, f"forest:{k}")


def report_slow_forwarder(t, n=8):
    """A forwarder with children in ``t``'s forest, which everyone reports at 10 MB/s (40 the others)."""
    f = t.topology
    slow = next(r for r in range(1, n + 1) if f.kids[f.group[r]][r])
    for m in t.members.values():  # everyone reports what each partner and parent delivers
        m.rates = {p: (10e6 if p == slow else 40e6) for p in set(m.parents) | set(m.partners) if p}
    return slow


def test_forest_plan_every_peer_forwards_in_one_stripe_and_the_seeder_sends_each_chunk_once():
    t = forest_tracker(8)
    f = t.topology
    for s in range(2):
        assert len(f.kids[s][0]) == 1  # one slot per stripe at the seeder
        for r in range(1, 9):
            if f.kids[s][r]:
                assert f.group[r] == s  # a peer forwards only in its own stripe
            assert f.load(r, s) <= f.capacity(r, s)
    assert {r: m.parents for r, m in t.members.items()} == {r: f.parents(r) for r in range(1, 9)}


def test_a_finished_peer_is_lent_to_the_peers_furthest_behind_and_waits_to_leave_for_them():
    # the last peers to finish took their backlog from the few partners given at their join while
    # finished uplinks idled: a peer that is done becomes a partner of the live peers with the fewest
    # chunks (each told, with REPARENT), and waits to leave for them while they are heard from
    from p2pweights.swarm.tracker.tracker import PARTNERS

    t = forest_tracker(16)
    t.take_moved()
    for r, m in t.members.items():
        m.have = 100 + r  # rank 1 is the furthest behind, then rank 2, ...
    done = 16
    behind = sorted(r for r in range(1, 16) if r not in t.members[done].partners)[:PARTNERS]
    t.done(done)
    assert set(t.take_moved()) >= set(behind)
    for r in behind:
        assert done in t.members[r].partners and r in t.members[done].partners
    assert t.leave(done) and not t.members[done].left
    for r in range(1, 16):
        t.done(r)
    assert t.leave(done) == [] and t.members[done].left


def test_forest_partners_are_given_both_ways_and_kept_bounded():
    t = forest_tracker(12)
    for r, m in t.members.items():
        assert r not in m.partners and 0 not in m.partners
        assert 1 <= len(m.partners) <= 8
        for p in m.partners:
            assert r in t.members[p].partners


def test_forest_a_dead_forwarder_s_children_are_re_placed_and_told():
    t = forest_tracker(8)
    t.take_moved()
    orphans = [r for r in range(2, 9) if 1 in t.members[r].parents]
    moved = t.gone(1)
    assert {r for r, _ in moved} >= set(orphans)
    told = t.take_moved()
    for r in orphans:
        assert 1 not in t.members[r].parents and r in told
    assert all(1 not in m.partners for m in t.members.values())


def test_forest_slow_host_is_demoted_to_a_leaf_from_its_partners_reports():
    clock = [0.0]
    t = tracker_with(8, "forest:2", clock=lambda: clock[0])
    f = t.topology
    slow = report_slow_forwarder(t)
    from p2pweights.swarm.tracker.tracker import SLOW_EVIDENCE

    for _ in range(SLOW_EVIDENCE - 1):
        assert t.slow_hosts() == []  # evidence must repeat before anyone is moved
    assert t.slow_hosts() == [slow]
    assert f.group[slow] is None and not any(f.kids[s][slow] for s in range(2))
    assert all(slow not in m.parents for r, m in t.members.items() if r != slow)
    assert t.slow_hosts() == []  # once


def test_a_joiner_whose_probe_ran_fast_is_not_demoted_by_its_first_rates():
    # in its first seconds a fast host still starting (nine processes on two cores) delivers as slowly
    # as a slow uplink does; its probe at join tells them apart, so while it is young it clears it
    from p2pweights.wire.protocol import YOUNG
    from p2pweights.swarm.tracker.tracker import SLOW_EVIDENCE

    for probe, demoted_young in ((50e6, False), (12e6, True)):
        clock = [0.0]
        t = tracker_with(8, "forest:2", clock=lambda: clock[0])
        slow = report_slow_forwarder(t)
        for r in range(1, 9):
            t.probed(r, probe if r == slow else 50e6, long=False)  # short probes: they judge nobody
        found = [t.slow_hosts() for _ in range(SLOW_EVIDENCE)][-1]
        assert found == ([slow] if demoted_young else [])
        if not demoted_young:
            clock[0] = YOUNG + 0.1  # no longer young: the rates alone judge it
            assert [t.slow_hosts() for _ in range(SLOW_EVIDENCE)][-1] == [slow]


def forest_with_reports(rate, delivered, n=8):
    """A forest:2 fleet of ``n`` and a forwarder ``x`` in it; every member reports ``rate(p, m)``
    (while asked) and ``delivered(p, m)`` (bytes/s lately) of each parent and partner ``p``."""
    t = tracker_with(n, "forest:2", clock=lambda: 0.0)
    f = t.topology
    x = next(r for r in range(1, n + 1) if f.kids[f.group[r]][r])
    for m in t.members.values():
        ps = [p for p in set(m.parents) | set(m.partners) if p]
        t.touch(m.rank, rates={p: rate(p, m, x) for p in ps}, delivered={p: delivered(p, m, x) for p in ps})
    assert any(x in m.rates and x not in m.parents for m in t.members.values())  # it helps some
    return t, x


def test_a_slow_forwarder_helping_now_and_then_is_judged_by_what_it_delivers():
    # each partner taking a help chunk now and then measures the slow uplink while it has a request
    # there, alone on it (40 MB/s "while asked"): their sum counted one quarter-rate uplink five
    # times over and it was kept; the bytes they all got from it are bounded by its uplink
    t, slow = forest_with_reports(lambda p, m, x: 10e6 if p == x and p in m.parents else 40e6,
                                  lambda p, m, x: 1e6 if p == x else 20e6)
    up = t.uplinks()
    assert up[slow] == 10e6 * sum(slow in m.parents for m in t.members.values())
    from p2pweights.swarm.tracker.tracker import SLOW_EVIDENCE

    for _ in range(SLOW_EVIDENCE):
        demoted = t.slow_hosts()
    assert demoted == [slow] and t.judged[slow] == up[slow]


def test_a_fast_forwarder_busy_helping_is_judged_by_all_it_delivered_and_kept():
    # its children get a share of its uplink while others take help from it: their rates alone
    # look slow, but what all its partners got from it lately is what a fast uplink delivers
    t, busy = forest_with_reports(lambda p, m, x: 3e6 if p == x and p in m.parents else 40e6,
                                  lambda p, m, x: 12e6 if p == x else 8e6)
    up = t.uplinks()
    assert up[busy] == 12e6 * sum(busy in m.delivered for m in t.members.values()) > 40e6
    assert [r for _ in range(3) for r in t.slow_hosts()] == []


def test_forest_partners_are_told_how_many_peers_each_one_feeds_further_down():
    t = forest_tracker(8)
    f = t.topology
    root = next(iter(f.kids[0][0]))  # the seeder's child in stripe 0: the stripe flows through it
    entries = {p["rank"]: p for r in t.members for p in t.partner_addrs(t.members[r]) + t.parent_addrs(t.members[r])}
    deeper = [r for r in range(1, 9) if f.depth[0][r] >= 3]  # below its children, in its stripe
    assert entries[root]["downstream"] == f.downstream(root) == len(deeper) >= 4
    assert all(p["downstream"] >= 0 for p in entries.values() if p["rank"])
    t.take_moved()
    orphans = set(f.kids[0][root])
    for m in t.members.values():
        m.rates = {p: (10e6 if p == root else 40e6) for p in set(m.parents) | set(m.partners) if p}
    for _ in range(3):
        t.slow_hosts()
    told = t.take_moved()
    assert set(t.members[root].partners) <= set(told)  # they learn that it feeds nobody further now
    assert f.downstream(root) == 0
    heirs = {f.parent[0][c] for c in orphans} - {0}  # who took its children (the stripe's new root)
    assert heirs and all(set(t.members[h].partners) <= set(told) for h in heirs)  # and that they feed more now
    entries = [p for r in told for p in t.partner_addrs(t.members[r]) + t.parent_addrs(t.members[r])]
    assert {p["rank"] for p in entries if p.get("slow")} == {root}  # and that its uplink is slow


def test_forest_settled_table_matches_the_incremental_plan_in_shape():
    from p2pweights.swarm.tracker.topology import settled_forest

    for n in (3, 8, 16, 33):
        table = settled_forest(2, n)
        inc = forest_tracker(n).topology
        for s in range(2):
            assert sum(1 for r in range(1, n + 1) if table[s][r] == 0) == 1
            kids = {}
            for r in range(1, n + 1):
                kids.setdefault(table[s][r], []).append(r)
            assert max(len(v) for p, v in kids.items() if p) <= 2
            depth = [0] * (n + 1)
            for r in range(1, n + 1):
                depth[r] = depth[table[s][r]] + 1
            assert max(depth) <= max(inc.depth[s].values())


def test_forest_demotion_lends_a_free_slot_so_every_peer_keeps_a_planned_source():
    # 8 forwarders in groups of 4 and 4; demoting one leaves 4 and 3, and the stripe of 3 has 6 slots
    # for 7 receivers: a forwarder of the other group with a slot free lends it there
    from p2pweights.swarm.tracker.topology import Forest

    f = Forest(2)
    for r in range(1, 9):
        f.place(r)
    moves = f.demote(1)
    assert all(f.parent[s][r] is not None for s in range(2) for r in range(1, 9))
    (lender, stripe), = f.lent.items()
    assert f.group[lender] != stripe and f.kids[stripe][lender]  # it forwards in a second stripe now
    assert (lender, stripe) in moves
    for r in range(1, 9):  # still one copy per uplink: a lent slot comes out of its own stripe
        assert sum(f.capacity(r, s) for s in range(2)) <= f.slots[r]
        assert all(f.load(r, s) <= f.capacity(r, s) for s in range(2))
    f.demote(lender)  # a lender that is demoted in turn gives the slot back, and its child moves
    assert lender not in f.lent
    assert all(f.kids[s][lender] <= ({*f.kids[s][lender]} if f.spare.get(lender) == s else set()) for s in range(2))


def test_forest_a_demoted_host_serves_one_leaf_where_every_forwarder_slot_is_taken():
    # 8 peers, 2 demoted: 6 forwarders (12 slots) and the seeder's 2 serve 14 of the 16 (peer, stripe)
    # pairs.  Each demoted host's uplink then carries one leaf's stripe (partners help with the rest)
    from p2pweights.swarm.tracker.topology import Forest

    for demoted in ((1, 2), (1, 3), (1, 7), (7, 8), (2, 5)):  # (1, 7): both of one group
        f = Forest(2)
        for r in range(1, 9):
            f.place(r)
        for d in demoted:
            f.demote(d)
        unplaced = [(r, s) for s in range(2) for r in range(1, 9) if f.parent[s][r] is None]
        served = [(c, s) for d, s in f.spare.items() for c in f.kids[s][d]]
        assert len(served) == 2 and not unplaced, demoted
        for c, s in served:
            assert not f.interior_in(c, s) and not f.kids[s][c], demoted  # a leaf: no subtree below it
            assert f.parent[s][f.parent[s][c]] not in f.spare, demoted  # and not fed by another slow host
        assert sum(f.capacity(r, s) for r in range(1, 9) if r not in demoted for s in range(2)) == 12


def test_forest_keeps_its_invariants_through_random_joins_demotions_and_departures():
    import random

    from p2pweights.swarm.tracker.topology import Forest

    for trial in range(200):
        rnd = random.Random(trial)
        n, k = rnd.randint(3, 20), rnd.choice([2, 2, 3])
        f = Forest(k)
        for r in range(1, n + 1):
            f.place(r)
        alive = set(range(1, n + 1))
        for _ in range(rnd.randint(1, 4)):
            victim = rnd.choice(sorted(alive))
            if rnd.random() < 0.5:
                f.demote(victim)
            else:
                f.remove(victim)
                alive.discard(victim)
            for r in alive:
                assert sum(f.capacity(r, s) for s in range(k)) <= max(f.slots[r], r in f.spare), trial
                for s in range(k):  # a demoted host feeds at most one leaf, never a subtree
                    if r in f.spare:
                        assert all(not f.interior_in(c, s) and not f.kids[s][c] for c in f.kids[s][r]), trial
                for s in range(k):
                    assert f.load(r, s) <= f.capacity(r, s), trial
                    seen, p = set(), f.parent[s][r]
                    while p not in (None, 0):  # a live ancestor chain up to the seeder, no cycle
                        assert p in alive and p not in seen, trial
                        seen.add(p)
                        p = f.parent[s][p]


def test_forest_a_host_whose_probe_runs_far_below_the_others_is_a_leaf_before_it_forwards():
    # each probe arrives as its host joins, before anyone is placed under it: the first joiner is
    # a stripe's root and slow, and its probe (timed at the tracker) is judged once three are in,
    # and again until PROBE_QUORUM are in, so it is demoted before a review could have seen a chunk
    # from it; a probe too short to time (on loopback, or at 100 Gbit/s) demotes nobody, and
    # neither does one from a host that already feeds children (it got a share of its uplink)
    from p2pweights.swarm.tracker.tracker import PROBE_QUORUM

    t = Tracker(make("forest:2"), "")
    f = t.topology
    slow = 1
    rates = {r: (3e6 if r == slow else 12e6) for r in range(1, 9)}
    got = []
    for r in range(1, 9):  # the slow one's probe comes in first: nobody to judge it by
        t.join(f"p{r}", f"10.0.0.{r}:7000")
        got += t.probed(r, rates[r])
        if len(t.probes) < 3:
            assert got == []
    assert got == [slow] and t.members[slow].demoted and f.group[slow] is None
    assert sum(slow in m.parents for r, m in t.members.items() if r != slow) <= 1  # its spare slot at most
    assert t.probed(slow, 1e3) == []  # one probe per member
    t2 = forest_tracker(8)
    assert [r for r in range(1, 9) for _ in t2.probed(r, rates[r], long=False)] == []  # too short to prove slow
    assert not any(m.demoted for m in t2.members.values()) and len(t2.probes) == 8 >= PROBE_QUORUM
    t3 = forest_tracker(8)
    busy = next(r for r in range(1, 9) if any(t3.topology.load(r, s) for s in range(2)))
    assert [d for r in range(1, 9) for d in t3.probed(r, 3e6 if r == busy else 12e6)] == []
    assert not t3.members[busy].demoted  # the reviews judge it


def test_a_probe_sent_holding_nothing_judges_its_host_whoever_it_feeds():
    # all eight join before any probe is in (eight interpreters starting on two cores): the slow
    # host already has children placed under it, but it held nothing to give them when it sent its
    # probe (``alone``), so the probe had its uplink and judges it; a probe sent holding chunks
    # (``alone`` False: it may have been forwarding them) only counts in the median
    for alone, demoted in ((True, True), (False, False)):
        t = forest_tracker(8)
        slow = next(r for r in range(1, 9) if any(t.topology.load(r, s) for s in range(2)))
        got = [d for r in range(1, 9) for d in t.probed(r, 3e6 if r == slow else 12e6, alone=alone or r != slow)]
        assert got == ([slow] if demoted else []) and t.members[slow].demoted == demoted
        assert not any(m.demoted for r, m in t.members.items() if r != slow)
        assert (t.topology.group[slow] is None) == demoted  # a leaf in every stripe


def test_fast_hosts_probing_at_once_while_interpreters_start_neither_hide_a_slow_one_nor_are_demoted():
    # recorded on the bench's bed (MB/s, in order of arrival): four fast hosts probing at once read
    # 22-24, a median they drag down hid a quarter-rate host's 11.4; against the upper quartile the
    # slow hosts stand out and the busy fast ones do not
    t = forest_tracker(8)
    readings = {1: 21.8, 2: 23.8, 3: 52.4, 4: 52.4, 5: 11.4, 6: 21.8, 7: 52.4, 8: 11.4}
    got = [d for r in range(1, 9) for d in t.probed(r, readings[r] * 1e6, alone=True)]
    assert sorted(got) == [5, 8]
    assert [r for r, m in t.members.items() if m.demoted] == [5, 8]
    assert quantile(t.probes, 0.75) == 52.4e6 and abs(t.probe_median() - 22.8e6) < 1


def test_a_forwarder_s_reference_is_the_median_of_the_others():
    # the review sorts the rates once and takes each host out of the median in place; the same
    # answers as a median of the list without it, duplicates and even lengths included
    import random
    import statistics

    from p2pweights.swarm.tracker.tracker import median_without

    rng = random.Random(0)
    for _ in range(5000):
        values = [rng.choice([1.0, 2.0, 3.0, 5.0, rng.uniform(0, 10)]) for _ in range(rng.randint(2, 12))]
        x = rng.choice(values)
        rest = list(values)
        rest.remove(x)
        assert median_without(sorted(values), x) == statistics.median(rest)


def test_a_forwarder_whose_children_are_nearly_done_is_not_judged():
    # near the end few requests are in flight, each served alone on an uplink, so children's rates
    # read high and an honest forwarder falls below a third of the median; a demotion then only
    # moves children that are nearly done. While one of its children misses a quarter, it is judged
    from p2pweights.swarm.tracker.tracker import END_SHARE, SLOW_EVIDENCE

    n = 512
    t, slow = forest_with_reports(lambda p, m, x: 10e6 if p == x else 40e6, lambda p, m, x: 0.0)
    children = [m for m in t.members.values() if slow in m.parents]
    for m in t.members.values():
        m.have = n
    for _ in range(SLOW_EVIDENCE + 1):
        assert t.slow_hosts(n) == []
    children[0].have = int(END_SHARE * n) - 1  # one child still misses more than a quarter
    for _ in range(SLOW_EVIDENCE):
        demoted = t.slow_hosts(n)
    assert demoted == [slow]
