"""The seeder's tracker endpoint alone: members' messages in, the messages to send out, no sockets."""
import logging

import pytest

from p2pweights.wire import protocol
from p2pweights.sources.chunker import build
from p2pweights.swarm.tracker.endpoint import REVIEW_INTERVAL, TrackerEndpoint
from p2pweights.wire.protocol import YOUNG, Msg, ProtocolError
from p2pweights.swarm.tracker.topology import make
from p2pweights.swarm.tracker.tracker import SLOW_EVIDENCE, Tracker


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def manifest(tmp_path):
    (tmp_path / "m.bin").write_bytes(bytes(range(256)) * 4096)
    return build(str(tmp_path / "m.bin"), chunk_size=64 << 10)[0]


def endpoint(manifest, plan="forest:2"):
    clock = Clock()
    return TrackerEndpoint(Tracker(make(plan), "10.0.0.0:7420", clock=clock), manifest, clock), clock


def sent(ep) -> list[tuple[bytes, protocol.Event]]:
    return [(ident, protocol.decode(frames)) for ident, frames in ep.take()]


def join(ep, n):
    return [x for i in range(1, n + 1) for x in join_one(ep, i)]


def join_one(ep, i):
    assert ep.hello(f"id{i}".encode(), {"peer_id": f"p{i}", "listen": f"10.0.0.{i}:7000"})
    return sent(ep)


def test_hello_is_welcomed_with_rank_plan_partners_and_the_manifest(manifest):
    ep, _ = endpoint(manifest)
    out = join(ep, 3)
    welcomes = [(i, e) for i, e in out if e.type == Msg.WELCOME]
    assert [i for i, _ in welcomes] == [b"id1", b"id2", b"id3"]
    ranks = [e.fields["rank"] for _, e in welcomes]
    assert ranks == [1, 2, 3] and all(e.fields["stripes"] == 2 for _, e in welcomes)
    assert welcomes[0][1].payload is not None  # the manifest rides along
    first = welcomes[0][1].fields["parents"]  # the first joiner: the seeder in both stripes
    assert [(p["rank"], p["addr"], p["stripe"]) for p in first] == [(0, "10.0.0.0:7420", 0), (0, "10.0.0.0:7420", 1)]
    assert all(len(e.fields["parents"]) == 2 for _, e in welcomes)


def test_a_joiner_wanting_another_model_is_refused_and_not_placed(manifest):
    ep, _ = endpoint(manifest)
    assert not ep.hello(b"x", {"peer_id": "p", "listen": "10.0.0.9:7000", "model_id": "ff" * 32})
    [(ident, e)] = sent(ep)
    assert ident == b"x" and e.type == Msg.ERROR and e.fields["fatal"] and "model id mismatch" in e.fields["message"]
    assert ep.tracker.members == {}


def test_an_overlong_name_is_a_protocol_error(manifest):
    ep, _ = endpoint(manifest)
    with pytest.raises(ProtocolError):
        ep.hello(b"x", {"peer_id": "p" * 10_000, "listen": "10.0.0.9:7000"})


def test_a_member_gone_re_places_whoever_it_fed_and_tells_them(manifest):
    ep, _ = endpoint(manifest)
    join(ep, 8)
    fed = {r for r, m in ep.tracker.members.items() if 1 in m.parents}
    assert fed
    ep.bye(b"id1")
    told = {ident for ident, e in sent(ep) if e.type == Msg.REPARENT}
    assert {f"id{r}".encode() for r in fed} <= told
    assert all(1 not in m.parents for r, m in ep.tracker.members.items() if r != 1)


def test_orphan_from_a_member_moves_it_and_the_log_names_the_outcome(manifest, caplog):
    ep, _ = endpoint(manifest)
    join(ep, 8)
    child, stripe = next((r, s) for r, m in ep.tracker.members.items() for s, p in enumerate(m.parents)
                         if p not in (0, None))
    parent = ep.tracker.members[child].parents[stripe]
    with caplog.at_level(logging.INFO, logger="p2pw"):
        ep.orphan(f"id{child}".encode(), {"rank": child, "stripe": stripe, "parent": parent,
                                          "reason": "silent", "dead": True})
    assert ep.tracker.members[parent].left
    assert parent not in ep.tracker.members[child].parents
    line = next(r.getMessage() for r in caplog.records if "lost parent" in r.getMessage())
    assert f"rank {child} lost parent rank {parent} in stripe {stripe} (silent)" in line
    assert "now under rank" in line or "partners share" in line


