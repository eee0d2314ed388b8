"""Reliability under faults: dead peers, corrupt chunks, restarts, stopped children, hostile frames.

Real processes on loopback.  Transfers are slowed with opt-in fault injection
(P2PW_FAULTS) so that faults land mid-transfer; assertions are on bytes,
counters and the tree, never on time.
"""
import json
import os
import signal
import time

import pytest

from conftest import same_tree
from test_bad_input import spray

from p2pweights.sources.synth import write_synthetic_model

SLOW = {"P2PW_FAULTS": "delay_recv=15ms"}
PARENT_OF = {1: 0, 2: 0, 3: 1, 4: 0, 5: 1, 6: 2, 7: 3}


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    write_synthetic_model(d, size_mb=16, shards=2)
    return d


def verified(path) -> int:
    """Bytes a joiner writing into ``path`` has verified, from its DIR/.p2pw/progress.json (files are
    preallocated, so their size on disk says nothing)."""
    try:
        return json.loads((path / ".p2pw" / "progress.json").read_text())["bytes"]
    except (OSError, ValueError, KeyError):
        return 0


def wait_fraction(path, total, fraction, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while verified(path) < fraction * total:
        assert proc.popen.poll() is None, proc.output()
        assert time.monotonic() < deadline, f"{path} never reached {fraction:.0%}"
        time.sleep(0.02)


def start_tree(procs, tmp_path, model, n, env_for=lambda rank: SLOW, seeder_env=None):
    """A binomial plan (its repair rules are what these tests pin down); tests/faults/test_swarm.py
    covers the default plan."""
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB", "--topology", "binomial", env=seeder_env)
    peers = {}
    for rank in range(1, n + 1):
        peers[rank] = procs.join(info["port"], tmp_path / f"r{rank}", "--stay", "--report", tmp_path / f"r{rank}.json",
                                 "--parent-timeout", "3", env=env_for(rank))
        seeder.wait_line(rf"joined as rank {rank} under rank {PARENT_OF[rank]}\b")
    return seeder, info, peers


def report(tmp_path, rank):
    path = tmp_path / f"r{rank}.json"
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:  # written just after the summary line
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_kill_interior_peer_subtree_is_reattached(procs, tmp_path, model):
    seeder, info, peers = start_tree(procs, tmp_path, model, 7)
    wait_fraction(tmp_path / "r1", info["total_size"], 1 / 3, peers[1])
    os.kill(peers[1].pid, signal.SIGKILL)
    for rank in (2, 3, 4, 5, 6, 7):
        peers[rank].wait_line("p2pw: done", timeout=90)
        assert same_tree(model, tmp_path / f"r{rank}") == []
    # the tracker moved rank 1's children (3 and 5) up; rank 7 stayed under rank 3
    seeder.wait_line(r"peer rank 1 (disconnected|reported silent).*rank 3.*rank 5|rank 3 lost parent rank 1")
    for rank in (3, 5):
        assert report(tmp_path, rank)["reparented"] >= 1
    assert report(tmp_path, 7)["parents"] == [3] and report(tmp_path, 7)["reparented"] == 0


def test_corrupt_link_never_poisons_the_subtree(procs, tmp_path, model):
    seeder, info, peers = start_tree(procs, tmp_path, model, 5, env_for=lambda rank: None,
                                     seeder_env={"P2PW_FAULTS": "corrupt=0.02,seed=3,delay_send=2ms"})
    for rank in peers:
        try:
            peers[rank].wait_line("p2pw: done", timeout=90)
        except AssertionError:
            raise AssertionError("\n".join(f"--- rank {r}\n" + p.output() for r, p in peers.items()))
        assert same_tree(model, tmp_path / f"r{rank}") == []
    bad_from_seeder = sum(report(tmp_path, r)["bad_chunks"] for r in (1, 2, 4))
    assert bad_from_seeder > 0, "the fault injection corrupted nothing: the test would prove nothing"
    for rank in (3, 5):  # children of a peer that received corrupt chunks saw none from it
        assert report(tmp_path, rank)["bad_chunks"] == 0


def test_restarted_peer_fetches_only_what_it_lacked(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB")
    out = tmp_path / "p"
    first = procs.join(info["port"], out, env={"P2PW_FAULTS": "hang_after=160"})  # 160 of 257 chunks, then hung
    wait_fraction(out, info["total_size"], 0.5, first)  # (progress.json says so within a second)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    again = procs.join(info["port"], out, "--report", tmp_path / "again.json")
    assert again.wait(90) == 0, again.output()
    assert same_tree(model, out) == []
    r = json.loads((tmp_path / "again.json").read_text())
    n_chunks = -(-info["total_size"] // 65536)
    assert r["resumed"] >= n_chunks // 3, r
    assert r["received"] <= n_chunks - r["resumed"] + 8, r  # at most one credit window fetched twice
    assert "resumed from" in again.output()


def test_stopped_child_does_not_stall_siblings_and_recovers(procs, tmp_path, model):
    seeder, info, peers = start_tree(procs, tmp_path, model, 4, env_for=lambda rank: SLOW)
    os.kill(peers[2].pid, signal.SIGSTOP)
    try:
        for rank in (1, 3, 4):
            peers[rank].wait_line("p2pw: done", timeout=90)
        assert not any(line.startswith("p2pw: done") for line in peers[2].lines)
        assert seeder.popen.poll() is None
    finally:
        os.kill(peers[2].pid, signal.SIGCONT)
    peers[2].wait_line("p2pw: done", timeout=90)
    assert same_tree(model, tmp_path / "r2") == []


def test_seeder_killed_and_restarted_on_the_same_port(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB")
    port = info["port"]
    peers = [procs.join(port, tmp_path / f"p{k}", "--report", tmp_path / f"p{k}.json", "--parent-timeout", "2",
                        env=SLOW) for k in range(3)]
    wait_fraction(tmp_path / "p0", info["total_size"], 1 / 3, peers[0])
    os.kill(seeder.pid, signal.SIGKILL)
    seeder.wait(10)
    time.sleep(1)
    again = procs.start("seed", model, "--port", port, "--host", "127.0.0.1", "--chunk-size", "64KiB",
                        "--report", tmp_path / "seed2.json")
    for k, p in enumerate(peers):
        assert p.wait(60) == 0, p.output() + "\n--- seeder\n" + again.output()
        assert same_tree(model, tmp_path / f"p{k}") == []
    again.popen.terminate()  # SIGTERM: the seeder writes its report and exits 0
    assert again.wait(60) == 0, again.output()
    second = json.loads((tmp_path / "seed2.json").read_text())
    assert second["model_id"] == info["model_id"]
    # a restarted seeder reads only what peers still ask of it, not another whole copy
    assert second["bytes_read"] < info["total_size"], second


def test_fuzzing_seeder_and_relay_ports_during_a_broadcast(procs, tmp_path, model):
    seeder, info, peers = start_tree(procs, tmp_path, model, 3)
    peers[1].wait_line("p2pw: done", timeout=90)
    relay_port = int(report(tmp_path, 1)["listen"].rsplit(":", 1)[1])
    for port in (info["port"], relay_port):
        spray(port, 300)
    for rank in (2, 3):
        peers[rank].wait_line("p2pw: done", timeout=90)
        assert same_tree(model, tmp_path / f"r{rank}") == []
    assert seeder.popen.poll() is None and peers[1].popen.poll() is None
    peers[1].wait_line("unknown peer")


def test_source_changed_under_a_running_seeder_is_reported_not_served(procs, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    blob = src / "weights.bin"
    blob.write_bytes(os.urandom(8 * 65536))
    first, info = procs.seeder(src, "--chunk-size", "64KiB")  # scans, files the manifest in the catalog
    first.popen.terminate()
    first.wait(30)
    seeder, again = procs.seeder(src, "--chunk-size", "64KiB")  # restarted: serves from the catalog, reads lazily
    assert again["model_id"] == info["model_id"]
    seeder.wait_line("manifest known")
    with open(blob, "r+b") as f:  # the checkpoint changes under the running seeder
        f.seek(3 * 65536 + 10)
        f.write(b"tampered")
    peer = procs.join(again["port"], tmp_path / "p")
    seeder.wait_line(r"chunk 3 read from storage does not match the manifest")
    assert peer.popen.poll() is None  # it never gets the bad chunk, so it cannot finish
    assert not (tmp_path / "p" / "weights.bin").exists()


def test_alive_parent_that_sends_nothing_is_replaced(procs, tmp_path, model):
    """Rank 1 answers heartbeats but drops every chunk it should forward: rank 3 moves up and finishes."""
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB", "--topology", "binomial")
    env = {1: {"P2PW_FAULTS": "drop=1.0"}, 2: None, 3: None}
    peers = {}
    for rank in (1, 2, 3):
        extra = ["--stay"] if rank < 3 else []
        peers[rank] = procs.join(info["port"], tmp_path / f"r{rank}", "--report", tmp_path / f"r{rank}.json",
                                 "--parent-timeout", "1", *extra, env=env[rank])
        seeder.wait_line(rf"joined as rank {rank} under rank {PARENT_OF[rank]}\b")
    assert peers[3].wait(90) == 0, peers[3].output()
    assert same_tree(model, tmp_path / "r3") == []
    assert "stalled: no chunk" in peers[3].output()
    assert report(tmp_path, 3)["parents"] == [0] and report(tmp_path, 3)["reparented"] >= 1


def test_disk_full_on_a_leaf_is_a_clear_error_and_nothing_looks_complete(procs, tmp_path, model):
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        seeder, info = procs.seeder(model, "--chunk-size", "64KiB")
        leaf = procs.join(info["port"], small / "copy")
        assert leaf.wait(60) == 1, leaf.output()
        assert len(leaf.lines) == 1 and leaf.lines[0].startswith("p2pw: error:"), leaf.output()
        # found before the first request: the bytes needed and free are named, nothing is written
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        needed = sum(os.path.getsize(model / n) for n in os.listdir(model))
        assert "not enough space" in leaf.lines[0], leaf.lines[0]
        assert f"needs {needed} bytes" in leaf.lines[0] and f"{free} bytes free" in leaf.lines[0], leaf.lines[0]
        assert "Traceback" not in leaf.output()
        assert not (small / "copy").exists() and os.listdir(small) == [], os.listdir(small)
        assert seeder.popen.poll() is None
    finally:
        subprocess.run(["umount", "-l", str(small)])
