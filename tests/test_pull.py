"""The pull scheduler alone: a fake clock, links built from short strings, each pick asserted."""
import random

import numpy as np
import pytest

from p2pweights.swarm.policy.pull import HELP_WINDOW, MAX_WINDOW, MIN_WINDOW, RAREST_AMONG, SHARE_WINDOW, PullScheduler

CHUNK = 1 << 20


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def bits(text: str) -> np.ndarray:
    """'11.1' -> [True, True, False, True]."""
    return np.array([c == "1" for c in text])


def sched(n=8, stripes=1, have=None, window=4, plan=(1,), links=None):
    clock = Clock()
    s = PullScheduler(n, CHUNK, have=None if have is None else bits(have), stripes=stripes, window=window,
                      clock=clock)
    s.set_plan(list(plan))
    for rank, holds in (links or {1: "1" * n}).items():
        s.add(rank)
        s.ready(rank, bits(holds))
    return s, clock


def asked(s) -> dict:
    return dict(s.requests())


def test_planned_source_is_asked_in_order_within_its_window():
    s, _ = sched(links={1: "1111111.", 2: "111111.."}, plan=(1,))  # mid-run: chunk 7 is the seeder's alone
    assert asked(s) == {1: [0, 1, 2, 3]}  # a healthy planned source: nobody else is bothered
    assert asked(s) == {}  # credits used up


def test_planned_source_is_asked_ahead_of_what_it_holds_and_parks():
    s, _ = sched(links={1: "11......"}, plan=(1,))
    assert asked(s) == {1: [0, 1, 2, 3]}  # 2, 3 park at the parent until it has them (a pipelining tree)


def test_arrival_frees_a_credit_and_measures_the_link():
    s, clock = sched(window=2)
    assert asked(s) == {1: [0, 1]}
    clock.t = 0.01
    s.arrived(1, 0, ok=True)
    assert s.links[1].rate == pytest.approx(CHUNK / 0.01)
    assert s.links[1].window == min(MAX_WINDOW, int(np.ceil(CHUNK / 0.01 * 0.25 / CHUNK)))
    assert 2 in asked(s)[1]


def test_a_slow_link_gets_a_small_window():
    s, clock = sched(window=8)
    asked(s)
    clock.t = 10.0  # one chunk in 10 s
    s.arrived(1, 0, ok=True)
    assert s.links[1].window == MIN_WINDOW


def test_bad_chunk_is_asked_again_and_counted_against_the_link():
    s, clock = sched(window=2)
    assert asked(s) == {1: [0, 1]}
    s.arrived(1, 0, ok=False)
    assert s.links[1].bad == 1 and not s.got(0)
    assert asked(s) == {1: [0]}


def test_a_lagging_planned_source_loses_its_share_to_a_partner_that_holds_it():
    # the planned source (1) lacks chunks 2..31 that partner 2 holds: 1 is far behind the swarm
    s, _ = sched(n=32, links={1: "11" + "." * 30, 2: "1" * 31 + "."}, plan=(1,), window=4)
    got = asked(s)
    assert got[1] == [0, 1, 2, 3]  # what it holds, and two parked ahead of it (it forwards them at once)
    # the helper takes a few of the chunks the source lacks and nobody has asked for yet
    assert 0 < len(got[2]) <= HELP_WINDOW and set(got[2]) <= set(range(4, 32))


def test_a_planned_source_a_little_behind_keeps_its_share():
    s, _ = sched(n=32, have="1" * 24 + "." * 8, links={1: "1" * 28 + "....", 2: "1" * 31 + "."}, plan=(1,), window=4)
    assert set(asked(s)) == {1}


def test_a_peer_far_behind_its_source_takes_some_from_partners_that_hold_it():
    # its source holds 32 chunks it lacks, more than 2 windows: a partner with the same chunks helps
    s, _ = sched(n=32, links={1: "1" * 32, 2: "1" * 32}, plan=(1,), window=2)
    got = asked(s)
    assert len(got[1]) == 2 and 0 < len(got[2]) <= HELP_WINDOW
    assert not set(got[1]) & set(got[2])
    assert max(got[1] + got[2]) < RAREST_AMONG  # near blob order still


