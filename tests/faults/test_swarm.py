"""The default plan under faults: a slow forwarder, a killed peer, a seeder gone for good.

Real processes on loopback with opt-in fault injection (P2PW_FAULTS) to make
one host slow; assertions are on bytes, counters, log lines and who finished,
never on time.
"""
import os
import signal

import pytest

from conftest import same_tree
from test_faults import report, verified, wait_fraction

from p2pweights.sources.synth import write_synthetic_model


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    write_synthetic_model(d, size_mb=16, shards=2)
    return d


def start(procs, tmp_path, model, n, env_for=lambda rank: None, extra=()):
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB", "--report", tmp_path / "seed.json")
    peers = {}
    for rank in range(1, n + 1):
        peers[rank] = procs.join(info["port"], tmp_path / f"r{rank}", "--report", tmp_path / f"r{rank}.json",
                                 "--parent-timeout", "3", *extra, env=env_for(rank))
        seeder.wait_line(rf"joined as rank {rank} under")
    return seeder, info, peers


def test_slow_forwarder_is_made_a_leaf_and_holds_nobody_back(procs, tmp_path, model):
    """Rank 1 (interior in stripe 0 of the forest) sends every chunk 40 ms late: a slow uplink.
    The tracker demotes it from the rates its partners report, and everyone else finishes, taking
    stripe 0 from other holders."""
    slow = {"P2PW_FAULTS": "delay_send=40ms"}
    fast = {"P2PW_FAULTS": "delay_recv=3ms"}  # everyone else paced too, so the transfer lasts a while
    seeder, info, peers = start(procs, tmp_path, model, 6, env_for=lambda r: slow if r == 1 else fast,
                                extra=("--stay",))
    for rank in range(2, 7):
        peers[rank].wait_line("p2pw: done", timeout=120)
        assert same_tree(model, tmp_path / f"r{rank}") == []
    seeder.wait_line(r"peer rank 1 delivers .* it becomes a leaf")
    sent = {r: report(tmp_path, r)["bytes_sent"] for r in range(2, 7)}
    peers[1].wait_line("p2pw: done", timeout=120)
    assert same_tree(model, tmp_path / "r1") == []
    # the slow host forwarded less than any fast forwarder of the same plan
    assert report(tmp_path, 1)["bytes_sent"] < max(sent.values()), (report(tmp_path, 1), sent)


def test_peer_killed_mid_transfer_costs_only_its_requests(procs, tmp_path, model):
    paced = {"P2PW_FAULTS": "delay_recv=10ms"}
    seeder, info, peers = start(procs, tmp_path, model, 6, env_for=lambda r: paced, extra=("--stay",))
    for rank in range(2, 7):  # every partner link is up (a peer that joins after the kill can only see silence)
        wait_fraction(tmp_path / f"r{rank}", info["total_size"], 0.02, peers[rank])
    wait_fraction(tmp_path / "r1", info["total_size"], 1 / 3, peers[1])
    os.kill(peers[1].pid, signal.SIGKILL)
    for rank in range(2, 7):
        peers[rank].wait_line("p2pw: done", timeout=120)
        assert same_tree(model, tmp_path / f"r{rank}") == []
    seeder.wait_line(r"peer rank 1 (disconnected|left|reported silent)")
    # its partners gave it up when its connections dropped, not after the silence timeout
    said = "".join(peers[r].output() for r in range(2, 7))
    assert "giving up partner rank 1: its connection dropped" in said, said
    assert "giving up partner rank 1: silent" not in said, said


def test_seeder_killed_for_good_peers_finish_what_others_hold_the_rest_give_up(procs, tmp_path, model):
    """The seeder dies after rank 1 holds everything: the others finish from the peers.  Then a
    seeder dies before anyone holds a full copy: the peers exit 1 with the message after
    --give-up-after, keeping what they verified."""
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB")
    first = procs.join(info["port"], tmp_path / "a", "--stay", "--report", tmp_path / "a.json")
    first.wait_line("staying to serve")
    late = joins_then_seeder_killed(procs, tmp_path, seeder, info, "b", give_up=5, pace="20ms")
    for k, p in enumerate(late):
        assert p.wait(120) == 0, p.output()
        assert same_tree(model, tmp_path / f"b{k}") == []

    # a second broadcast whose seeder dies before any peer has a whole copy
    seeder2, info2 = procs.seeder(model, "--chunk-size", "64KiB", "--port", "0")
    lonely = joins_then_seeder_killed(procs, tmp_path, seeder2, info2, "c", give_up=4, pace="30ms")
    for k, p in enumerate(lonely):
        assert p.wait(120) == 1, p.output()
        err = p.output()
        assert "no chunk arrived for 4 s" in err and "join again to resume" in err, err
        assert err.count("p2pw: error:") == 1, err
        assert verified(tmp_path / f"c{k}") > 0  # verified chunks are kept for a resume (.p2pw/progress.json)


def joins_then_seeder_killed(procs, tmp_path, seeder, info, name, give_up, pace):
    """Two paced joins into tmp_path/NAME0, NAME1; the seeder is killed once NAME0 holds 10 %."""
    joins = [procs.join(info["port"], tmp_path / f"{name}{k}", "--give-up-after", str(give_up),
                        "--parent-timeout", "2", env={"P2PW_FAULTS": f"delay_recv={pace}"}) for k in range(2)]
    wait_fraction(tmp_path / f"{name}0", info["total_size"], 0.1, joins[0])
    os.kill(seeder.pid, signal.SIGKILL)
    return joins
