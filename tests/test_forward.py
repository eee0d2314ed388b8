"""Forwarded chunks that no ring slot holds any more: read back from the copy's files (by the workers, or by the
loop without them) into a slot and sent from there, byte-exact, and a corrupt chunk never forwarded."""
import json

import pytest

from conftest import forwarding_joins, same_tree

from p2pweights.sources.synth import write_synthetic_model


@pytest.mark.parametrize("workers", [0, 2])
def test_joins_with_a_ring_of_four_slots_forward_exact_copies(procs, tmp_path, workers):
    """Two joins on disk whose rings hold 4 chunks (an eighth of a 2 MiB memory budget is 4 of 64 KiB),
    forwarding to each other and corrupting a fifth of what they send: both copies exact, every bad chunk
    fetched again."""
    _, reports = forwarding_joins(procs, tmp_path, tmp_path, "--memory-budget", "2MiB", "--workers", workers)
    for r in reports:
        assert r["refetched"] == r["bad_chunks"]
        assert r["ring"] is None or r["ring"]["most_slots"] == 4 + (2 * workers + 2 if workers else 0), r["ring"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_complete_join_serves_a_late_one_chunks_read_back_from_its_files(procs, tmp_path, workers):
    """A join complete on disk (its ring: 4 chunks of 64) stays; a second join placed under it for a stripe
    takes that stripe from it, so nearly every chunk it is sent was read back from the files: its copy is
    exact."""
    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=4, shards=2)
    seeder, info = procs.seeder(src, "--chunk-size", "64KiB")
    first = procs.join(info["port"], tmp_path / "a", "--memory-budget", "2MiB", "--workers", workers, "--stay",
                       "--report", tmp_path / "a.json")
    first.wait_line("staying to serve")
    if json.loads((tmp_path / "a.json").read_text())["ring"] is None:
        pytest.skip("this filesystem takes no O_DIRECT: the copy was written without a ring")
    late = procs.join(info["port"], tmp_path / "b", "--report", tmp_path / "b.json")
    assert late.wait(60) == 0, late.output()
    report = json.loads((tmp_path / "b.json").read_text())
    assert 1 in report["parents"], report["parents"]  # rank 1, the first join, is a planned source of b
    assert same_tree(src, tmp_path / "b") == [] and report["bad_chunks"] == 0


def test_late_joins_asking_one_complete_join_for_the_same_evicted_chunks_end_exact(procs, tmp_path):
    """A complete join on disk with workers (its ring: 4 chunks of 64) stays; four joins arriving together
    take stripes from it, so several ask it for the same chunks its ring no longer holds at about the same time:
    a chunk being read back for one is sent to the others from the same slot, every copy is exact, and the
    complete join is still serving (two reads of one chunk once left it in two slots, and a later take of them
    failed that join with a KeyError: `tests/test_ring.py` holds the case without the race)."""
    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=4, shards=2)
    seeder, info = procs.seeder(src, "--chunk-size", "64KiB")
    first = procs.join(info["port"], tmp_path / "a", "--memory-budget", "2MiB", "--workers", 2, "--stay",
                       "--report", tmp_path / "a.json")
    first.wait_line("staying to serve")
    if json.loads((tmp_path / "a.json").read_text())["ring"] is None:
        pytest.skip("this filesystem takes no O_DIRECT: the copy was written without a ring")
    late = [procs.join(info["port"], tmp_path / f"late{k}", "--report", tmp_path / f"late{k}.json")
            for k in range(4)]
    for k, j in enumerate(late):
        assert j.wait(60) == 0, j.output()
        assert same_tree(src, tmp_path / f"late{k}") == []
    assert first.popen.poll() is None, first.output()  # still serving: no internal error