def test_peers_catching_up_on_one_source_pick_different_chunks():
    # two siblings behind the same source: rarest first, ties broken apart, so each can give the other
    # what it took (in blob order they would take the same chunks, and each chunk twice from the source)
    picks = []
    for seed in (1, 2):
        s = PullScheduler(32, CHUNK, stripes=1, window=2, clock=Clock(), rng=random.Random(seed))
        s.set_plan([1])
        for rank in (1, 2):
            s.add(rank)
            s.ready(rank, bits("1" * 32))
        picks.append(set(dict(s.requests())[1]))
    assert picks[0] != picks[1] and all(max(p) < RAREST_AMONG for p in picks)


def test_help_is_asked_of_partners_that_feed_nobody_further_not_of_a_stripe_root():
    # the source (1) lacks what partners 2 (a stripe's root: 6 peers get their stripe through its
    # children) and 3 (feeds nobody beyond its own children) hold: only 3 helps, so the root's
    # uplink stays with its children, until the root holds every chunk; without the tracker's
    # word, either may help
    for trial in range(20):
        s = PullScheduler(32, CHUNK, stripes=1, window=4, clock=Clock(), rng=random.Random(trial))
        s.set_plan([1])
        for rank, holds in ((1, "11" + "." * 30), (2, "1" * 31 + "."), (3, "1" * 31 + ".")):
            s.add(rank)
            s.ready(rank, bits(holds))
        s.set_downstream({2: 6, 3: 0})
        got = asked(s)
        assert 2 not in got and 0 < len(got[3]) <= HELP_WINDOW
    for downstream in ({2: 6, 3: 0}, {}):  # once it holds every chunk its children keep up with it
        helpers = set()
        for trial in range(20):
            s, _ = sched(n=32, links={1: "11" + "." * 30, 2: "1" * 32, 3: "1" * 31 + "."}, plan=(1,), window=4)
            s.set_downstream(downstream)
            s.rng.seed(trial)
            helpers |= set(asked(s)) - {1}
        assert helpers == {2, 3}


def test_a_dead_planned_source_gives_its_requests_back_at_once():
    s, _ = sched(links={1: "1111111.", 2: "1111111."}, plan=(1,), window=4)
    assert asked(s) == {1: [0, 1, 2, 3]}
    assert s.drop(1) == [0, 1, 2, 3]
    got = asked(s)
    assert got[2][:2] == [0, 1]  # asked elsewhere at once, lowest first


def test_a_stripe_without_a_source_is_shared_by_every_holder_a_few_chunks_each():
    # no slot for us in the stripe: its holders share it, not the first partner listed alone
    s, clock = sched(n=32, plan=(None,), window=8, links={r: "1" * 32 for r in (1, 2, 3)})
    got = asked(s)
    assert sorted(got) == [1, 2, 3] and all(len(v) == SHARE_WINDOW for v in got.values())
    picked = [i for v in got.values() for i in v]
    assert len(set(picked)) == 3 * SHARE_WINDOW and max(picked) < RAREST_AMONG + len(picked)  # none twice, near blob order
    clock.t = 0.1
    s.arrived(2, got[2][0], ok=True)
    assert {r: len(v) for r, v in asked(s).items()} == {2: 1}  # the credit back where it came from


def test_seeder_helps_only_an_orphaned_stripe():
    # rank 0 is the seeder; stripe 0 planned from 1 (which lags), stripe 1 from the seeder
    s, clock = sched(n=8, stripes=2, plan=(1, 0), links={0: "11111111", 1: "1......."}, window=2)
    got = asked(s)
    assert all(i % 2 == 1 for i in got[0])  # the seeder serves its own stripe only, the lag notwithstanding
    s.drop(1)
    for i in got[0]:
        s.arrived(0, i, ok=True)
    assert all(i % 2 == 1 for i in asked(s).get(0, []))  # a partner may get stripe 0 a moment later
    clock.t = 5.0
    s.stalled()
    got = asked(s)
    assert got[0][:2] == [0, 2]  # nobody has: the seeder serves stripe 0 too, in blob order


def test_stall_gives_requests_back_and_cancels_them():
    s, clock = sched(links={1: "1111111.", 2: "1111111."}, window=4)
    asked(s)
    clock.t = 100.0
    late = s.stalled()
    assert late == [(1, [0, 1, 2, 3])]
    assert s.take_cancels() == [(1, [0, 1, 2, 3])]
    assert not s.inflight & 0b1111


