"""The line-rate benchmark's instrument (bench/line_rate.py): one small run of each shape, p2pw and the raw
programs, pinned to K cores for two values of K, ends 0 with every copy compared to its source and a row per
case; the raw programs alone deliver exact copies."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "line_rate.py"


def test_one_small_run_per_shape_and_k_prints_a_row_each(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--sizes", "24MiB", "--where", "disk", "--modes", "hop,relay",
                        "--repeat", "1", "--chunk-size", "1MiB", "--cores", "1,2", "--disk-dir", str(tmp_path),
                        "--join-args", "--lanes 2 --io-threads 2", "--seed-args", "--io-threads 2",
                        "--json", str(tmp_path / "runs.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 2 |")]
    assert [ln.split(" | ")[:4] for ln in rows] == [["| 1", "24MiB", "disk", "hop"], ["| 1", "24MiB", "disk", "relay"],
                                                   ["| 2", "24MiB", "disk", "hop"], ["| 2", "24MiB", "disk", "relay"]]
    assert "lanes that carried chunks 2" in r.stdout  # the joins pulled over both lanes
    assert r.stdout.count("loop passes per chunk") == 4  # how often each row's loops woke