def test_orphan_for_someone_else_or_a_missing_stripe_is_refused(manifest):
    ep, _ = endpoint(manifest)
    join(ep, 3)
    with pytest.raises(ProtocolError):
        ep.orphan(b"id2", {"rank": 3, "stripe": 0, "parent": 1, "reason": "x"})
    with pytest.raises(ProtocolError):
        ep.orphan(b"id2", {"rank": 2, "stripe": 7, "parent": 1, "reason": "x"})


def test_heartbeats_with_a_slow_forwarder_demote_it_after_repeated_reviews(manifest):
    ep, clock = endpoint(manifest)
    join(ep, 8)
    f = ep.tracker.topology
    slow = next(r for r in range(1, 9) if f.kids[f.group[r]][r])
    for _ in range(SLOW_EVIDENCE):
        for r, m in ep.tracker.members.items():
            links = {str(p): (1e6 if p == slow else 40e6) for p in set(m.parents) | set(m.partners) if p}
            ep.heartbeat(f"id{r}".encode(), {"have": 1, "links": links})
        clock.t += REVIEW_INTERVAL
        ep.review()
    assert ep.tracker.members[slow].demoted
    assert any(e.type == Msg.REPARENT for _, e in sent(ep))
    m = ep.tracker.members[1]
    a, b = m.partners[:2]
    stranger = next(r for r in range(2, 9) if r not in (*m.parents, *m.partners))
    ep.heartbeat(b"id1", {"have": 3, "links": {str(a): 5e6, str(stranger): 9e9},
                          "got": {str(a): 4e6, str(b): 1e6, str(stranger): 9e9, "0": float("nan")}})
    # rates count only of its own links, and only finite ones
    assert (m.have, m.rates, m.delivered) == (3, {a: 5e6}, {a: 4e6, b: 1e6})
    for garbage in ({"links": {"x": "y"}}, {"got": {"2": "fast"}}, {"got": {"two": 1.0}}):
        with pytest.raises(ProtocolError):
            ep.heartbeat(b"id1", garbage)


def test_rates_are_reviewed_twice_as_often_for_a_while_after_a_join(manifest):
    # a slow first joiner is a stripe's root until a review sees its children's rates: in the
    # joiners' first seconds (they report twice as often then) the tracker looks twice as often
    ep, clock = endpoint(manifest)
    ep.review()
    assert ep.next_review == REVIEW_INTERVAL  # nobody joined yet
    clock.t = 1.0
    join(ep, 2)
    ep.review()
    assert ep.next_review == clock.t + REVIEW_INTERVAL / 2
    clock.t = 1.0 + YOUNG
    ep.review()
    assert ep.next_review == clock.t + REVIEW_INTERVAL


def test_leave_waits_for_dependents_and_is_let_go_when_the_last_is_done(manifest):
    ep, clock = endpoint(manifest)
    join(ep, 4)
    fed = sorted(r for r, m in ep.tracker.members.items() if 1 in m.parents)
    assert fed
    ep.leave(b"id1", {})
    [(ident, e)] = sent(ep)
    assert ident == b"id1" and e.type == Msg.LEAVE_WAIT and sorted(e.fields["waiting_for"]) == fed
    others = [r for r in range(2, 5) if r not in fed]
    for r in others + fed[:-1]:
        ep.done(f"id{r}".encode(), {})
        assert not [x for x in sent(ep) if x[1].type == Msg.LEAVE_OK]  # someone still pulls from rank 1
    ep.done(f"id{fed[-1]}".encode(), {})
    assert [(i, e.type) for i, e in sent(ep) if e.type == Msg.LEAVE_OK] == [(b"id1", Msg.LEAVE_OK)]
    assert ep.tracker.members[1].left and not ep.leaving
    clock.t += 1.0
    assert ep.publish(clock.t) is not None
    ep.status(b"anyone", {})
    [(ident, e)] = sent(ep)
    assert ident == b"anyone" and e.type == Msg.STATUS_REPLY and e.fields["peers"] == 4


def test_status_right_after_a_change_shows_it(manifest):
    # a user runs p2pw status the moment a join exits: the reply is taken now, not up to a snapshot
    # interval old (it showed the peer waiting at 0 %)
    ep, clock = endpoint(manifest)
    join(ep, 2)
    assert ep.publish(clock.t + 1.0) is not None  # a snapshot of two peers waiting
    clock.t += 1.01  # 10 ms later: the next snapshot would be due 90 ms on
    ep.done(b"id1", {})
    ep.status(b"anyone", {})
    [(_, e)] = [x for x in sent(ep) if x[1].type == Msg.STATUS_REPLY]
    assert [(p.rank, p.state) for p in ep.fleet.peers] == [(2, "waiting"), (1, "done")]


