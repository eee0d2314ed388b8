"""The pull policy's rules one at a time: a state built from short strings, each judgement asserted
(``swarm/policy/help.py``: which chunks, who, how many; ``swarm/policy/pickrules.py``: waiters, the planned share,
the endgame).  ``tests/test_pull.py`` asserts what the rules decide together."""
from test_pull import sched

from p2pweights.swarm.policy import help as h
from p2pweights.swarm.policy import pickrules as p


def state(**kw):
    """``test_pull.sched``, with what a pick may take set as ``requests`` sets it."""
    s, clock = sched(**kw)
    s.avail = s.wanted()
    return s, clock


def mask(text: str) -> int:
    """'1.1.' -> 0b0101 (chunk i is bit i)."""
    return sum(1 << i for i, c in enumerate(text) if c == "1")


# ----- which chunks: why a planned source lags ---------------------------------

def test_a_stripe_without_a_planned_source_is_gone():
    assert h.lag(state(plan=(None,))[0], 0) == h.GONE
    assert h.lag(state(plan=(5,))[0], 0) == h.GONE  # named, never linked (or given up)


def test_a_planned_source_still_attaching_lags_only_after_attach_patience():
    s, clock = state(n=32, links={2: "1" * 32}, plan=(1,))
    s.add(1)
    assert h.lag(s, 0) is None
    clock.t = h.ATTACH_PATIENCE + 0.1
    assert h.lag(s, 0) == h.UNATTACHED


def test_a_healthy_source_a_little_behind_its_partners_keeps_up():
    s, _ = state(n=32, have="1" * 24 + "." * 8, links={1: "1" * 28 + "....", 2: "1" * 31 + "."})
    assert h.lag(s, 0) is None


def test_a_source_lacking_more_than_lag_chunks_of_what_partners_hold_lacks():
    s, _ = state(n=32, links={1: "11" + "." * 30, 2: "1" * 31 + "."})
    assert h.lag(s, 0) == h.LACKS
    s, _ = state(n=32, links={1: "11" + "." * 30, 0: "1" * 32})
    assert h.lag(s, 0) is None  # what only the seeder holds does not count


def test_a_source_holding_more_than_two_windows_we_lack_is_ahead():
    s, _ = state(n=32, window=2, links={1: "1" * 32})
    assert h.lag(s, 0) == h.AHEAD
    s, _ = state(n=32, window=2, have="1" * 28 + "....", links={1: "1" * 32})
    assert h.lag(s, 0) is None


def test_a_source_well_below_the_other_links_is_slow():
    s, _ = state(n=32, links={1: "1" * 8 + "." * 24, 2: "1" * 8 + "." * 24, 3: "1" * 8 + "." * 24})
    s.links[1].rate, s.links[2].rate, s.links[3].rate = 2e6, 10e6, 10e6
    assert h.lag(s, 0) == h.SLOW
    s.links[1].rate = 4e6
    assert h.lag(s, 0) is None


def test_a_source_whose_requests_stalled_is_starved():
    s, _ = state(n=32, links={1: "1" * 8 + "." * 24})
    s.links[1].starved = True
    assert h.lag(s, 0) == h.STARVED


def test_a_demoted_source_lags_once_its_stripe_is_all_we_miss():
    links = {1: "1" * 8, 2: "1" * 8}
    s, _ = state(n=8, stripes=2, plan=(1, 2), have="1.1.....", links=links)
    s.set_downstream({}, slow={2})
    assert h.lag(s, 1) is None  # stripe 0 still flows: the slow source keeps its share
    s, _ = state(n=8, stripes=2, plan=(1, 2), have="1.1.1.1.", links=links)
    s.set_downstream({}, slow={2})
    assert h.lag(s, 1) == h.DEMOTED


def test_requests_parked_long_at_a_source_that_lacks_them_are_stuck_if_a_partner_holds_them():
    s, clock = state(n=8, have="11......", links={1: "11..111.", 2: "111....."}, window=2)
    s.requests()
    src = s.links[1]
    assert p.planned_mask(s, 1) == mask("11..1111") and h.parked(s, src) == mask("..11")  # (held ones: ``avail``)
    clock.t = h.STALL_MIN + 0.1
    assert h.stuck(s, src) == mask("..1")  # chunk 3: no partner holds it, it waits at its source


