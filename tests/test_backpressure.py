"""A slow child slows nobody else, and its parent's memory does not grow with the lag."""
import os
import time

from conftest import same_tree

from p2pweights.sources.synth import write_synthetic_model


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_slow_leaf_does_not_stall_its_siblings(procs, tmp_path):
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=16, shards=2)
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB", "--topology", "binomial")
    peers = {}
    # binomial placement by join order: 0 -> 1, 2, 4; 1 -> 3, 5.  Rank 3 is the slow one; rank 5 is its sibling.
    # Ranks 1, 2 and 4 stay after finishing, so the tree is exactly the rule's however fast they are.
    for rank in range(1, 6):
        env = {"P2PW_FAULTS": "delay_recv=40ms"} if rank == 3 else None
        extra = ["--stay"] if rank in (1, 2, 4) else []
        peers[rank] = procs.join(info["port"], tmp_path / f"r{rank}", *extra, env=env)
        seeder.wait_line(rf"joined as rank {rank} under rank {(0, 0, 0, 1, 0, 1)[rank]}")
    for rank in (2, 4):
        peers[rank].wait_line("p2pw: done")
    assert peers[5].wait(90) == 0, peers[5].output()
    # every fast peer, the slow one's sibling included, is done while the slow one still lags
    assert peers[3].popen.poll() is None, "the slow peer finished too early for this test to mean anything"
    assert list((tmp_path / "r3").glob("*.partial")), "the slow peer should still be incomplete"
    peers[1].wait_line("p2pw: done")
    # its parent (rank 1) keeps serving it; its memory stays flat while the lag grows
    before = rss_kib(peers[1].pid)
    time.sleep(2)
    assert peers[3].popen.poll() is None
    after = rss_kib(peers[1].pid)
    assert after - before < 8 * 1024, f"parent RSS grew {after - before} KiB while its child lagged"
    assert peers[3].wait(120) == 0, peers[3].output()
    for rank in peers:
        assert same_tree(model, tmp_path / f"r{rank}") == []
