"""A member's claims are hints: origin shares, tickets and lingering against a stranger member.

Pure tests drive the standalone tracker's ``Registry`` with a fake clock and
simulated honest readers; process tests run real ``p2pw tracker`` and ``p2pw
get`` processes beside ``hostile.Stranger``.  Assertions are on chunks, bytes,
exit codes and counts, never on time.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pweights.sources.manifest import Manifest
from p2pweights.swarm.tracker.registry import Registry
from p2pweights.swarm.tracker.shares import CLAIM_BOUND, OriginShares, Progress
from p2pweights.swarm.tracker.topology import make
from p2pweights.wire import protocol
from p2pweights.wire.protocol import Msg, ProtocolError

N = 64  # chunks of the pure tests' model


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def manifest(n: int = N, seed: int = 7) -> Manifest:
    rng = random.Random(seed)
    return Manifest(total_size=n * 4096, chunk_size=4096, chunks=[f"{rng.getrandbits(64):016x}" for _ in range(n)],
                    files=[{"name": "w.bin", "offset": 0, "size": n * 4096}], tensors=[], hash="xxh3_64")


class Fleet:
    """A registry with one model, and honest readers that read what they are handed and take what the other
    honest readers hold (the swarm), reporting as a node does: READ, HEARTBEAT with ``have``, DONE."""

    def __init__(self):
        self.clock = Clock()
        self.reg = Registry(lambda n: make("forest:2"), clock=self.clock)
        self.m = manifest()
        self.reg.publish(b"pub", {"url": "s3://b/m"}, self.m.wire_bytes())
        self.mid = self.m.model_id
        self.held: dict[bytes, set] = {}
        self.todo: dict[bytes, list] = {}
        self.done: set = set()

    def hello(self, ident: bytes, origin: bool = True) -> None:
        assert self.reg.hello(ident, {"peer_id": ident.decode(), "listen": f"127.0.0.1:{9000 + len(self.held)}",
                                      "model_id": self.mid, "origin": origin})

    def honest(self, *idents: bytes) -> None:
        for ident in idents:
            self.held[ident], self.todo[ident] = set(), []
            self.hello(ident)

    def deliver(self) -> None:
        """What the tracker sent: each honest reader's shares."""
        for ident, frames in self.reg.take():
            e = protocol.decode(frames)
            if e.type == Msg.SHARE and ident in self.held:
                self.todo[ident] += e.fields["chunks"]

    def step(self, dt: float = 0.5) -> None:
        """Each honest reader reads its share, takes what the others hold, heartbeats; the tracker reviews."""
        self.deliver()
        for ident in self.held:
            read = [i for i in self.todo[ident] if i not in self.held[ident]]
            self.held[ident] |= set(self.todo[ident])
            self.todo[ident] = []
            if read:
                self.reg.read(ident, {"chunks": read})
        everyone = set().union(*self.held.values())
        for ident in self.held:
            self.held[ident] |= everyone
            self.reg.route(ident, Msg.HEARTBEAT, {"have": len(self.held[ident])})
            if len(self.held[ident]) == N and ident not in self.done:
                self.done.add(ident)
                self.reg.route(ident, Msg.DONE, {"rank": self.rank(ident)})
        self.clock.t += dt
        self.reg.review(self.clock.t)
        self.deliver()

    def rank(self, ident: bytes) -> int:
        return self.reg.swarm_of(ident).endpoint.members[ident]

    def complete(self) -> bool:
        return all(len(h) == N for h in self.held.values())

    def run(self, steps: int = 200) -> int:
        for k in range(steps):
            if self.complete():
                return k
            self.step()
        return steps

    @property
    def shares(self) -> OriginShares:
        return self.reg.swarms[self.mid].shares


# ----- claims are hints: READ, DONE --------------------------------------------------------------------------------

