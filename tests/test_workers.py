"""The worker pool that verifies and writes received chunks off the event loop: its bound, the loop's wait for
a verdict, a second copy of a chunk waiting behind the first, and its guarantees end to end: a corrupt chunk
never reaches a file or a partner, copies end byte-exact, bad chunks are counted (disk and tmpfs)."""
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import forwarding_joins, same_tree

from p2pweights import api
from p2pweights.sources.chunker import build
from p2pweights.sources.manifest import chunk_hasher
from p2pweights.sources.synth import write_synthetic_model
from p2pweights.storage import store as store_mod
from p2pweights.storage.cache import memory_backed
from p2pweights.storage.store import Store
from p2pweights.storage.workers import ChunkWorkers, Job, default_workers, in_flight_limit
from p2pweights.swarm.node.intake import Intake
from p2pweights.swarm.node.node import Stats

C = 64 << 10


@pytest.fixture
def blob(tmp_path):
    """(manifest, the blob's bytes) of a one-file checkpoint of 6 chunks and a bit."""
    rng = np.random.default_rng(7)
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(rng.integers(0, 256, 6 * C + 100, dtype=np.uint8).tobytes())
    m, _, _ = build(src, C)
    return m, bytearray((src / "w.bin").read_bytes())


def chunk_of(m, data, i, corrupt=False) -> bytearray:
    lo, hi = m.chunk_span(i)
    b = bytearray(data[lo:hi])
    if corrupt:
        b[len(b) // 2] ^= 0xFF
    return b


class Gated(Store):
    """A store in memory whose ``land`` waits for ``gate`` (a worker busy writing) and records what it got."""

    def __init__(self, manifest):
        super().__init__(manifest)
        self.gate, self.landed = threading.Event(), []

    def land(self, index, data, into=None):
        self.gate.wait(10)
        self.landed.append(index)
        return super().land(index, data, into)


def test_default_pool_size_leaves_small_hosts_as_they_were(monkeypatch):
    monkeypatch.delenv("P2PW_WORKERS", raising=False)
    assert [default_workers(c) for c in (1, 2, 3, 4, 5, 16, 64)] == [0, 0, 2, 3, 4, 4, 4]
    monkeypatch.setenv("P2PW_WORKERS", "3")
    assert default_workers(2) == 3
    assert in_flight_limit(0) == 0 and in_flight_limit(4) == 10


def test_the_pool_holds_at_most_its_limit_and_the_loop_sleeps_until_a_verdict(blob):
    m, data = blob
    store = Gated(m)
    pool = ChunkWorkers(store, threads=2, limit=3)
    try:
        for i in range(3):
            assert pool.submit(Job(i, 1, None, chunk_of(m, data, i)))
        assert pool.full and pool.in_flight == 3 and pool.take() == []  # both workers stuck in land
        threading.Timer(0.3, store.gate.set).start()
        began, cpu = time.monotonic(), time.thread_time()
        done = pool.wait()
        assert time.monotonic() - began >= 0.25 and time.thread_time() - cpu < 0.1  # asleep, not spinning
        assert done and all(j.ok and j.data is None and j.frame is None for j in done)
        deadline = time.monotonic() + 10
        while pool.in_flight and time.monotonic() < deadline:
            done += pool.wait()
        assert sorted(j.index for j in done) == [0, 1, 2] and not pool.full and pool.waits >= 1
        for i in range(3):
            assert bytes(store.chunk(i)) == bytes(chunk_of(m, data, i))
    finally:
        store.gate.set()
        pool.close()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("p2pw-worker"))


@pytest.mark.parametrize("threads", [0, 2])
def test_a_chunk_failing_its_hash_is_never_put_anywhere(blob, threads):
    m, data = blob
    store = Gated(m)
    store.gate.set()
    pool = ChunkWorkers(store, threads=threads)
    jobs = [Job(i, 1, None, chunk_of(m, data, i, corrupt=i % 2)) for i in range(m.n_chunks)]
    jobs.append(Job(0, 1, None, chunk_of(m, data, 0)[:-1]))  # short
    done = []
    for job in jobs:
        if not pool.submit(job):
            done.append(pool.check(job))
    while pool.in_flight:
        done += pool.wait()
    pool.close()
    assert sorted(store.landed) == [i for i in range(m.n_chunks) if not i % 2]
    assert [j.ok for j in sorted(done, key=lambda j: (j.index, j.got))] == \
        [False] + [not i % 2 for i in range(m.n_chunks)]
    for i in range(m.n_chunks):  # the blob holds the verified chunks, zeros where a chunk was corrupt
        assert bytes(store.chunk(i)) == (bytes(chunk_of(m, data, i)) if not i % 2 else bytes(len(store.chunk(i))))


class FakeNode:
    """What the intake uses of a node: its store, the pull scheduler's verbs, stats, publish, the inbox, and
    its partners' links (by whose address a bad chunk is counted; none here)."""

    class Pull:
        def __init__(self):
            self.links = {1: type("L", (), {"bad": 0})(), 2: type("L", (), {"bad": 0})()}
            self.plan, self.stripes, self.heard = [1], 1, []

        def arrived(self, rank, index, ok):
            self.heard.append((rank, index, ok))
            self.links[rank].bad += not ok

    def __init__(self, store):
        self.store, self.stats, self.pull, self.published = store, Stats(), self.Pull(), []
        self.partners = type("Partners", (), {"links": {}})()
        self.clock, self.fatal = time.monotonic, None

    def post(self, verb, body=b""):
        pass

    def publish(self, index):
        self.published.append(index)
        self.store.verified(index)

    def _fail(self, message):
        self.fatal = message