def test_endgame_asks_a_second_holder_and_the_first_copy_cancels_the_other():
    s, clock = sched(n=4, have="111.", links={1: "1111", 2: "1111"}, plan=(1,), window=4)
    assert asked(s) == {1: [3]}  # the last chunk, of its planned source
    assert asked(s) == {}  # not overdue yet: no duplicate
    clock.t = 10.0  # far later than the planned source's queue explains
    s.stalled()  # the node's timer: looks again
    assert asked(s) == {2: [3]}  # nothing else left to ask: a second holder
    clock.t = 10.1
    s.arrived(2, 3, ok=True)
    assert s.take_cancels() == [(1, [3])]
    assert s.complete


def test_finished_partners_each_help_with_their_whole_window_once_the_planned_source_is_finished():
    # the drain: the planned source (1) and partners 2 and 3 hold every chunk; each finished
    # partner's uplink feeds no pipeline any more, so each is asked for its whole window at once
    # (the last peers to finish took their backlog from one planned source while finished ones idled)
    s, _ = sched(n=64, have="1" * 16 + "." * 48, links={1: "1" * 64, 2: "1" * 64, 3: "1" * 64}, plan=(1,), window=8)
    got = asked(s)
    assert {r: len(v) for r, v in got.items()} == {1: 8, 2: 8, 3: 8}
    assert len({i for v in got.values() for i in v}) == 24  # none asked twice
    s, _ = sched(n=64, have="1" * 16 + "." * 48, links={1: "1" * 64, 2: "1" * 64, 3: "1" * 63 + "."}, plan=(1,),
                 window=8)
    got = asked(s)  # one finished partner besides the source: the drain has begun, and what we miss is all
    assert {r: len(v) for r, v in got.items()} == {1: 8, 2: 8, 3: 8}  # at partners: 3 helps with its window too


def test_once_every_chunk_we_miss_is_at_a_partner_each_helps_with_its_whole_window():
    # the seeder is done with us: no pipeline grows any more, and partners that still miss chunks
    # (so they still forward, and "finished" is not how they count) have uplink to spare
    links = {1: "1" * 62 + "..", 2: "1" * 63 + ".", 3: "1" * 62 + ".1", 0: "1" * 64}
    s, _ = sched(n=64, have="1" * 16 + "." * 48, links=links, plan=(1,), window=8)
    s.set_downstream({1: 2, 2: 2, 3: 2})
    got = asked(s)
    assert {r: len(v) for r, v in got.items()} == {1: 8, 2: 8, 3: 8}  # not the seeder: it sends each chunk once
    assert len({i for v in got.values() for i in v}) == 24
    links[3] = "1" * 62 + ".."  # chunk 63: the seeder's alone, so it still feeds the trees: help stays small
    s, _ = sched(n=64, have="1" * 16 + "." * 48, links=links, plan=(1,), window=8)
    s.set_downstream({1: 2, 2: 2, 3: 2})
    got = asked(s)
    assert len(got[1]) == 8 and sum(len(v) for r, v in got.items() if r != 1) <= HELP_WINDOW * 2


def test_a_seeder_lent_to_us_helps_in_the_end_phase_with_its_whole_window():
    # every chunk has left the seeder and the tracker lent its idle uplink to us, a peer far behind:
    # it helps as a finished partner does (without the loan it is never asked: see above)
    links = {1: "1" * 62 + "..", 2: "1" * 63 + ".", 3: "1" * 62 + ".1", 0: "1" * 64}
    s, _ = sched(n=64, have="1" * 16 + "." * 48, links=links, plan=(1,), window=8)
    s.set_downstream({1: 2, 2: 2, 3: 2}, lent=True)
    got = asked(s)
    assert {r: len(v) for r, v in got.items()} == {0: 8, 1: 8, 2: 8, 3: 8}
    assert len({i for v in got.values() for i in v}) == 32  # none asked twice
    links[3] = "1" * 62 + ".."  # chunk 63 is the seeder's alone: not the end phase yet, so no help from it
    s, _ = sched(n=64, have="1" * 16 + "." * 48, links=links, plan=(1,), window=8)
    s.set_downstream({1: 2, 2: 2, 3: 2}, lent=True)
    assert len(asked(s).get(0, [])) <= 1  # (at most the one chunk nobody else holds, as ever)