def test_a_member_waiting_to_leave_is_let_go_when_its_dependent_disconnects(manifest):
    ep, _ = endpoint(manifest)
    join(ep, 4)
    fed = sorted(r for r, m in ep.tracker.members.items() if 1 in m.parents)
    for r in range(2, 5):
        if r != fed[0]:
            ep.done(f"id{r}".encode(), {})
    sent(ep)  # (each done peer was lent to the peers furthest behind: they were told, REPARENT)
    ep.leave(b"id1", {})
    assert [e.type for _, e in sent(ep)] == [Msg.LEAVE_WAIT]
    ep.bye(f"id{fed[0]}".encode())  # its connection is gone: nobody depends on rank 1 any more
    assert (b"id1", Msg.LEAVE_OK) in [(i, e.type) for i, e in sent(ep)]


def test_a_member_waiting_to_leave_is_let_go_when_a_plan_change_moves_its_dependent(manifest):
    ep, _ = endpoint(manifest)
    join(ep, 8)
    leaver, (dep, stripe) = next((x, (r, s)) for x in range(1, 9) for r, m in ep.tracker.members.items()
                                 for s, p in enumerate(m.parents)
                                 if p == x and r not in ep.tracker.members[x].partners)
    for r in ep.tracker.members:
        if r not in (dep, leaver):
            ep.done(f"id{r}".encode(), {})
    sent(ep)
    ep.leave(f"id{leaver}".encode(), {})
    assert [e.type for _, e in sent(ep)] == [Msg.LEAVE_WAIT]
    ep.orphan(f"id{dep}".encode(), {"rank": dep, "stripe": stripe, "parent": leaver, "reason": "slow"})
    assert leaver not in ep.tracker.members[dep].parents
    assert (f"id{leaver}".encode(), Msg.LEAVE_OK) in [(i, e.type) for i, e in sent(ep)]


def test_a_done_member_waits_to_leave_while_a_partner_still_misses_chunks(manifest):
    # the last peers to finish take their backlog from every finished partner at once: a partner
    # that left would leave them one planned source
    ep, _ = endpoint(manifest)
    join(ep, 8)
    leaver = 1
    partner = ep.tracker.members[leaver].partners[0]
    for r in ep.tracker.members:
        if r != partner:
            ep.done(f"id{r}".encode(), {})
    sent(ep)
    ep.leave(f"id{leaver}".encode(), {})
    [(_, e)] = sent(ep)
    assert e.type == Msg.LEAVE_WAIT and e.fields["waiting_for"] == [partner]
    ep.done(f"id{partner}".encode(), {})
    assert (f"id{leaver}".encode(), Msg.LEAVE_OK) in [(i, e.type) for i, e in sent(ep)]


def probed(ep, rank, rate, took=0.05, alone=True):
    ep.probe(f"id{rank}".encode(), {"rate": rate, "took": took, "alone": alone})


def test_probes_time_each_joiner_s_uplink_and_a_slow_one_is_a_leaf_at_once(manifest, caplog):
    # WELCOME asks each joiner to time its uplink against the seeder's probe sink; each reports
    # the rate its kernel measured, and the slow host is demoted and the peers it fed are told
    from p2pweights.swarm.tracker.tracker import PROBE_BYTES

    ep, clock = endpoint(manifest)
    ep.probe_port = 7421
    welcomes = []
    slow = 5  # placed as a leaf: it feeds nobody when its probe arrives (4 and 6 adopt one at once)
    for r in range(1, 7):
        welcomes += join_one(ep, r)
        with caplog.at_level(logging.WARNING, logger="p2pw"):
            probed(ep, r, 13e6 if r == slow else 55e6, took=0.08 if r == slow else 0.02)
    assert [e.fields["uplink_probe"] for _, e in welcomes if e.type == Msg.WELCOME] == [
        {"port": 7421, "bytes": PROBE_BYTES}] * 6
    assert [r for r, m in ep.tracker.members.items() if m.demoted] == [slow]
    assert f"rank {slow} sent its probe at" in caplog.text and "becomes a leaf" in caplog.text
    told = {ident for ident, e in welcomes + sent(ep) if e.type == Msg.REPARENT}
    assert told  # whoever it fed, or partnered, learns its new place
    with pytest.raises(ProtocolError):
        ep.probe(b"stranger", {"rate": 1e6, "took": 0.1})


