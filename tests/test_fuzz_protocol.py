"""Fuzzing the sans-IO protocol: whatever a peer sends, decoding and the state machines raise ProtocolError or succeed.

Bounded (a few hundred cases each, no deadline) so it runs in CI in seconds;
a crash hypothesis finds becomes a regression test below.
"""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pweights.wire import protocol
from p2pweights.wire.protocol import (CLIENT_TRANSITIONS, HEADER, LANE_TRANSITIONS, MAGIC, PROTOCOL_VERSION,
                                 SERVER_TRANSITIONS, Connection, Event, Msg, ProtocolError)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
kinds = st.integers(0, 255)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4),
                           max_leaves=20)


def header(kind: int, version: int = PROTOCOL_VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, kind)


def decodes_or_refuses(frames) -> Event | None:
    try:
        return protocol.decode(frames)
    except ProtocolError:
        return None


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes(frame):
    decodes_or_refuses([frame])


@FUZZ
@given(kinds, st.binary(max_size=2000), st.lists(st.binary(max_size=64), max_size=3))
def test_valid_header_any_body(kind, body, payload):
    decodes_or_refuses([header(kind) + body, *payload])


@FUZZ
@given(st.sampled_from(list(Msg)), st.dictionaries(st.sampled_from(["peer_id", "listen", "rank", "parents",
                                                                    "stripes", "tracker", "message", "model_id"])
                                                   | st.text(max_size=8), json_values, max_size=6))
def test_json_bodies(kind, fields):
    event = decodes_or_refuses([header(kind) + json.dumps(fields).encode(), b"x"])
    if event is not None and event.type in protocol.SCHEMA:  # what passes has every required field, well typed
        for name, typ in protocol.SCHEMA[event.type].items():
            assert isinstance(event.fields[name], typ)


@FUZZ
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_request_indices(indices):
    event = decodes_or_refuses([header(Msg.REQUEST) + struct.pack(f"<{len(indices)}I", *indices)])
    assert (event is not None) == (1 <= len(indices) <= protocol.MAX_REQUEST)
    if event is not None:
        assert event.indices == indices


@FUZZ
@given(st.sampled_from([SERVER_TRANSITIONS, CLIENT_TRANSITIONS, LANE_TRANSITIONS]),
       st.lists(st.sampled_from(list(Msg)), max_size=20))
def test_state_machines(table, kinds_seen):
    states = {s for s, _ in table} | set(table.values())
    first = "new" if table is SERVER_TRANSITIONS else "hello" if table is CLIENT_TRANSITIONS else "attaching"
    conn = Connection(table, first)
    for kind in kinds_seen:
        try:
            conn.receive(Event(kind))
        except ProtocolError as e:
            assert kind.name in str(e) and conn.state in str(e)  # names the state and the message
        assert conn.state in states


@pytest.mark.parametrize("body", [b"[" * 50_000, b'{"a":' * 20_000, b"1e99999", b"9" * 5000, b'"\\ud800"'])
def test_regressions(body):
    """Found by fuzzing: deep nesting raised RecursionError, not ProtocolError."""
    decodes_or_refuses([header(Msg.HELLO) + body])


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 513, 35_001])
def test_attached_bitfield_is_numpy_packbits_and_unpacks_to_the_same_chunks(n):
    """ATTACHED's bitfield keeps numpy's ``packbits`` layout (older peers send and read it), built and read
    without numpy: chunk 0 in the first byte's highest bit."""
    rng = np.random.default_rng(n)
    flags = rng.random(n) < 0.5
    bits = protocol.pack_bits(flags.astype(np.uint8).tobytes())
    assert bits == np.packbits(flags).tobytes()
    got = protocol.unpack_bits(bits, n)
    assert [i for i in range(n) if got >> i & 1] == np.flatnonzero(flags).tolist()


addresses = st.one_of(st.text(max_size=40), st.from_regex(r"\A[a-z0-9.\[\]:-]{1,30}:[0-9]{1,6}\Z"),
                      st.sampled_from(["bogus", "ipc:///tmp/x", "tcp://h:1", "[::1]:7420", "h:0", "h:65536",
                                       "10.0.0.1:7420", "a:1:2", " h:1", "h:1 ", "h:+1", "h:٣"]))


