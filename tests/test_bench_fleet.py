"""The broadcast benchmark's instrument (bench/fleet.py, bench/bt_peer.py): the copy check
catches a single changed byte, and the libtorrent baseline delivers byte-identical copies on
the emulated hosts, also with one leecher killed mid-transfer.

The testbed cases skip without network namespaces (not root) or without libtorrent (in the
``test`` and ``bench`` extras); the Testbed ends every process it started and deletes its namespaces.
"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "netbed"))
sys.path.insert(0, str(ROOT / "bench"))

import fleet  # noqa: E402
from testbed import Testbed, list_netns  # noqa: E402

N = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from p2pweights.sources.synth import write_synthetic_model

    d = tmp_path_factory.mktemp("fleet-model")
    write_synthetic_model(d / "model", size_mb=8, shards=2)
    return str(d / "model")


def test_compare_copy_names_the_first_differing_byte(model, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    fleet.compare_copy(model, str(copy), host=1)          # identical: no error
    victim = copy / "model-00002-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[123457] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(fleet.CopyMismatch, match=r"host 1: model-00002-of-00002.safetensors .* byte 123457"):
        fleet.compare_copy(model, str(copy), host=1)
    victim.write_bytes(bytes(data[:-1]))
    with pytest.raises(fleet.CopyMismatch, match="bytes, the source"):
        fleet.compare_copy(model, str(copy), host=1)
    (copy / "config.json").unlink()
    with pytest.raises(fleet.CopyMismatch, match="config.json missing"):
        fleet.compare_copy(model, str(copy), host=1)


_ok, _why = Testbed.available()
try:
    import libtorrent  # noqa: F401
    _lt = True
except ImportError:
    _lt = False


@pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")
@pytest.mark.skipif(not _lt, reason="libtorrent not installed (the bench extra)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill", [False, True], ids=["all", "kill"])
def test_libtorrent_baseline_on_three_hosts(model, tmp_path, kill):
    torrent = str(tmp_path / "model.torrent")
    t = fleet.make_torrent(model, torrent, 256 << 10)
    assert t["piece_size"] == 256 << 10 and t["pieces"] == -(-t["total_size"] // (256 << 10))
    with Testbed(N + 1, rate_mbit=50) as tb:              # 8 MiB at 50 Mbit/s: S/3 arrives well before the end
        run_id = tb.run_id
        r = fleet.run_libtorrent(tb, model, torrent, N, str(tmp_path), kill=kill, timeout=90)
    assert not [ns for ns in list_netns() if run_id in ns]
    survivors = {1, 2, 3} - ({r["killed"]["host"]} if kill else set())
    assert set(r["exits"]) == survivors                   # each exited 0 with a byte-identical copy
    assert all(r["reports"][h]["bytes"] == r["size"] for h in survivors)
    assert r["seed_tx"] >= r["size"] / 2                  # the seeder sent at least part of a copy
    if kill:
        assert r["killed"]["rx"] >= r["size"] / 3


@pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")
@pytest.mark.timeout(120)
def test_warm_joins_start_before_the_clock_and_deliver_byte_identical_copies(model, tmp_path):
    """``broadcast.py --warm``: the joins are launched and imported first, each blocked until its
    go; the run is then timed from the go, and every copy is still checked byte for byte."""
    with Testbed(N + 1, rate_mbit=200) as tb:
        run_id = tb.run_id
        r = fleet.run_p2pw(tb, model, N, str(tmp_path), warm=True, timeout=90)
    assert not [ns for ns in list_netns() if run_id in ns]
    assert r["warm"] and set(r["exits"]) == {1, 2, 3}     # each exited 0 with a byte-identical copy
    assert all(r["reports"][h]["started_at"] >= 0 for h in r["exits"])  # join() after the go, not before
    assert len(list(tmp_path.glob("*.h[0-9].ready"))) == N                # each said it was ready before its go


def test_ab_reads_each_run_s_cases_and_says_in_how_many_pairs_b_was_faster():
    # bench/ab.py's own logic, on broadcast.py --json documents as the bench writes them
    import ab

    def doc(equal, slow2, leaves=(), cpu=4.0):
        return {"summaries": [
            {"case": "equal", "n": 8, "ratio": equal, "busy": 0.8, "cpu_per_gb": cpu, "write_cpu_per_gb": 2.5,
             "demoted": [[]]},
            {"case": "slow2", "n": 8, "ratio": slow2, "busy": 0.7, "cpu_per_gb": cpu + 1, "demoted": [list(leaves)]},
            {"case": "kill", "n": 8, "ratio": None, "failed": 1, "errors": ["timeout"]}]}

    b1, a1 = ab.summarize(doc(1.20, 1.40, [(1, 1.0), (2, 1.5)], cpu=3.0)), ab.summarize(doc(1.22, 1.50))
    b2, a2 = ab.summarize(doc(1.25, 1.45, cpu=3.5)), ab.summarize(doc(1.21, 1.55, cpu=3.4))
    assert b1["cases"]["slow2 N=8"]["leaves"] == ["h1 @ 1.0", "h2 @ 1.5"] and "kill N=8" not in b1["cases"]
    lines = ab.compare([(b1, a1), (b2, a2), ({"error": "bed failed"}, a1)])
    assert lines == ["equal N=8: B median 1.225 (1.200-1.250), A median 1.215 (1.210-1.220), B faster in 1 of 2 pairs"
                     "; CPU s/GB/peer B 3.25, A 3.70, B less in 1 of 2",
                     "slow2 N=8: B median 1.425 (1.400-1.450), A median 1.525 (1.500-1.550), B faster in 2 of 2 pairs"
                     "; CPU s/GB/peer B 4.25, A 4.70, B less in 1 of 2"]
    assert ab._line(3, "B", {"error": "bed failed"}) == "[3] B FAILED: bed failed"
    assert ab._line(1, "A", a1) == ("[1] A equal N=8 1.220 busy 80% cpu 4.00 (writing 2.50) leaves none; "
                                    "slow2 N=8 1.500 busy 70% cpu 5.00 leaves none")


def test_ab_and_trace_time_the_end_phase_of_a_traced_run():
    # the end phase: the last peer done after the seeder's last chunk (as its receivers verified it: the
    # first copy of the last chunk to leave it; receiver 2 gets chunk 1 again later from the seeder, lent)
    import ab

    def traced(seeder_last, done_last):  # two receivers; reports as fleet.py keeps them (seconds since launch)
        return {"tool": "p2pw", "case": "slow2", "n": 2, "time": done_last + 0.05, "reports": {
            "1": {"rank": 1, "started_at": 0.3, "done_at": 5.0, "chunks": [[0.1, 0, 0, 0], [seeder_last - 0.3, 1, 0, 0]]},
            "2": {"rank": 2, "started_at": 0.3, "done_at": done_last, "chunks": [[0.2, 0, 1, 1], [4.5, 1, 0, 1]]}}}

    doc = {"summaries": [{"case": "slow2", "n": 2, "ratio": 1.3, "busy": 0.6, "demoted": [[], []]}],
           "runs": [traced(4.0, 4.9), traced(4.2, 5.5)]}
    got = ab.summarize(doc)["cases"]["slow2 N=2"]
    assert got["end"] == pytest.approx((1.0 + 1.3) / 2)  # run 1: 5.0 - 4.0; run 2: 5.5 - 4.2
    assert " end 1.15 s " in ab._line(1, "B", {"cases": {"slow2 N=2": got}})
    phases = ab._trace_module().phases(doc["runs"][0])
    assert phases["seeder_first"] == pytest.approx(0.4) and phases["seeder_last"] == pytest.approx(4.0)
    assert phases["done_first"] == 4.9 and phases["done_last"] == 5.0 and phases["end"] == pytest.approx(1.0)


def test_trace_hop_lags_say_how_far_behind_its_source_and_the_seeder_a_host_verifies():
    import ab

    trace = ab._trace_module()  # bench/trace.py, by path
    got = {"1": [(0.1 * i, i, "S", True) for i in range(6)],          # from the seeder: its copies set the clock
           "2": [(0.1 * i + 0.05 * (1 + (i >= 4)), i, "1", True) for i in range(6)]}  # a hop 50 ms late, 100 at the end
    rows = {(h, s): (src, lags, behind) for h, s, src, lags, behind in trace.hop_lags(got, stripes=1, tail=2)}
    src, lags, behind = rows[("2", 0)]
    assert src == "1" and lags == pytest.approx([0.05, 0.05, 0.1]) and behind == pytest.approx(0.1)
    assert rows[("1", 0)] == ("S", [0.0, 0.0, 0.0], 0.0)


def test_start_cost_launches_the_joins_imports_alone_and_at_once():
    alone, together = fleet.start_cost(2, repeats=1)
    assert alone > 0 and together > 0  # seconds, whatever this hour's cores make of them


def test_broadcast_refuses_more_cores_per_host_than_the_machine_has():
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "bench" / "broadcast.py"), "--cpus-per-host", "1000", "--quick"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cpus-per-host 1000" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")
@pytest.mark.timeout(180)
def test_fleet_bed_delivers_byte_identical_copies_in_every_mode(tmp_path):
    """``bench/fleet_bed.py`` on two hosts and the S3 host: every copy is compared with the source inside the
    run (a difference exits non-zero); the origin is read once with p2pw and once per host alone."""
    pytest.importorskip("moto")
    import json
    import subprocess

    out = tmp_path / "bed.json"
    cp = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet_bed.py"), "--hosts", "2", "--size", "8MiB",
                         "--rate", "200", "--runs", "1", "--json", str(out)], capture_output=True, text=True,
                        timeout=170)
    assert cp.returncode == 0, cp.stderr[-2000:]
    doc = json.loads(out.read_text())
    read = {m: rs[0]["origin_read"] for m, rs in doc["runs"].items()}
    assert read["alone"] == 2 * doc["bytes"] and read["seeder"] == doc["bytes"]
    assert doc["bytes"] <= read["fleet"] <= 1.05 * doc["bytes"]