def test_a_finished_partner_is_not_judged_slow_by_the_rate_it_had_while_it_forwarded():
    # 3 delivered slowly while its uplink fed its own children; it holds every chunk now: it helps
    s, _ = sched(n=64, have="1" * 16 + "." * 48, links={1: "1" * 64, 2: "1" * 64, 3: "1" * 64}, plan=(1,), window=8)
    s.links[1].rate, s.links[2].rate, s.links[3].rate = 40e6, 40e6, 2e6
    assert 3 in asked(s)


def test_a_waiters_range_is_fetched_first():
    s, _ = sched(n=16, links={1: "1" * 16}, window=2)
    s.prioritize([12, 13])
    assert asked(s) == {1: [12, 13]}


def test_what_a_peer_waits_for_at_us_is_asked_of_our_planned_source_before_our_backlog():
    # a late arrival placed above a peer under way: that peer holds 0-11 and parks 12, 13 here; we hold
    # nothing yet, and our source everything
    s, _ = sched(n=16, links={1: "1" * 16}, window=4)
    s.awaited([12, 13])
    assert asked(s) == {1: [12, 13, 0, 1]}  # its chunks first, then our backlog from the lowest
    s.arrived(1, 12, ok=True)
    assert not s.below >> 12 & 1 and s.below >> 13 & 1  # what we hold is no longer awaited
    s.awaited([7])  # a chunk only a partner holds is not asked of a source that lacks it
    s2, _ = sched(n=16, links={1: "1" * 7 + "." * 9}, window=4)
    s2.awaited([9])
    assert asked(s2) == {1: [0, 1, 2, 3]}


def test_stripes_are_asked_of_their_own_planned_sources():
    s, _ = sched(n=8, stripes=2, plan=(1, 2), links={1: "11111111", 2: "11111111"}, window=2)
    got = asked(s)
    assert got == {1: [0, 2], 2: [1, 3]}


def test_requests_stay_bounded_by_the_windows():
    s, _ = sched(n=1000, stripes=2, plan=(1, 2), links={1: "1" * 1000, 2: "1" * 1000, 3: "1" * 1000},
                 window=8)
    for _ in range(10):
        asked(s)
    assert all(len(lk.outstanding) <= lk.window for lk in s.links.values())
    assert s.inflight.bit_count() == sum(len(lk.outstanding) for lk in s.links.values())


def test_waiting_for_names_chunks_no_partner_holds():
    s, _ = sched(n=4, have="1...", links={1: "11.."})
    assert s.waiting_for() == [2, 3]


def test_endgame_never_asks_the_seeder_for_a_duplicate():
    s, clock = sched(n=4, have="111.", links={1: "1111", 0: "1111"}, plan=(1,), window=4)
    assert asked(s) == {1: [3]}
    clock.t = 10.0
    s.stalled()
    assert asked(s) == {}


def test_a_new_plan_withdraws_a_stripe_from_its_former_source():
    s, _ = sched(n=8, stripes=2, plan=(0, 0), links={0: "11111111", 2: "1111111."}, window=4)
    assert asked(s) == {0: [0, 1, 2, 3]}
    s.set_plan([0, 2])  # stripe 1 moves to peer 2 (an adoption)
    assert s.take_cancels() == [(0, [1, 3])]
    got = asked(s)
    assert got[2][:2] == [1, 3]
    assert s.expects(0, 1)  # a copy the seeder already sent is still taken


def test_help_goes_to_the_partner_that_would_deliver_it_soonest():
    # the source (1) lags; partners 2 and 3 hold the chunks and feed nobody further: 3 delivers
    # ten times faster than 2 (an idle uplink against one busy with its children), so each chunk
    # of help goes to 3 until its help window is full, and only then to 2
    for trial in range(20):
        s, _ = sched(n=32, links={1: "11" + "." * 30, 2: "1" * 31 + ".", 3: "1" * 31 + "."}, plan=(1,), window=4)
        s.rng.seed(trial)
        s.links[2].rate, s.links[3].rate = 2e6, 20e6
        got = asked(s)
        assert len(got[3]) == HELP_WINDOW and len(got.get(2, [])) <= HELP_WINDOW
        assert len(got[3]) >= len(got.get(2, []))