def test_a_read_from_a_member_that_is_no_reader_changes_nothing_in_the_pool():
    f = Fleet()
    f.hello(b"stranger", origin=False)
    f.reg.read(b"stranger", {"chunks": list(range(N))})  # it says it read every chunk; it reads nothing
    assert f.shares.pool == (1 << N) - 1 and f.shares.read == 0
    f.honest(b"a", b"b")
    assert f.run() < 10 and f.complete()  # the honest readers read it all at once, no stall to wait out
    assert f.shares.handed == N  # each chunk read from the origin once


def test_a_done_from_one_member_pauses_the_readers_only_while_the_fleet_moves():
    f = Fleet()
    f.hello(b"stranger", origin=False)
    f.reg.route(b"stranger", Msg.DONE, {"rank": f.rank(b"stranger")})  # it holds nothing
    f.honest(b"a", b"b")
    f.step()
    assert f.shares.handed == 0  # a complete holder's uplink may serve: nobody reads yet
    steps = f.run()
    assert f.complete() and steps <= 2 * CLAIM_BOUND / 0.5 + 4  # nothing arrived: the readers read it after all
    assert f.shares.handed == N


def test_a_reader_that_claims_every_chunk_loses_its_claims_once_the_fleet_stalls():
    f = Fleet()
    f.hello(b"liar")
    f.deliver()
    f.reg.read(b"liar", {"chunks": list(range(N))})  # handed a share, claims the whole model, serves nothing
    f.honest(b"a", b"b")
    f.step()
    assert f.shares.handed <= f.shares.batch  # its claims stand for now
    steps = f.run()
    assert f.complete() and steps <= 2 * CLAIM_BOUND / 0.5 + 4
    assert f.shares.refuted[f.rank(b"liar")] == (1 << N) - 1  # never handed to it again
    assert f.shares.read == (1 << N) - 1


def test_a_reader_handed_a_share_it_never_reads_gives_it_back_once_the_fleet_stalls():
    f = Fleet()
    f.hello(b"sink")  # a reader that reads nothing, and heartbeats: never dropped as silent
    f.honest(b"a", b"b")
    for _ in range(int(2 * CLAIM_BOUND / 0.5) + 4):
        f.reg.route(b"sink", Msg.HEARTBEAT, {"have": 0})
        f.step()
    assert f.complete()


def test_claims_stand_while_the_fleet_moves_and_vouched_ones_for_good():
    clock = Clock()
    s = OriginShares(32, batch=8, clock=clock)
    s.register(1), s.register(2)
    a = s.hand(1)
    s.held(1, a)
    clock.t += 2 * CLAIM_BOUND
    assert s.expire(stalled=False) == 0 and s.read == (1 << 8) - 1  # the fleet moves: claims stand
    s.held(2, a[:4])  # a second reader holds four of them: vouched
    b = s.hand(2)
    clock.t += 2 * CLAIM_BOUND
    back = s.expire(stalled=True)
    assert back == sum(1 << i for i in a[4:] + b)  # the rest went back: unvouched, and the fleet stalls
    assert s.hand(1) == b and s.hand(2)[:4] == a[4:]  # each to the other reader, never to its claimer


def test_progress_stalls_when_an_unfinished_member_verifies_nothing_for_the_bound():
    clock = Clock()
    p = Progress(clock, every=0.0)
    assert not p.stalled([(1, 0), (2, 0)])
    clock.t += CLAIM_BOUND / 2
    assert not p.stalled([(1, 3), (2, 0)])
    clock.t += CLAIM_BOUND / 2
    assert p.stalled([(1, 6), (2, 0)])  # rank 2 verified nothing for CLAIM_BOUND
    assert not p.stalled([(1, 7), (2, 1)])


# ----- a stranger member against two honest readers ------------------------------------------------------------------

