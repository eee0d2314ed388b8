"""Failure memory against strangers: a node that answers "model id mismatch" speaks only for itself.

Without a fleet key anyone can answer so; the refusal is remembered for the node that answered, so an honest
seeder of the pinned model is still joined at once.  A keyed fleet's refusal is authenticated and blocks every
join of the model.  Likewise chunks that fail their checksums speak for the sources that sent them, through the
tracker that named those: another source of the model is joined at once.  Real seeders and joins for the
first of each, the memory on disk with a fake clock for the rest."""
from __future__ import annotations

import os
import subprocess

import pytest

from conftest import ROOT, left_everywhere, p2pw_argv, same_tree
from p2pweights.sources.synth import write_synthetic_model
from p2pweights.storage.modelcache import FailureMemory, FailurePolicy


def join(port, *args, env, timeout=120):
    return subprocess.run(p2pw_argv("join", "--parent", f"127.0.0.1:{port}", "--host", "127.0.0.1", "-q", *args),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ, **env))


@pytest.mark.timeout(240)
def test_a_strangers_mismatch_does_not_block_the_honest_seeder(procs, tmp_path):
    env = {"P2PW_CACHE_DIR": str(tmp_path / "p2pw-cache")}
    write_synthetic_model(tmp_path / "wanted", size_mb=1, shards=1)
    write_synthetic_model(tmp_path / "other", size_mb=1, shards=1, seed=7)
    _, s_info = procs.seeder(tmp_path / "other", env=env)  # any node that answers "model id mismatch"
    _, h_info = procs.seeder(tmp_path / "wanted", env=env)
    wanted = h_info["model_id"]
    assert s_info["model_id"] != wanted

    r = join(s_info["port"], "--model-id", wanted, env=env)
    assert r.returncode == 1 and "model id mismatch" in r.stderr and r.stderr.count("p2pw: error:") == 1, r.stderr
    # a join through the stranger again is refused from memory
    r = join(s_info["port"], "--model-id", wanted, env=env)
    assert r.returncode == 1 and "remembered" in r.stderr and "mismatch" in r.stderr, r.stderr
    # the honest seeder of the pinned model is joined at once: the stranger spoke for itself only
    r = join(h_info["port"], "--model-id", wanted, "--out", tmp_path / "copy", env=env)
    assert r.returncode == 0, r.stderr
    assert same_tree(tmp_path / "wanted", tmp_path / "copy") == []


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_an_unkeyed_refusal_is_tied_to_the_node_that_answered(tmp_path):
    clock = Clock()
    memory = FailureMemory(str(tmp_path / "failures"), FailurePolicy(clock))
    rec = memory.refused("ab12cd34", "10.0.0.9:7420 refused us: model id mismatch", "10.0.0.9:7420", keyed=False)
    assert rec["tracker"] == "10.0.0.9:7420" and rec["cause"] == "refused"
    assert memory.blocking("ab12cd34", "/out", tracker="10.0.0.9:7420") == rec
    assert memory.blocking("ab12cd34", "/out", tracker="10.0.0.1:7420") is None  # the honest seeder
    assert memory.blocking("ab12cd34", "/out") is None  # a check that names no tracker
    clock.t += 3600
    assert memory.blocking("ab12cd34", "/out", tracker="10.0.0.9:7420") is None  # the backoff is over
    memory.clear("ab12cd34")
    assert list(memory.records()) == []


def test_a_keyed_fleets_refusal_blocks_every_join_of_the_model(tmp_path):
    memory = FailureMemory(str(tmp_path / "failures"), FailurePolicy(Clock()))
    rec = memory.refused("ab12cd34", "model id mismatch", "10.0.0.9:7420", keyed=True)
    assert "tracker" not in rec
    assert memory.blocking("ab12cd34", "/out", tracker="10.0.0.1:7420") == rec
    assert memory.blocking("ab12cd34", "/out") == rec


@pytest.mark.timeout(240)
def test_a_source_serving_garbage_does_not_block_an_honest_one(procs, tmp_path):
    """Every chunk from one seeder fails its checksums: the failure is remembered for that seeder (joins through
    it are refused from memory, ``cache ls`` shows it), and an honest seeder of the same model is joined at once."""
    env = {"P2PW_CACHE_DIR": str(tmp_path / "p2pw-cache")}
    write_synthetic_model(tmp_path / "model", size_mb=2, shards=1)
    _, bad = procs.seeder(tmp_path / "model", "--chunk-size", "64KiB",
                          env=dict(env, P2PW_FAULTS="corrupt=1.0,seed=1"))
    _, honest = procs.seeder(tmp_path / "model", "--chunk-size", "64KiB", env=env)
    mid = bad["model_id"]
    assert honest["model_id"] == mid

    r = join(bad["port"], "--model-id", mid, env=env)
    assert r.returncode == 1 and "checksums" in r.stderr and r.stderr.count("p2pw: error:") == 1, r.stderr
    assert f"bad chunks from 127.0.0.1:{bad['port']}" in r.stderr, r.stderr
    left_everywhere(bad["port"])  # the plan of the next join names the bad seeder alone, not the join that ended
    r = join(bad["port"], "--model-id", mid, "--out", tmp_path / "again", env=env)
    assert r.returncode == 1 and "remembered" in r.stderr and "checksums" in r.stderr, r.stderr
    r = subprocess.run(p2pw_argv("cache", "ls"), capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, **env))
    assert r.returncode == 0 and "not retried until" in r.stdout and "checksums" in r.stdout, r.stdout
    # another source of the same model: nothing it sent ever failed
    r = join(honest["port"], "--model-id", mid, "--out", tmp_path / "copy", env=env)
    assert r.returncode == 0, r.stderr
    assert same_tree(tmp_path / "model", tmp_path / "copy") == []


def test_a_checksum_failure_speaks_for_its_tracker_and_sources_only(tmp_path):
    clock = Clock()
    memory = FailureMemory(str(tmp_path / "failures"), FailurePolicy(clock))
    rec = memory.bad_sources("ab12cd34", "every source failed its checksums", "10.0.0.9:7420", ["10.0.0.5:7421"])
    assert rec["cause"] == "checksums" and rec["sources"] == ["10.0.0.5:7421"] and rec["count"] == 1
    # the same tracker naming only sources that failed: refused
    assert memory.blocking("ab12cd34", tracker="10.0.0.9:7420", sources=["10.0.0.5:7421"]) == rec
    # a source not among them, another tracker, a check that names no sources yet: not refused
    assert memory.blocking("ab12cd34", tracker="10.0.0.9:7420", sources=["10.0.0.5:7421", "10.0.0.6:7421"]) is None
    assert memory.blocking("ab12cd34", tracker="10.0.0.1:7420", sources=["10.0.0.5:7421"]) is None
    assert memory.blocking("ab12cd34", tracker="10.0.0.9:7420") is None
    assert memory.blocking("ab12cd34", tracker="10.0.0.9:7420", sources=[]) is None
    # again through that tracker: the sources add up, the backoff doubles
    rec = memory.bad_sources("ab12cd34", "every source failed its checksums", "10.0.0.9:7420", ["10.0.0.6:7421"])
    assert rec["sources"] == ["10.0.0.5:7421", "10.0.0.6:7421"] and rec["count"] == 2
    assert memory.blocking("ab12cd34", tracker="10.0.0.9:7420", sources=["10.0.0.6:7421", "10.0.0.5:7421"]) == rec
    assert len(list(memory.records())) == 1
