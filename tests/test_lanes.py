"""Lanes (``swarm.node.lanes``): more connections from one partner, so its chunks ride several libzmq I/O threads.

The serving side's rules alone (pure); a real seeder taking, refusing and
dropping lanes that a ``hostile.Stranger`` opens; joins pulling over lanes as
processes, byte-exact, with corrupt chunks fetched again and never forwarded.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from conftest import forwarding_joins
from hostile import Stranger
from test_cli_input import assert_usage_error, run
from test_workers import where  # noqa: F401  (the disk and tmpfs fixture)

from p2pweights.api import seed
from p2pweights.swarm.node.handlers import Child
from p2pweights.swarm.node.lanes import MAX_LANES, Lanes
from p2pweights.wire import protocol
from p2pweights.wire.context import default_lanes
from p2pweights.wire.protocol import Msg

CHUNK = 64 << 10


# ----- the serving side's rules ---------------------------------------------------------------

def test_a_lane_binds_only_to_a_child_attached_as_that_rank_and_peer_from_its_address():
    lanes = Lanes(max_lanes=3)
    children = {b"a": Child("p", 1), b"b": Child("q", 2), b"c": Child("p", 1)}  # p attached twice: c is the latest
    assert lanes.child_of(children, 1, "p") == b"c"
    assert lanes.child_of(children, 1, "q") is None and lanes.child_of(children, 3, "p") is None
    assert "not attached" in lanes.refusal(None, 1, same_host=True)
    assert "another address" in lanes.refusal(b"c", 1, same_host=False)
    assert lanes.refusal(b"c", 1, same_host=True) is None


def test_a_child_pulls_over_at_most_max_lanes_connections():
    lanes = Lanes(max_lanes=3)
    for number in (0, 3, 99):  # lane numbers run from 1 to max_lanes - 1
        assert "at most 3" in lanes.refusal(b"c", number, same_host=True)
    lanes.add(b"c", b"l1")
    lanes.add(b"c", b"l2")
    assert lanes.count(b"c") == 3 and "at most 3" in lanes.refusal(b"c", 1, same_host=True)
    assert lanes.refusal(b"other", 1, same_host=True) is None  # per child


def test_chunks_go_round_robin_over_a_childs_link_and_lanes_passing_a_full_one():
    lanes = Lanes()
    assert list(lanes.order(b"c")) == [b"c"]  # no lanes: its link
    lanes.add(b"c", b"l1")
    lanes.add(b"c", b"l2")
    sent = []
    for _ in range(6):
        path = lanes.order(b"c")[0]
        lanes.took(b"c", path)
        sent.append(path)
    assert sent == [b"c", b"l1", b"l2"] * 2
    order = lanes.order(b"c")
    assert order == [b"c", b"l1", b"l2"]
    lanes.took(b"c", order[1])  # its link was full: the chunk went on l1, so l2 is next
    assert lanes.order(b"c") == [b"l2", b"c", b"l1"]


def test_a_dropped_lane_takes_only_itself_a_dropped_link_takes_its_lanes():
    lanes = Lanes()
    for lane in (b"l1", b"l2"):
        lanes.add(b"c", lane)
    assert lanes.drop(b"l1") == [] and lanes.order(b"c") == [b"c", b"l2"]
    assert lanes.is_lane(b"l2") and not lanes.is_lane(b"l1")
    assert lanes.drop(b"c") == [b"l2"]
    assert not lanes.is_lane(b"l2") and lanes.order(b"c") == (b"c",) and lanes.paths == {} and lanes.next == {}


def test_default_lanes_one_per_io_thread_or_the_environment(monkeypatch):
    monkeypatch.delenv("P2PW_LANES", raising=False)
    assert [default_lanes(n) for n in (1, 2, 4, 8)] == [1, 2, 4, 8]
    monkeypatch.setenv("P2PW_LANES", "3")
    assert default_lanes(1) == 3
    monkeypatch.setenv("P2PW_LANES", "0")
    assert default_lanes(4) == 1
    monkeypatch.setenv("P2PW_LANES", "many")
    assert default_lanes(2) == 2


def test_lanes_must_be_a_positive_count():
    assert_usage_error(run("join", "--parent", "127.0.0.1:1", "--lanes", "0"), "--lanes")


# ----- a real seeder and strangers ----------------------------------------------------------------

@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(11).integers(0, 256, 7 * CHUNK + 99, dtype=np.uint8).tobytes())
    return path


@pytest.fixture
def seeder(model):
    with seed(model, host="127.0.0.1", port=0, chunk_size=CHUNK) as s:
        yield s


def attach(s, rank: int = 3, peer_id: str = "p") -> Stranger:
    link = Stranger(s.port)
    e = link.ask(Msg.ATTACH, peer_id=peer_id, rank=rank, model_id=s.model_id, ticket=s.tracker.seal.ticket(0, rank))
    assert e.type == Msg.ATTACHED and e.fields["lanes"] == MAX_LANES
    return link


def open_lane(s, number: int, rank: int = 3, peer_id: str = "p", ticket: str | None = "valid"):
    lane = Stranger(s.port)
    ticket = s.tracker.seal.ticket(0, rank) if ticket == "valid" else ticket
    return lane, lane.ask(Msg.LANE, peer_id=peer_id, rank=rank, model_id=s.model_id, ticket=ticket, lane=number)


def collect(socks, n: int) -> dict[int, tuple[int, bytes]]:
    """Chunks read from any of ``socks`` until ``n`` arrived (or 10 s passed): index -> (socket's place, bytes)."""
    got, deadline = {}, time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        for k, sock in enumerate(socks):
            if sock.sock.poll(20):
                e = sock.answer(timeout=0.1, skip=(Msg.HEARTBEAT, Msg.HAVE))
                if e is not None and e.type == Msg.CHUNK:
                    got[e.indices[0]] = (k, bytes(e.payload))
    return got


def test_a_lane_needs_its_partner_attached_first_and_its_ticket(seeder):
    strangers = []
    try:
        lane, e = open_lane(seeder, 1)  # nobody attached as rank 3 yet
        strangers.append(lane)
        assert e.type == Msg.ERROR and e.fields["fatal"] and "not attached" in e.fields["message"]
        strangers.append(attach(seeder))
        for ticket in (None, "0" * 32, seeder.tracker.seal.ticket(0, 4)):  # none, made up, another rank's
            lane, e = open_lane(seeder, 1, ticket=ticket)
            strangers.append(lane)
            assert e.type == Msg.ERROR and e.fields["fatal"] and "not placed here" in e.fields["message"]
        lane, e = open_lane(seeder, 1, peer_id="someone else")
        strangers.append(lane)
        assert e.type == Msg.ERROR and "not attached" in e.fields["message"]
        assert seeder.node.lanes.paths == {}
    finally:
        for s in strangers:
            s.close()


def test_a_lane_from_another_address_than_its_link_is_refused(seeder):
    link = attach(seeder)  # from 127.0.0.1
    other = Stranger(seeder.port, source="127.0.0.2")  # the same peer's ticket, from another address
    try:
        e = other.ask(Msg.LANE, peer_id="p", rank=3, model_id=seeder.model_id,
                      ticket=seeder.tracker.seal.ticket(0, 3), lane=1)
        assert e.type == Msg.ERROR and e.fields["fatal"] and "another address" in e.fields["message"]
        assert seeder.node.lanes.paths == {}
    finally:
        other.close()
        link.close()


def test_chunks_spread_over_a_partners_link_and_its_lanes_and_arrive_exact(seeder, model):
    link = attach(seeder)
    lanes = []
    try:
        for number in range(1, MAX_LANES):
            lane, e = open_lane(seeder, number)
            lanes.append(lane)
            assert e.type == Msg.LANE_OK and e.fields["lane"] == number
        lane, e = open_lane(seeder, 1)  # one connection past the most a partner may pull over
        lanes.append(lane)
        assert e.type == Msg.ERROR and e.fields["fatal"] and f"at most {MAX_LANES}" in e.fields["message"]
        link.send(Msg.HEARTBEAT)
        link.sock.send(protocol.request(list(range(8))))
        got = collect([link, *lanes[:-1]], 8)
        data = model.read_bytes()
        assert {i: b for i, (_, b) in got.items()} == {i: data[i * CHUNK:(i + 1) * CHUNK] for i in range(8)}
        assert len({k for k, _ in got.values()}) == MAX_LANES  # eight chunks, one on each connection
    finally:
        for s in (link, *lanes):
            s.close()


def test_a_request_on_a_lane_is_refused_and_the_partner_still_served(seeder, model):
    link = attach(seeder)
    lane, e = open_lane(seeder, 1)
    try:
        assert e.type == Msg.LANE_OK
        lane.sock.send(protocol.request([0]))
        e = lane.answer()
        assert e.type == Msg.ERROR and "unexpected REQUEST in state lane" in e.fields["message"]
        link.sock.send(protocol.request([0, 1]))
        got = collect([link, lane], 2)
        assert {i: b for i, (_, b) in got.items()} == {i: model.read_bytes()[i * CHUNK:(i + 1) * CHUNK] for i in (0, 1)}
    finally:
        link.close()
        lane.close()


def test_a_lane_that_drops_leaves_its_partner_served_on_the_rest(seeder, model):
    link = attach(seeder)
    gone, e1 = open_lane(seeder, 1)
    kept, e2 = open_lane(seeder, 2)
    try:
        assert e1.type == e2.type == Msg.LANE_OK
        gone.close()
        time.sleep(0.5)  # its connection ends at the seeder (no message says so: a send there finds it gone)
        link.sock.send(protocol.request(list(range(8))))
        got = collect([link, kept], 8)
        data = model.read_bytes()
        assert {i: b for i, (_, b) in got.items()} == {i: data[i * CHUNK:(i + 1) * CHUNK] for i in range(8)}
        assert {k for k, _ in got.values()} == {0, 1}
    finally:
        link.close()
        kept.close()


# ----- joins as processes ----------------------------------------------------------------------------

def test_a_join_pulls_over_lanes_on_two_io_threads_and_ends_exact(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK, "--io-threads", 2)
    peer = procs.join(info["port"], tmp_path / "out", "--io-threads", 2, "--lanes", 3, "--report", tmp_path / "r.json")
    assert peer.wait(90) == 0, peer.output()
    assert (tmp_path / "out" / "model.bin").read_bytes() == model.read_bytes()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["lanes"] == 3 and sum(report["lane_chunks"]) == report["received"] == 8
    assert sum(1 for c in report["lane_chunks"] if c) >= 2 and len(report["zmq_io_each"]) == 2


def test_lanes_refused_by_the_cap_per_address_leave_the_join_on_its_link(procs, tmp_path, model):
    """A seeder that lets one address hold two connections (a join's tracker link and chunk link) refuses the
    lanes; the join pulls everything over its link and ends exact."""
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK, "--max-conns-per-host", 2)
    peer = procs.join(info["port"], tmp_path / "out", "--lanes", 4, "--report", tmp_path / "r.json")
    assert peer.wait(90) == 0, peer.output()
    assert (tmp_path / "out" / "model.bin").read_bytes() == model.read_bytes()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["lane_chunks"] == [8, 0, 0, 0]


def test_forwarding_joins_over_lanes_end_exact_and_forward_no_corrupt_chunk(procs, tmp_path, where):  # noqa: F811
    """Two joins pulling over 3 lanes each (from the seeder and from each other), corrupting a fifth of what they
    send: both copies exact, every bad chunk fetched again."""
    _, reports = forwarding_joins(procs, tmp_path, where, "--io-threads", 2, "--lanes", 3)
    for r in reports:
        assert r["lanes"] == 3 and r["refetched"] == r["bad_chunks"] and sum(r["lane_chunks"][1:]) > 0