stranger_moves = st.lists(st.one_of(
    st.tuples(st.just("READ"), st.lists(st.integers(0, N - 1), min_size=1, max_size=N)),
    st.tuples(st.just("HAVE"), st.integers(-5, N + 5)),  # its heartbeat's claim of chunks held
    st.tuples(st.just("DONE"), st.just(None)),
    st.tuples(st.just("ORPHAN"), st.tuples(st.integers(0, 2), st.integers(0, 6), st.booleans())),
    st.tuples(st.just("HEARTBEAT"), st.dictionaries(st.sampled_from(["1", "2", "3", "x"]), st.integers(0, 10 ** 9),
                                                    max_size=3)),
    st.tuples(st.just("WAIT"), st.integers(1, 20)),
), max_size=40)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(origin=st.booleans(), first=st.booleans(), moves=stranger_moves)
def test_whatever_a_stranger_member_claims_both_honest_readers_complete(origin, first, moves):
    f = Fleet()
    if first:
        f.hello(b"s", origin=origin)
    f.honest(b"a", b"b")
    if not first:
        f.hello(b"s", origin=origin)
    rank = f.rank(b"s")
    for kind, arg in moves:
        try:
            if kind == "READ":
                f.reg.read(b"s", {"chunks": arg})
            elif kind == "HAVE":
                f.reg.route(b"s", Msg.HEARTBEAT, {"have": arg})
            elif kind == "DONE":
                f.reg.route(b"s", Msg.DONE, {"rank": rank})
            elif kind == "ORPHAN":
                stripe, parent, dead = arg
                f.reg.route(b"s", Msg.ORPHAN, {"rank": rank, "stripe": stripe, "parent": parent, "reason": "x",
                                               "dead": dead})
            elif kind == "HEARTBEAT":
                f.reg.route(b"s", Msg.HEARTBEAT, {"have": 0, "links": arg, "got": arg})
        except ProtocolError:
            pass  # one error for that peer; the tracker goes on
        for _ in range(arg if kind == "WAIT" else 1):
            f.step()
    f.run(400)
    assert f.complete()
    assert f.held[b"a"] == f.held[b"b"] == set(range(N))


# ----- linger bounds every get ---------------------------------------------------------------------------------------

def test_the_last_complete_member_stays_for_an_unfinished_one_at_most_its_linger():
    from p2pweights.swarm.tracker.rootless import LAST_HOLDER_LINGER, RootlessTracker

    clock = Clock()
    t = RootlessTracker(make("forest:2"), "", clock=clock)
    a, b, c = (t.join(f"p{i}", f"127.0.0.1:{7000 + i}") for i in range(3))
    t.done(a.rank)
    assert t.leave(a.rank, linger=3.0)  # b and c never finish: it waits, for now
    clock.t += 3.0
    assert t.leave(a.rank, linger=3.0) == [] and a.left  # its linger is up: it goes
    t.done(b.rank)
    assert t.leave(b.rank, linger=0.0) == [] and b.left  # --linger 0: at once, c unfinished or not
    d = t.join("p3", "127.0.0.1:7003")
    t.done(d.rank)
    assert t.leave(d.rank)  # no --linger: the last holder stays ...
    clock.t += LAST_HOLDER_LINGER
    assert t.leave(d.rank) == [] and d.left  # ... for LAST_HOLDER_LINGER at most


def test_a_member_reported_dead_that_speaks_again_is_placed_again():
    f = Fleet()
    f.honest(b"a", b"b")
    f.hello(b"s", origin=False)
    t = f.reg.swarms[f.mid].tracker
    a = f.rank(b"a")
    t.gone(a)  # what a stranger's ORPHAN dead=True about its partner does
    f.step()  # a heartbeats on its own connection
    assert not t.members[a].left and a in f.shares.readers


# ----- tickets: one child per rank, of its member's latest session ------------------------------------------------

def _model(tmp_path):
    import numpy as np

    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(5).integers(0, 256, 6 * (64 << 10) + 77, dtype=np.uint8).tobytes())
    return path


def _welcome(port: int, peer_id: str, **extra):
    from hostile import Stranger

    s = Stranger(port)
    e = s.ask(Msg.HELLO, peer_id=peer_id, listen="127.0.0.1:9", **extra)
    assert e is not None and e.type == Msg.WELCOME, e
    return s, e.fields