def test_a_partner_the_tracker_found_slow_helps_only_where_no_fast_one_holds_the_chunks():
    # 2 was demoted (its uplink is taken by the leaf the plan gives it): 3 helps; where only 2
    # holds what the lagging source lacks, 2 helps
    for trial in range(20):
        s, _ = sched(n=32, links={1: "11" + "." * 30, 2: "1" * 31 + ".", 3: "1" * 31 + "."}, plan=(1,), window=4)
        s.rng.seed(trial)
        s.set_downstream({2: 0, 3: 0}, slow={2})
        got = asked(s)
        assert 2 not in got and 0 < len(got[3]) <= HELP_WINDOW
    s, _ = sched(n=32, links={1: "11" + "." * 30, 2: "1" * 31 + ".", 3: "1" * 2 + "." * 30}, plan=(1,), window=4)
    s.set_downstream({2: 0, 3: 0}, slow={2})
    assert 0 < len(asked(s)[2]) <= HELP_WINDOW


def test_a_stripe_fed_by_a_slow_source_is_helped_once_it_is_all_we_miss():
    # stripe 1 comes from a demoted host (2) a little ahead of us: while stripe 0 still flows, the
    # slow source keeps its share (help would take uplink the trees need); once stripe 1 is all we
    # miss, fast partners that hold it help
    n = 32
    for have in ("1" * 24 + "." * 8, "1" * 24 + "1.1.1.1."):
        mid = "1" * (n - 1) + "."  # partners mid-run (one holding every chunk is done: its whole window helps)
        s, _ = sched(n=n, stripes=2, have=have, plan=(1, 2), links={1: mid, 2: mid, 3: mid}, window=4)
        s.set_downstream({1: 0, 2: 0, 3: 0}, slow={2})
        s.links[2].window = 2  # what its measured rate gives a slow link
        got = asked(s)
        if "1" in have[24:]:
            assert 0 < len(got[3]) <= HELP_WINDOW and all(i % 2 == 1 for i in got[3])
        else:
            assert 3 not in got and got[2] == [25, 27]


def test_partners_help_a_stripe_whose_planned_source_takes_long_to_attach():
    # the plan names 1, whose link is open but has not attached (no bitfield yet): for a moment we
    # wait for it, then partner 2, which holds the stripe, helps until it attaches
    s, clock = sched(n=32, links={2: "1" * 31 + "."}, plan=(1,), window=4)
    s.add(1)
    assert asked(s) == {}
    clock.t = 1.5
    s.stalled()  # the node's timer: time alone changed what is decided
    got = asked(s)
    assert set(got) == {2} and 0 < len(got[2]) <= HELP_WINDOW
    s.ready(1, bits("1" * 31 + "."))
    assert set(asked(s)) == {1}  # attached: its share is its own again


def test_a_planned_source_whose_requests_stalled_is_helped_until_it_delivers_again():
    # 1 holds the stripe and answers nothing: once its requests stall (given back), its stripe is
    # lagging and partner 2 helps, though 1 never delivered a chunk to measure a rate on
    s, clock = sched(n=32, links={1: "1" * 31 + ".", 2: "1" * 31 + "."}, plan=(1,), window=16)
    first = asked(s)
    assert set(first) == {1}
    clock.t = 20.0
    assert dict(s.stalled())[1] == first[1]
    got = asked(s)
    assert 0 < len(got[2]) <= HELP_WINDOW
    clock.t = 20.5
    s.arrived(1, got[1][0], ok=True)  # it delivers again
    assert not s.links[1].starved


def test_requests_parked_long_at_a_source_that_lacks_them_go_to_a_partner_that_holds_them():
    # 1 (planned) lacks chunks 2 and 3 and its window of 2 waits on them; 2 holds them: after a
    # moment they are withdrawn from 1 and asked of 2, and 1's window moves on
    s, clock = sched(n=8, have="11......", links={1: "11..111.", 2: "1111111."}, plan=(1,), window=2)
    assert asked(s) == {1: [2, 3]}  # parked ahead: it will forward them when it has them
    clock.t = 1.0
    s.stalled()
    assert asked(s) == {}  # a moment: its own source is about to send them
    clock.t = 3.0
    s.stalled()
    assert sorted(asked(s)[2]) == [2, 3]
    assert sorted(dict(s.take_cancels())[1]) == [2, 3]
    assert asked(s) == {1: [4, 5]}