def test_the_end_phase_is_when_every_chunk_we_miss_is_at_a_partner():
    assert h.end_phase(state(n=4, have="11..", links={1: "1.1.", 2: "...1"})[0])
    assert not h.end_phase(state(n=4, have="11..", links={1: "1.1.", 0: "1111"})[0])  # the seeder's alone
    assert not h.end_phase(state(n=4, have="1111", links={1: "1111"})[0])


def test_help_mask_is_every_missing_chunk_of_a_lagging_stripe_and_marks_a_gone_one_orphaned():
    s, _ = state(n=8, stripes=2, plan=(None, 1), links={1: "1......."})
    assert h.help_mask(s) == (mask("1.1.1.1."), mask("1.1.1.1."))  # stripe 1's source keeps up with us
    s, _ = state(n=8, stripes=2, plan=(None, 1), links={1: "1......1", 2: ".111111."})
    assert h.help_mask(s) == (mask("11111111"), mask("1.1.1.1."))  # the end phase: every stripe
    s, _ = state(n=8, stripes=2, plan=(1, 1), links={1: "1111111.", 0: "11111111"}, window=8)
    assert h.help_mask(s) == (0, 0)  # a healthy source, chunk 7 still the seeder's alone: nothing for partners


# ----- who helps ---------------------------------------------------------------

def test_cost_is_slowness_then_peers_fed_downstream():
    s, _ = state(n=8, links={1: "1" * 8, 2: "1" * 7 + ".", 3: "1" * 7 + "."})
    s.set_downstream({2: 3, 3: 1}, slow={3})
    assert h.cost(s, s.links[2], 0.0) == (False, 3)
    assert h.cost(s, s.links[3], 0.0) == (True, 1)  # demoted by the tracker
    s.links[2].rate = 1e6
    assert h.cost(s, s.links[2], 10e6) == (True, 3)  # below SLOW_HELPER of the typical link
    s.links[1].rate = 1e6
    assert h.cost(s, s.links[1], 10e6) == (False, 0)  # complete: its children keep up, its old rate not judged


def test_the_soonest_to_deliver_is_the_idle_fast_one():
    s, _ = state(n=8, links={1: "1" * 8, 2: "1" * 8})
    s.links[1].rate, s.links[2].rate = 10e6, 10e6
    s.links[1].outstanding = {0: 0.0, 1: 0.0}
    assert h.eta(s.links[2], 0.0) < h.eta(s.links[1], 0.0)
    assert h.eta(s.links[2], 0.0) == 1 / 10e6


def test_the_cheapest_bar_is_set_by_holders_with_credit_the_seeder_aside():
    s, _ = state(n=8, links={0: "1" * 8, 2: "1" * 7 + ".", 3: "......1."})
    s.set_downstream({0: 0, 2: 4, 3: 1})
    ready = list(s.links.values())
    assert h.cheapest(s, ready, mask("1......."), 0.0) == (False, 4)  # only 2 holds it (the seeder never sets it)
    assert h.cheapest(s, ready, mask("......1."), 0.0) == (False, 1)
    s.links[3].window = 0
    assert h.cheapest(s, ready, mask("......1."), 0.0) == (False, 4)  # no credit free: no bar


def test_helpers_are_the_cheapest_holders_never_a_stripe_root():
    s, _ = state(n=32, links={1: "11" + "." * 30, 2: "1" * 31 + ".", 3: "1" * 31 + "."})
    ready = list(s.links.values())
    s.set_downstream({2: 6, 3: 0})
    assert {lk.rank for lk in h.helpers(s, ready, mask("..1"), 0.0)} == {1, 3}  # 1 too: as cheap (it lacks them)
    s.set_downstream({2: 3, 3: 3})  # the holders feed more than HELP_DOWNSTREAM: none of them helps
    assert {lk.rank for lk in h.helpers(s, ready, mask("..1"), 0.0)} == {1}  # (1 holds none: it picks nothing)


def test_in_the_end_phase_the_seeder_helps_only_when_lent():
    s, _ = state(n=8, have="1111....", links={0: "1" * 8, 2: "1" * 8})
    s.ending = True
    ready = list(s.links.values())
    assert {lk.rank for lk in h.helpers(s, ready, mask("....1111"), 0.0)} == {2}
    s.set_downstream({}, lent=True)
    s.ending = True
    assert {lk.rank for lk in h.helpers(s, ready, mask("....1111"), 0.0)} == {0, 2}


# ----- how many ----------------------------------------------------------------