@pytest.mark.timeout(120)
def test_one_ticket_admits_one_child_and_a_rejoin_voids_the_old_one(tmp_path):
    from hostile import Stranger
    from p2pweights.api import join, seed

    path = _model(tmp_path)
    with seed(path, host="127.0.0.1", port=0, chunk_size=64 << 10) as s:
        member, w = _welcome(s.port, "m")
        rank, ticket = w["rank"], next(p["ticket"] for p in w["parents"] if p["rank"] == 0)
        links = [Stranger(s.port) for _ in range(10)]
        attach = dict(peer_id="m", rank=rank, model_id=s.model_id)
        try:
            answers = [x.ask(Msg.ATTACH, **attach, ticket=ticket) for x in links[:8]]
            assert all(e is not None and e.type == Msg.ATTACHED for e in answers)  # each newer one replaced ...
            kicked = [x.answer(2.0) for x in links[:7]]
            assert all(e is not None and e.type == Msg.ERROR and e.fields["fatal"] for e in kicked)  # ... the older
            assert [c.rank for c in s.node.children.values()] == [rank]  # one child slot, not eight
            again, w2 = _welcome(s.port, "m", rank=rank, secret=w["secret"])  # the member joins again
            fresh = next(p["ticket"] for p in w2["parents"] if p["rank"] == 0)
            assert w2["rank"] == rank and fresh != ticket
            assert links[8].ask(Msg.ATTACH, **attach, ticket=fresh).type == Msg.ATTACHED
            lanes = [Stranger(s.port) for _ in range(2)]
            try:  # a lane binds to the child attached with the same rank, peer id and ticket
                e = lanes[0].ask(Msg.LANE, **attach, ticket=ticket, lane=1)
                assert e.type == Msg.ERROR and "not attached" in e.fields["message"]
                assert lanes[1].ask(Msg.LANE, **attach, ticket=fresh, lane=1).type == Msg.LANE_OK
            finally:
                for x in lanes:
                    x.close()
            e = links[9].ask(Msg.ATTACH, **attach, ticket=ticket)
            assert e.type == Msg.ERROR and "earlier session" in e.fields["message"]  # the old session's: void
            assert [c.rank for c in s.node.children.values()] == [rank]
            d = join(f"127.0.0.1:{s.port}", host="127.0.0.1", peer_id="honest", connect_timeout=10)
            try:  # an honest joiner is served whatever the stranger did
                d.wait(60)
                data = path.read_bytes()
                n = -(-len(data) // (64 << 10))
                assert b"".join(bytes(d.store.chunk(i)) for i in range(n))[:len(data)] == data
            finally:
                d.close()
            again.close()
        finally:
            member.close()
            for x in links:
                x.close()


# ----- real processes: p2pw tracker, p2pw get, a stranger member -------------------------------------------------

def _lookup(port: int, url: str) -> Manifest:
    from hostile import Stranger

    s = Stranger(port)
    try:
        e = s.ask(Msg.LOOKUP, url=url, timeout=10)
        assert e is not None and e.type == Msg.MANIFEST, e
        return Manifest.from_wire(bytes(e.payload))
    finally:
        s.close()


def _wait_all(procs_list, stranger, timeout: float = 150) -> None:
    """Wait for each process to exit, the stranger heartbeating meanwhile (so it is never dropped as silent)."""
    import time

    deadline = time.monotonic() + timeout
    while any(p.popen.poll() is None for p in procs_list) and time.monotonic() < deadline:
        stranger.send(Msg.HEARTBEAT, have=0)
        time.sleep(0.3)


class Mute:
    """A stranger's node: a real port that admits every ATTACH, claiming it holds every chunk (``claims``) or
    none, and heartbeats every link, so nobody finds it dead; it serves nothing."""

    def __init__(self, n_chunks: int, claims: bool = True):
        import threading

        import zmq

        self.zmq, self.n, self.claims = zmq, n_chunks, claims
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.links: set = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(200):
                ident, *frames = self.sock.recv_multipart()
                try:
                    kind = protocol.decode(frames).type
                except ProtocolError:
                    continue
                if kind == Msg.ATTACH:
                    self.links.add(ident)
                    self.sock.send_multipart([ident, protocol.control(Msg.ATTACHED, n_chunks=self.n),
                                              protocol.pack_bits([self.claims] * self.n)])
            for ident in self.links:
                self.sock.send_multipart([ident, protocol.control(Msg.HEARTBEAT)], self.zmq.NOBLOCK)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.timeout(240)
def test_a_stranger_reader_claiming_every_chunk_and_done_stalls_no_honest_get(procs, tmp_path, model_dir):
    from conftest import same_tree
    from hostile import Stranger
    from test_fleet_get import get, publish, start_tracker

    s3 = pytest.importorskip("test_s3")
    moto = s3.MotoServer()
    stranger = None
    try:
        s3.upload(moto.client(), model_dir, "fleet", "model/")
        url = "s3://fleet/model"
        _, port = start_tracker(procs, tmp_path)
        publish(port, url, env=s3.s3_env(moto.url))
        m = _lookup(port, url)
        mute = Mute(m.n_chunks)
        stranger = Stranger(port)
        e = stranger.ask(Msg.HELLO, peer_id="liar", listen=f"127.0.0.1:{mute.port}", model_id=m.model_id,
                         origin=True)
        assert e.type == Msg.WELCOME
        for k in range(0, m.n_chunks, protocol.MAX_REQUEST):  # it read every chunk, it says, and holds them all
            stranger.send(Msg.READ, chunks=list(range(k, min(k + protocol.MAX_REQUEST, m.n_chunks))))
        stranger.send(Msg.DONE, rank=e.fields["rank"])
        gets = [get(procs, url, port, tmp_path / f"r{k}", env=s3.s3_env(moto.url)) for k in range(2)]
        _wait_all(gets, stranger)
        for k, p in enumerate(gets):
            assert p.wait(10) == 0, p.output()
            assert same_tree(model_dir, tmp_path / f"r{k}") == []
    finally:
        if stranger is not None:
            stranger.close()
            mute.close()
        moto.close()


@pytest.mark.timeout(240)
def test_a_member_that_never_finishes_keeps_no_get_from_exiting(procs, tmp_path):
    from conftest import same_tree
    from hostile import Stranger
    from p2pweights.sources.synth import write_synthetic_model
    from test_fleet_get import get, publish, start_tracker

    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=2, shards=2)
    _, port = start_tracker(procs, tmp_path)
    publish(port, model)
    m = _lookup(port, str(model))
    stranger = Stranger(port)
    try:  # a member that pulls, never finishes, and heartbeats: the get is the last (only) complete member
        assert stranger.ask(Msg.HELLO, peer_id="slowpoke", listen="127.0.0.1:9", model_id=m.model_id).type == \
            Msg.WELCOME
        p = get(procs, model, port, tmp_path / "out", "--linger", "0", "--model-id", m.model_id)
        _wait_all([p], stranger, timeout=90)
        assert p.wait(10) == 0, p.output()
        assert same_tree(model, tmp_path / "out") == []
    finally:
        stranger.close()


def test_a_share_stays_with_a_reader_still_reading_it_up_to_the_share_bound():
    from p2pweights.swarm.tracker.shares import SHARE_BOUND

    clock = Clock()
    s = OriginShares(64, batch=32, clock=clock)
    s.register(1), s.register(2)
    a = s.hand(1)
    for k in range(int(SHARE_BOUND) - 1):  # it reads one chunk of its share a second; the fleet stalls
        clock.t += 1.0
        s.held(1, [a[k]])
        s.expire(stalled=True)
        assert s.out[1] == sum(1 << i for i in a[k + 1:])  # what it has not read yet stays with it
    clock.t += 2.0
    s.held(1, [a[int(SHARE_BOUND) - 1]])
    s.expire(stalled=True)
    assert s.out[1] == 0  # SHARE_BOUND after it was handed, reading on or not, the rest goes back, and so
    assert s.hand(2) == a  # do its reads nobody vouched for: all for the other reader
