"""The standalone tracker's pure parts: origin shares, the rootless plan, the registry's routing, and the
field checks of SHARE, READ, PUBLISH, LOOKUP and MANIFEST (no sockets, an injected clock)."""
from __future__ import annotations

import random

import pytest

from p2pweights.sources.manifest import Manifest
from p2pweights.swarm.tracker.registry import NO_SWARM, NOT_A_MEMBER, Registry
from p2pweights.swarm.tracker.rootless import RootlessTracker
from p2pweights.swarm.tracker.shares import MAX_SHARE, OriginShares, share_size
from p2pweights.swarm.tracker.topology import make
from p2pweights.swarm.tracker.tracker import ROOT
from p2pweights.wire import protocol
from p2pweights.wire.protocol import Msg, ProtocolError


def test_shares_are_disjoint_and_cover_the_model_once():
    rng = random.Random(3)
    s = OriginShares(1000, batch=16)
    for r in (1, 2, 3):
        s.register(r)
    read = []
    while not s.done:
        r = rng.choice([1, 2, 3])
        got = s.hand(r)
        assert not set(got) & set(read)  # never a chunk read before, nor one held by another reader
        read += got
        s.held(r, got[: rng.randint(0, len(got))])  # read some now, the rest later
        s.held(r, got)
    assert sorted(read) == list(range(1000))  # each chunk handed out exactly once
    assert s.handed == 1000


def test_a_reader_is_handed_more_only_once_half_its_share_is_read():
    s = OriginShares(100, batch=10)
    s.register(1)
    first = s.hand(1)
    assert first == list(range(10)) and s.hand(1) == []  # 10 outstanding
    s.held(1, first[:4])
    assert s.hand(1) == []  # 6 outstanding: more than half
    s.held(1, first[4:5])
    assert s.hand(1) == list(range(10, 15))  # 5 outstanding: topped up to 10


def test_a_reader_that_goes_gives_back_what_it_had_not_read():
    s = OriginShares(40, batch=8)
    s.register(1), s.register(2)
    a = s.hand(1)
    s.held(1, a[:3])
    s.gone(1)
    b = s.hand(2)
    assert b == a[3:] + [8, 9, 10]  # the unread rest first, in blob order
    assert 1 not in s.readers


def test_nothing_is_handed_while_a_member_holds_the_whole_model():
    s = OriginShares(40, batch=8)
    s.register(1)
    assert s.hand(1, complete_holder=True) == []
    assert len(s.hand(1)) == 8


def test_share_size():
    assert share_size(1) == 1 and share_size(160) == 10 and share_size(10 ** 6) == MAX_SHARE


def test_rootless_plan_names_no_rank_0_and_feeds_stripe_roots_from_the_readers():
    t = RootlessTracker(make("forest:2"), "", clock=lambda: 0.0)
    members = [t.join(f"p{i}", f"127.0.0.1:{7000 + i}") for i in range(6)]
    for r in (3, 5):
        t.add_reader(r)
    for m in members:
        assert all(p["rank"] != ROOT for p in t.parent_addrs(m))
        assert all(p["rank"] != ROOT for p in t.partner_addrs(m))
    roots = [m for m in members if ROOT in m.parents]
    assert roots
    for m in roots + [t.members[3], t.members[5]]:
        listed = {p["rank"] for p in t.partner_addrs(m)}
        assert {3, 5} - {m.rank} <= listed  # every stripe root, and each reader, pulls from the readers
    assert not t.loan.open


def manifest(n: int, seed: int) -> Manifest:
    rng = random.Random(seed)
    chunks = [f"{rng.getrandbits(64):016x}" for _ in range(n)]
    return Manifest(total_size=n * 4096, chunk_size=4096, chunks=chunks,
                    files=[{"name": "w.bin", "offset": 0, "size": n * 4096}], tensors=[], hash="xxh3_64")


def sent(reg: Registry) -> list:
    return [(ident, protocol.decode(frames)) for ident, frames in reg.take()]