def test_the_budget_is_a_help_window_per_planned_source_less_what_is_in_flight():
    s, _ = state(n=8, stripes=2, plan=(1, 2), links={1: "1" * 8, 2: "1" * 8, 3: "1" * 8})
    cands = [s.links[3]]
    assert h.budget(s, cands, {1: 0, 2: 0, 3: 0}) == 2 * h.HELP_WINDOW
    assert h.budget(s, cands, {1: 0, 2: 0, 3: 1}) == 2 * h.HELP_WINDOW - 1


def test_a_demoted_planned_source_gets_a_help_window_from_every_candidate():
    s, _ = state(n=8, stripes=2, plan=(1, 2), links={r: "1" * 8 for r in (1, 2, 3, 4, 5, 6)})
    s.set_downstream({}, slow={2})
    cands = [s.links[r] for r in (3, 4, 5, 6)]
    zero = {r: 0 for r in s.links}
    assert h.budget(s, cands, zero) == 4 * h.HELP_WINDOW  # not 3: one planned source twice
    assert h.budget(s, cands[:1], zero) == 3 * h.HELP_WINDOW


def test_in_the_end_phase_each_candidate_adds_its_free_window():
    s, _ = state(n=8, window=4, links={1: "1" * 8, 2: "1" * 8, 3: "1" * 8})
    s.ending = True
    assert h.budget(s, [s.links[2], s.links[3]], {1: 0, 2: 0, 3: 0}) == h.HELP_WINDOW + 8


def test_help_goes_one_chunk_at_a_time_to_the_soonest_within_its_help_window():
    s, _ = state(n=32, links={1: "11" + "." * 30, 2: "1" * 31 + ".", 3: "1" * 31 + "."})
    s.links[2].rate, s.links[3].rate = 2e6, 20e6
    out = {}
    h.help_lagging(s, [s.links[2], s.links[3]], mask("..1111111111"), 0.0, out)
    assert list(out) == [3] and len(out[3]) == h.HELP_WINDOW  # the budget: one planned source
    assert s.links[3].helping == set(out[3])


# ----- waiters, the planned share, the endgame -----------------------------------

def test_waiters_are_asked_first_of_any_holder_lowest_first():
    s, _ = state(n=16, window=2, links={1: "1" * 8 + "." * 8, 2: "1" * 16})
    s.prioritize([12, 13, 14])
    out = {}
    p.waiters(s, list(s.links.values()), out)
    assert out == {2: [12, 13]}  # 1 holds none of them; 2's window is two


def test_a_planned_share_parks_park_ahead_chunks_beyond_what_the_source_holds():
    s, _ = state(n=8, window=8, links={1: "11......"})
    out = {}
    p.planned_share(s, list(s.links.values()), 0, 0.0, out)
    assert out == {1: [0, 1, 2, 3]} and p.PARK_AHEAD == 2


def test_a_partner_that_plans_none_of_ours_shares_an_orphaned_stripe_a_few_at_a_time():
    s, _ = state(n=32, window=8, plan=(None,), links={2: "1" * 31 + "."})
    assert p.share_of(s, s.links[2], s.full, (False, 0), 0.0) == (s.links[2].holds, p.SHARE_WINDOW)
    s.set_downstream({2: 1})
    assert p.share_of(s, s.links[2], s.full, (False, 0), 0.0)[1] == 0  # dearer than the bar: none
    assert p.share_of(s, s.links[2], 0, (False, 0), 0.0) == (None, 8)  # nothing orphaned: nothing to share


def test_the_seeder_serves_an_orphaned_chunk_once_no_partner_held_it_for_seeder_patience():
    s, clock = state(n=4, plan=(None,), links={0: "1111", 2: "11.."})
    assert p.seeder_share(s, mask("1111")) == 0
    clock.t = p.SEEDER_PATIENCE
    assert p.seeder_share(s, mask("1111")) == mask("..11")


def test_the_endgame_asks_a_second_holder_only_for_an_overdue_request_never_of_the_seeder():
    s, clock = state(n=4, have="11..", links={1: "1111", 2: "1111", 0: "1111"})
    s.requests()
    ready = list(s.links.values())
    out = {}
    p.endgame(s, ready, out)
    assert out == {}  # not overdue
    clock.t = 10.0
    p.endgame(s, ready, out)
    assert out == {2: [2, 3]} and s.asked[2] == {1, 2}
    assert len(out[2]) <= p.ENDGAME_PER_LINK


def test_the_endgame_waits_while_many_chunks_are_missing():
    s, clock = state(n=32, links={1: "1" * 32, 2: "1" * 32})
    s.requests()
    clock.t = 100.0
    out = {}
    p.endgame(s, list(s.links.values()), out)
    assert out == {}
