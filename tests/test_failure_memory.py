"""Failure memory against strangers: a node that answers "model id mismatch" speaks only for itself.

Without a fleet key anyone can answer so; the refusal is remembered for the node that answered, so an honest
seeder of the pinned model is still joined at once.  A keyed fleet's refusal is authenticated and blocks every
join of the model.  Real seeders and joins for the first, the memory on disk with a fake clock for the rest."""
from __future__ import annotations

import os
import subprocess

import pytest

from conftest import ROOT, p2pw_argv, same_tree
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