def test_registry_keeps_three_models_apart():
    reg = Registry(lambda n: make("forest:2"), clock=lambda: 0.0)
    models = [manifest(32, k) for k in range(3)]
    for k, m in enumerate(models):
        reg.publish(b"pub%d" % k, {"url": f"s3://b/m{k}"}, m.wire_bytes())
    sent(reg)
    idents = {}
    for k, m in enumerate(models):
        for j in range(4):
            ident = b"m%d-%d" % (k, j)
            assert reg.hello(ident, {"peer_id": ident.decode(), "listen": f"127.0.0.1:{8000 + 10 * k + j}",
                                     "model_id": m.model_id, "origin": j == 0})
            idents[ident] = k
    for ident, event in sent(reg):
        if event.type in (Msg.WELCOME, Msg.REPARENT):
            k = idents[ident]
            ports = {int(p["addr"].rsplit(":", 1)[1]) for p in event.fields["parents"] + event.fields.get(
                "partners", [])}
            assert all(8000 + 10 * k <= p < 8010 + 10 * k for p in ports), (ident, ports)  # its own swarm only
            if event.type == Msg.WELCOME:
                assert Manifest.from_wire(bytes(event.payload)).model_id == models[k].model_id
        if event.type == Msg.SHARE:
            assert ident.endswith(b"-0")  # only each swarm's reader is handed a share
    with pytest.raises(ProtocolError):  # a member of one swarm cannot speak for another
        reg.hello(b"m0-1", {"peer_id": "m0-1", "listen": "127.0.0.1:8001", "model_id": models[1].model_id})


def test_registry_answers_strangers_and_unknown_models_with_one_error():
    reg = Registry(lambda n: make("forest:2"), clock=lambda: 0.0)
    assert reg.hello(b"x", {"peer_id": "x", "listen": "127.0.0.1:9", "model_id": "ab" * 32}) is False
    assert reg.route(b"y", Msg.HEARTBEAT, {}) is False
    reg.lookup(b"z", {"url": "s3://nothing/here"})
    out = sent(reg)
    assert [e.type for _, e in out] == [Msg.ERROR] * 3
    assert NO_SWARM in out[0][1].fields["message"] and out[1][1].fields["message"] == NOT_A_MEMBER
    with pytest.raises(ProtocolError):
        reg.publish(b"p", {"url": "s3://b/m"}, b"{not a manifest")
    with pytest.raises(ProtocolError):
        reg.route(b"q", Msg.DONE, {"rank": 1})
    m = manifest(8, 1)
    reg.publish(b"p", {"url": "s3://b/m"}, m.wire_bytes())
    reg.hello(b"r", {"peer_id": "r", "listen": "127.0.0.1:9", "model_id": m.model_id, "origin": True})
    with pytest.raises(ProtocolError):
        reg.read(b"r", {"chunks": [8]})  # past the blob's end
    with pytest.raises(ProtocolError):
        reg.read(b"s", {"chunks": [1]})  # from a connection that never joined


@pytest.mark.parametrize("kind, fields", [
    (Msg.SHARE, {"chunks": "0-9"}), (Msg.SHARE, {"chunks": [1.5]}), (Msg.READ, {"chunks": [-1]}),
    (Msg.READ, {"chunks": list(range(protocol.MAX_REQUEST + 1))}), (Msg.READ, {"chunks": [1 << 32]}),
    (Msg.LOOKUP, {"url": ""}), (Msg.LOOKUP, {"url": "s3://" + "x" * protocol.MAX_URL}),
    (Msg.LOOKUP, {"url": "s3://b/\x00"}), (Msg.HELLO, {"peer_id": "p", "listen": "127.0.0.1:1", "origin": "yes"}),
])
def test_new_messages_are_checked_before_any_handler(kind, fields):
    with pytest.raises(ProtocolError):
        protocol.decode([protocol.control(kind, **fields)])


def test_publish_and_manifest_carry_one_payload_frame():
    with pytest.raises(ProtocolError):
        protocol.decode([protocol.control(Msg.PUBLISH, url="s3://b/m")])
    e = protocol.decode([protocol.control(Msg.MANIFEST, url="s3://b/m", model_id="ab"), b"{}"])
    assert e.payload == b"{}"


def test_chunks_read_only_by_readers_that_left_are_read_again_when_reclaimed():
    s = OriginShares(16, batch=8)
    s.register(1), s.register(2)
    a = s.hand(1)
    s.held(1, a)
    s.gone(1)  # it left with its reads: maybe its peers hold them, maybe nobody
    assert s.orphans and s.hand(2) == list(range(8, 16))
    s.held(2, range(8, 16))
    assert not s.hungry(2)  # nothing in the pool until the swarm says nobody holds the orphans
    s.reclaim()
    assert s.hand(2) == a  # read again, by a live reader
