"""Resource limits: each is hit once by a misbehaving peer, and the node keeps serving everyone else."""
from __future__ import annotations

import numpy as np
import pytest
import zmq

from p2pweights.swarm.node import node

from p2pweights.wire import protocol
from p2pweights.api import P2PError, join, seed
from p2pweights.sources.manifest import MAX_CHUNK_SIZE, Manifest, ManifestError
from p2pweights.wire.protocol import Msg

CHUNK = 256 << 10


@pytest.fixture
def seeder(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 4 * CHUNK, dtype=np.uint8).tobytes())
    s = seed(path, host="127.0.0.1", port=0, chunk_size=CHUNK, max_peers=2)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def raw(seeder):
    """A bare DEALER to the seeder, for sending what no p2pw peer would."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{seeder.port}")
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def answer(sock, timeout=2.0):
    """The next message other than a HEARTBEAT, or None after ``timeout`` s."""
    while sock.poll(int(timeout * 1000)):
        event = protocol.decode(sock.recv_multipart())
        if event.type != Msg.HEARTBEAT:
            return event
    return None


def still_serves(seeder, tmp_path, name="ok"):
    with join(f"127.0.0.1:{seeder.port}", host="127.0.0.1", peer_id=name, connect_timeout=10) as dl:
        dl.wait(30)


def test_malformed_messages_cap_then_ignored(seeder, raw, tmp_path):
    for i in range(node.MAX_BAD_MESSAGES):
        raw.send(b"garbage %d" % i)
    first = answer(raw)
    assert first is not None and first.type == Msg.ERROR  # told once, then silence
    while answer(raw, 0.3):
        pass
    raw.send(protocol.control(Msg.HELLO, peer_id="late", listen="127.0.0.1:1"))
    assert answer(raw, 1.0) is None  # disconnected: even a good HELLO is ignored now
    assert seeder.stats.malformed >= node.MAX_BAD_MESSAGES
    still_serves(seeder, tmp_path)


def test_oversized_frame_is_dropped(seeder, raw, tmp_path):
    raw.send(protocol.control(Msg.HEARTBEAT) + b" " * node.ROUTER_MAX_MSG)
    assert answer(raw, 1.0) is None
    still_serves(seeder, tmp_path)


def test_request_limits(seeder, raw, tmp_path):
    raw.send(protocol.control(Msg.ATTACH, peer_id="greedy", rank=9, model_id=seeder.model_id,
                              ticket=seeder.tracker.seal.ticket(0, 9)))  # placed there by the tracker
    assert answer(raw).type == Msg.ATTACHED
    raw.send(protocol.request([0, 0, 0]))  # one small message asking for the same chunk three times
    e = answer(raw)
    assert e.type == Msg.ERROR and "twice" in e.fields["message"]
    before = seeder.stats.malformed
    raw.send(protocol.request(list(range(protocol.MAX_REQUEST + 1))))  # more indices than one REQUEST may carry
    answer(raw, 0.5)
    assert seeder.stats.malformed == before + 1
    still_serves(seeder, tmp_path)


def test_hello_with_long_names_is_refused(seeder, raw):
    raw.send(protocol.control(Msg.HELLO, peer_id="x" * (node.MAX_NAME + 1), listen="127.0.0.1:1"))
    e = answer(raw)
    assert e.type == Msg.ERROR and "longer than" in e.fields["message"]
    assert not seeder.tracker.members


def test_max_peers_per_tracker(seeder, tmp_path):
    a = join(f"127.0.0.1:{seeder.port}", host="127.0.0.1", peer_id="a", connect_timeout=10)
    b = join(f"127.0.0.1:{seeder.port}", host="127.0.0.1", peer_id="b", connect_timeout=10)
    try:
        with pytest.raises(P2PError, match=r"tracker is full \(2 peers\)"):
            join(f"127.0.0.1:{seeder.port}", host="127.0.0.1", peer_id="c", connect_timeout=10)
    finally:
        a.close()
        b.close()


def test_max_children_per_parent(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 4 * CHUNK, dtype=np.uint8).tobytes())
    with seed(path, host="127.0.0.1", port=0, chunk_size=CHUNK, topology="binomial") as seeder:
        seeder.node.max_children = 1
        served_once_the_only_source_has_room(seeder, path.read_bytes())


def served_once_the_only_source_has_room(seeder, data: bytes):
    a = join(f"127.0.0.1:{seeder.port}", host="127.0.0.1", peer_id="a", connect_timeout=10)
    try:
        a.wait(30)
        b = join(f"127.0.0.1:{seeder.port}", host="127.0.0.1", peer_id="b", connect_timeout=10)
        try:  # rank 2 is the seeder's second child in the binomial tree: refused at ATTACH while a is attached,
            assert b.parents[0]["rank"] == 0  # it asks the tracker again (not exit), and is served once a is done
            b.wait(30)
            assert b.store.complete and b"".join(bytes(b.store.chunk(i)) for i in range(4)) == data
        finally:
            b.close()
    finally:
        a.close()


def test_manifest_chunk_size_limit():
    m = Manifest(total_size=MAX_CHUNK_SIZE * 2, chunk_size=MAX_CHUNK_SIZE * 2, chunks=["0" * 16])
    with pytest.raises(ManifestError, match="chunk size"):
        Manifest.from_json(m.to_json())


@pytest.mark.timeout(60)
def test_closing_a_join_mid_transfer_with_partner_links_ends_its_context(tmp_path, monkeypatch):
    """Every socket of a partner link (its DEALER and the monitor watching it for a drop) is closed,
    so close() returns: a socket left open would block the context's term() forever."""
    import threading
    import time

    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(4).integers(0, 256, 64 * (64 << 10), dtype=np.uint8).tobytes())
    monkeypatch.setenv("P2PW_FAULTS", "delay_recv=30ms")  # both joins still pulling when closed
    with seed(path, host="127.0.0.1", port=0, chunk_size=64 << 10) as s:
        a = join(f"127.0.0.1:{s.port}", host="127.0.0.1", peer_id="a", connect_timeout=10, cache=None)
        b = join(f"127.0.0.1:{s.port}", host="127.0.0.1", peer_id="b", connect_timeout=10, cache=None)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
                r != 0 and lk.monitor is not None for d in (a, b) for r, lk in list(d.node.partners.links.items())):
            time.sleep(0.01)
        assert not (a.store.complete or b.store.complete), "both should still be pulling (each chunk waits 30 ms)"
        assert any(r != 0 for d in (a, b) for r in list(d.node.partners.links)), "no partner link opened"
        closer = threading.Thread(target=lambda: (a.close(), b.close()), daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() hung: a partner link's socket was left open"