@FUZZ
@given(st.sampled_from([Msg.HELLO, Msg.REDIRECT, Msg.WELCOME]), addresses)
def test_every_address_a_message_carries_is_host_colon_port(kind, addr):
    """Whatever address a peer puts in HELLO, REDIRECT or a plan entry, what decodes is HOST:PORT that
    ZeroMQ takes as a TCP endpoint; nothing else gets past the decoder."""
    fields = {Msg.HELLO: {"peer_id": "p", "listen": addr}, Msg.REDIRECT: {"tracker": addr},
              Msg.WELCOME: {"rank": 1, "parents": [{"rank": 0, "stripe": 0, "addr": addr}], "stripes": 1,
                            "tracker": ""}}[kind]
    event = decodes_or_refuses([header(kind) + json.dumps(fields).encode(), *([b"{}"] if kind == Msg.WELCOME else [])])
    if event is not None and addr:
        assert protocol.valid_addr(addr)
        host, _, port = addr.rpartition(":")
        assert protocol.valid_host(host) and 0 < int(port) < 65536 and "://" not in addr


def fuzzed_endpoint():
    from p2pweights.sources.manifest import Manifest
    from p2pweights.swarm.tracker.endpoint import TrackerEndpoint
    from p2pweights.swarm.tracker.topology import make
    from p2pweights.swarm.tracker.tracker import Tracker

    m = Manifest(total_size=8192, chunk_size=1024, chunks=["0" * 16] * 8)
    clock = lambda: 0.0  # noqa: E731
    ep = TrackerEndpoint(Tracker(make("forest:2"), "10.0.0.0:7420", clock=clock), m, clock)
    for i in range(1, 5):
        ep.hello(f"id{i}".encode(), {"peer_id": f"p{i}", "listen": f"10.0.0.{i}:7000"})
    return ep


member_fields = st.dictionaries(st.sampled_from(["peer_id", "listen", "rank", "secret", "stripe", "parent", "reason",
                                                 "dead", "have", "links", "got", "rate", "took", "alone", "model_id"]),
                                json_values | st.integers(-3, 9) | st.dictionaries(st.text(max_size=3),
                                                                                    json_values, max_size=3),
                                max_size=10)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([Msg.HELLO, Msg.DONE, Msg.LEAVE, Msg.BYE, Msg.ORPHAN, Msg.HEARTBEAT,
                                           Msg.STATUS, Msg.PROBE]),
                          st.sampled_from([b"id1", b"id2", b"id3", b"stranger"]), member_fields), max_size=12))
def test_no_member_message_crashes_the_tracker(messages):
    """Whatever members and strangers send the seeder's tracker, each message is handled or is a
    ProtocolError for its sender alone (the node answers that one with ERROR and serves everyone else)."""
    ep = fuzzed_endpoint()
    for kind, ident, fields in messages:
        event = decodes_or_refuses([header(kind) + json.dumps(fields).encode()])
        if event is None:
            continue
        try:
            ep.HANDLERS[kind](ep, ident, event.fields)
        except ProtocolError:
            pass
        ep.take()
        ep.review()
    assert all(ep.tracker.members[r].rank == r for r in ep.idents)


@pytest.mark.parametrize("value", [0, -1, 256, 1.5, "2", True, [1], None])
def test_a_lane_number_or_count_is_a_whole_number_from_1_to_255_or_refused(value):
    for kind, key, rest in ((Msg.LANE, "lane", {"peer_id": "p", "rank": 3, "model_id": "m"}),
                            (Msg.LANE_OK, "lane", {}), (Msg.ATTACHED, "lanes", {"n_chunks": 8})):
        bits = [b"\xff"] if kind == Msg.ATTACHED else []
        frames = [header(kind) + json.dumps({**rest, key: value}).encode(), *bits]
        if value is None and kind == Msg.ATTACHED:  # ATTACHED may leave it out (a partner taking no lanes)
            assert protocol.decode(frames).fields["lanes"] is None
        else:
            assert decodes_or_refuses(frames) is None, (kind, value)
        ok = protocol.decode([header(kind) + json.dumps({**rest, key: 7}).encode(), *frames[1:]])
        assert ok.fields[key] == 7


@pytest.mark.parametrize("linger", [-1, float("nan"), float("inf"), 1e12, "5", True, [1]])
def test_a_leave_s_linger_is_a_number_of_seconds_or_refused(linger):
    body = json.dumps({"rank": 3, "linger": linger}).encode()
    assert decodes_or_refuses([header(Msg.LEAVE) + body]) is None
    for ok in (0, 2.5, 86400):
        got = protocol.decode([header(Msg.LEAVE) + json.dumps({"rank": 3, "linger": ok}).encode()])
        assert got.fields["linger"] == ok
    assert "linger" not in protocol.decode([header(Msg.LEAVE) + b'{"rank": 3}']).fields