def drain(intake):
    while intake.pool.in_flight:
        for job in intake.pool.wait():
            intake.verdict(job)


def test_a_second_copy_waits_behind_the_first_and_is_taken_only_if_the_first_is_bad(blob):
    m, data = blob
    store = Gated(m)
    store.gate.set()
    node = FakeNode(store)
    intake = Intake(node, workers=2)
    try:
        intake.arrived(1, 3, chunk_of(m, data, 3, corrupt=True))  # bad, then a good copy from another partner
        intake.arrived(2, 3, chunk_of(m, data, 3))
        intake.arrived(1, 4, chunk_of(m, data, 4))  # good, then a second good copy: never written twice
        intake.arrived(2, 4, chunk_of(m, data, 4))
        assert intake.busy(3) and intake.busy(4) and intake.pool.in_flight == 2  # the second copies wait
        drain(intake)
    finally:
        intake.close()
    assert sorted(node.published) == [3, 4] and sorted(store.landed) == [3, 4]
    assert (1, 3, False) in node.pull.heard and (2, 3, True) in node.pull.heard
    assert node.stats.bad_chunks == 1 and node.stats.duplicates == 1 and not intake.busy(3) and not intake.busy(4)
    assert bytes(store.chunk(3)) == bytes(chunk_of(m, data, 3)) and node.fatal is None


@pytest.fixture(params=["disk", "tmpfs"])
def where(request, tmp_path):
    if request.param == "disk":
        yield tmp_path
        return
    if not memory_backed("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm here")
    path = Path(f"/dev/shm/p2pw-workers-test-{id(request)}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_nothing_unverified_is_written_by_the_workers_and_the_copy_is_exact(procs, tmp_path, where, monkeypatch):
    """A join in this process with 2 workers, its seeder corrupting a tenth of what it sends: every write into
    the copy (``Store.land``, on a worker's thread) carries bytes that hash to the manifest's."""
    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=4, shards=2)
    seeder, info = procs.seeder(src, "--chunk-size", "64KiB", "--exit-after", 1,
                                env={"P2PW_FAULTS": "corrupt=0.03,seed=11"})  # (fewer than 4 bad: no give-up)
    wrong, threads, land = [], set(), Store.land

    def checked_land(self, index, data, into=None):
        threads.add(threading.current_thread().name)
        if chunk_hasher(self.manifest.hash)(data) != self.manifest.chunks[index]:
            wrong.append(index)
        return land(self, index, data, into)

    monkeypatch.setattr(store_mod.Store, "land", checked_land)
    dl = api.join(f"127.0.0.1:{info['port']}", out=str(where / "copy"), host="127.0.0.1", workers=2)
    try:
        dl.wait(60)
        report = dl.threads()
    finally:
        dl.close()
    assert wrong == [] and threads and all(t.startswith("p2pw-worker") for t in threads), (wrong, threads)
    assert dl.stats.bad_chunks > 0, "the fault injection corrupted nothing: the test would prove nothing"
    assert same_tree(src, where / "copy") == []
    assert report["workers"] == 2 and report["checked_on_loop"] == 0 and report["threads"]["workers"] > 0


def test_joins_with_workers_forward_no_corrupt_chunk_and_end_exact(procs, tmp_path, where):
    """Two joins with 2 workers each, forwarding to each other, each corrupting a fifth of what it sends,
    every copy exact, every bad chunk counted and fetched again."""
    _, reports = forwarding_joins(procs, tmp_path, where, "--workers", 2)
    for r in reports:
        assert r["workers"] == 2 and r["checked_on_loop"] == 0 and r["threads"]["workers"] > 0
        assert r["refetched"] == r["bad_chunks"]


def test_a_corrupt_chunk_never_reaches_a_partner_through_a_join_with_workers(procs, tmp_path):
    """A binomial tree (no partners: each peer has one source) of 5 joins with 2 workers each, the seeder
    corrupting a fiftieth of what it sends: the peers under the seeder see bad chunks, the peers under a
    peer (which forwards only what it verified) see none.  Every peer stays, so the tree does not change."""
    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=16, shards=2)
    seeder, info = procs.seeder(src, "--chunk-size", "64KiB", "--topology", "binomial",
                                env={"P2PW_FAULTS": "corrupt=0.02,seed=3,delay_send=2ms"})
    parent, peers = {}, {}
    for rank in range(1, 6):
        peers[rank] = procs.join(info["port"], tmp_path / f"r{rank}", "--report", tmp_path / f"r{rank}.json",
                                 "--workers", 2, "--stay")
        parent[rank] = int(seeder.wait_line(rf"joined as rank {rank} under rank (\d+)\b").group(1))
    for rank, p in peers.items():
        p.wait_line("staying to serve", timeout=90)
        assert same_tree(src, tmp_path / f"r{rank}") == []
    reports = {r: json.loads((tmp_path / f"r{r}.json").read_text()) for r in peers}
    under_seeder = [r for r in peers if parent[r] == 0]
    under_peer = [r for r in peers if parent[r] != 0]
    assert under_peer, parent  # binomial: rank 3 is under rank 1
    assert sum(reports[r]["bad_chunks"] for r in under_seeder) > 0, "the fault injection corrupted nothing"
    assert all(reports[r]["bad_chunks"] == 0 for r in under_peer), (parent, reports)
    assert all(r["workers"] == 2 for r in reports.values())