def test_a_probe_alone_on_the_uplink_judges_a_host_with_children_and_one_beside_forwarding_not(manifest):
    # everyone joined before any probe came in; each says whether it forwarded chunks while probing
    for alone, demoted in ((True, True), (False, False)):
        ep, _ = endpoint(manifest)
        ep.probe_port = 7421
        join(ep, 6)
        slow = next(r for r in range(1, 7) if any(ep.tracker.topology.load(r, s) for s in range(2)))
        for r in range(1, 7):
            probed(ep, r, 13e6 if r == slow else 55e6, alone=alone or r != slow)
        assert [r for r, m in ep.tracker.members.items() if m.demoted] == ([slow] if demoted else [])


def test_a_short_probe_counts_in_the_median_but_demotes_nobody_and_a_garbage_one_is_refused(manifest):
    # a probe that took under PROBE_MIN_TIME is timed to the kernel's jiffies: it proves nothing slow
    from p2pweights.swarm.tracker.tracker import PROBE_MIN_TIME

    ep, _ = endpoint(manifest)
    ep.probe_port = 7421
    join(ep, 4)
    for r in (1, 2, 3):
        probed(ep, r, 55e6)
    probed(ep, 4, 10e6, took=PROBE_MIN_TIME / 2)
    assert len(ep.tracker.probes) == 4 and not any(m.demoted for m in ep.tracker.members.values())
    for bad in ({"rate": -1, "took": 0.1}, {"rate": float("nan"), "took": 0.1}, {"rate": 1e6, "took": -1},
                {"rate": 1e20, "took": 0.1}):
        with pytest.raises(ProtocolError):
            ep.probe(b"id1", bad)


def test_a_seeder_without_a_probe_sink_asks_no_joiner_for_a_probe(manifest):
    ep, _ = endpoint(manifest)
    assert not any("uplink_probe" in e.fields for _, e in join(ep, 3))


def test_the_first_peer_done_lends_the_seeder_to_the_peers_furthest_behind_until_its_budget_is_sent(manifest):
    # a peer that is done holds every chunk, so every chunk has left the seeder: its uplink idles
    # from then on, unless lent to the peers with the fewest chunks that do not pull from it by plan
    from p2pweights.swarm.tracker.tracker import ROOT_LOAN_SHARE, ROOT_LOANS

    ep, _ = endpoint(manifest)
    join(ep, 8)
    for r in range(1, 9):
        ep.heartbeat(f"id{r}".encode(), {"have": 10 * r})
    sent(ep)
    ep.done(b"id8", {})
    told = {i: e.fields["partners"] for i, e in sent(ep) if e.type == Msg.REPARENT}
    behind = [r for r in range(1, 8) if 0 not in ep.tracker.members[r].parents][:ROOT_LOANS]
    assert len(behind) == ROOT_LOANS and ep.tracker.loan.to == behind
    root = {"rank": 0, "addr": "10.0.0.0:7420", "lent": True}
    assert all(root in [{k: v for k, v in p.items() if k != "ticket"} for p in told[f"id{r}".encode()]]
               for r in behind)
    ep.done(b"id7", {})  # lent once only
    assert ep.tracker.loan.to == behind
    sent(ep)
    ep.review(sent=manifest.n_chunks)  # one copy sent: the budget (its share beyond it) is not spent
    assert ep.tracker.loan.to == behind
    ep.review(sent=int(manifest.n_chunks * (1 + ROOT_LOAN_SHARE)) + 1)
    told = {i: e.fields["partners"] for i, e in sent(ep) if e.type == Msg.REPARENT}
    assert ep.tracker.loan.to == [] and not any(p.get("lent") for r in behind for p in told[f"id{r}".encode()])


def test_a_leave_s_linger_zero_lets_a_done_member_go_without_waiting_for_partners(manifest):
    ep, _ = endpoint(manifest)
    join(ep, 8)
    members = ep.tracker.members
    leaver, partner = next((r, p) for r in members for p in members[r].partners if r not in members[p].parents)
    for r in ep.tracker.members:
        if r != partner:
            ep.done(f"id{r}".encode(), {})
    sent(ep)
    ep.leave(f"id{leaver}".encode(), {"rank": leaver, "linger": 0})  # ``p2pw join --linger 0``
    assert (f"id{leaver}".encode(), Msg.LEAVE_OK) in [(i, e.type) for i, e in sent(ep)]  # (its partners told)
    assert ep.tracker.members[leaver].linger == 0 and ep.tracker.members[leaver].left