def test_a_stripe_fed_by_a_demoted_host_gets_help_from_every_cheap_partner():
    # stripe 1 comes from 2, which the tracker demoted (its quarter-rate uplink serves us from its
    # spare slot): that stripe needs most of its chunks from partners, so each of the cheapest
    # partners carries HELP_WINDOW requests (8 over 4 helpers), not a budget of the requester's
    # (the peer fed so finished last, two helpers at two requests while finished hosts idled)
    n = 64
    mid = "1" * (n - 1) + "."  # partners mid-run (one holding every chunk is done: its whole window helps)
    s, _ = sched(n=n, stripes=2, have="1." * 32, plan=(1, 2), links={r: mid for r in (1, 2, 3, 4, 5)}, window=4)
    s.set_downstream({r: 0 for r in (1, 2, 3, 4, 5)}, slow={2})
    for r in (1, 3, 4, 5):
        s.links[r].rate = 10e6
    s.links[2].rate, s.links[2].window = 1e6, 2
    got = asked(s)
    helped = [i for r in (1, 3, 4, 5) for i in got.get(r, [])]  # stripe 0 is complete: all of it is help
    assert len(helped) == HELP_WINDOW * 4 and all(i % 2 == 1 for i in helped)
    assert all(len(got.get(r, [])) == HELP_WINDOW for r in (1, 3, 4, 5))
    assert len(got[2]) == 2 and all(i % 2 == 1 for i in got[2])  # its own share, within its window


def test_the_command_line_s_first_window_is_the_scheduler_s():
    from p2pweights.cli import flags
    from p2pweights.swarm.policy.pull import DEFAULT_WINDOW

    assert flags.FIRST_WINDOW == DEFAULT_WINDOW  # the CLI's --window default


def test_a_have_of_chunks_held_or_asked_already_decides_nothing_again_one_offering_more_does():
    s, _ = sched(n=8, window=2, links={1: "11111111", 2: "........"}, plan=(1,))
    first = asked(s)[1]
    assert len(first) == 2
    s.has(2, first)  # in flight at the planned source already: nothing to decide
    assert not s.dirty and s.requests() == []
    assert s.links[2].held == 2 and s.holders[first[0]] == 2  # counted all the same
    other = next(i for i in range(8) if i not in first)
    s.has(2, [other])  # a chunk still to ask: decide again
    assert s.dirty
    s.requests()
    s.has(2, [i for i in range(8) if i not in first and i != other])  # it completes: decide again
    assert s.dirty


def test_chunks_read_back_to_back_after_a_pause_measure_what_the_link_delivered_meanwhile():
    # a link delivering 10 MB/s; this process pauses 0.9 s while 9 chunks land in its socket, then
    # reads them 0.1 ms apart: one sample spans the pause, 8 take a fraction of a millisecond. An
    # average of per-chunk rates read about 3,000 MB/s (a fleet median of 125-339 MB/s on 50 MB/s
    # uplinks demoted honest hosts); bytes over time asked read what the link delivered
    s, clock = sched(n=32, links={1: "1" * 32}, window=32)
    asked(s)
    for i in range(8):
        clock.t += CHUNK / 10e6
        s.arrived(1, i, ok=True)
    clock.t += 0.9
    for i in range(8, 17):
        s.arrived(1, i, ok=True)
        clock.t += 0.0001
    assert 8e6 < s.links[1].rate < 13e6
    for i in range(17, 32):  # it goes on at a quarter of that: the rate follows within a few chunks
        clock.t += CHUNK / 2.5e6
        s.arrived(1, i, ok=True)
        if i == 20:
            assert s.links[1].rate < 5e6
    assert s.links[1].rate == pytest.approx(2.5e6, rel=0.1)


def test_a_parked_chunk_read_with_its_have_after_a_pause_does_not_inflate_the_link_s_rate():
    # a link delivering 10 MB/s (1 MiB every ~0.1 s); a chunk parked there is named in a HAVE and
    # arrives with it after a pause of this process (a fraction of a millisecond later): no sample
    # (alone it read 2,000 MB/s); a parked chunk that takes a chunk-time after its HAVE is measured
    s, clock = sched(n=16, links={1: "1111" + "." * 12}, window=8)
    asked(s)
    for i in range(4):
        clock.t += CHUNK / 10e6
        s.arrived(1, i, ok=True)
    steady = s.links[1].rate
    assert 8e6 < steady < 12e6 and 4 in s.links[1].outstanding  # 4, 5 parked ahead of what it holds
    clock.t += 0.5
    s.has(1, [4])
    clock.t += 0.0005
    s.arrived(1, 4, ok=True)
    assert s.links[1].rate == steady
    s.has(1, [5])
    clock.t += CHUNK / 20e6
    s.arrived(1, 5, ok=True)
    assert steady < s.links[1].rate < 20e6
