#!/usr/bin/env python3
"""Broadcast on emulated hosts: one seeder, N peers, each host's uplink capped.

    sudo .venv/bin/python bench/broadcast.py [--size 256MiB] [--peers 1,2,4,8,16]
        [--topologies star,binomial,chain,striped:2,kary:2] [--rate 400] [--chunk-size 1MiB]
        [--repeat 1] [--disk] [--quick]

For each N it builds a testbed of N+1 hosts (``bench/netbed/testbed.py``:
namespaces on a bridge, htb caps), runs ``p2pw seed --topology T`` in host 0
and ``p2pw join`` in hosts 1..N, all joins launched at once, for every
topology asked for (the star baseline included: every peer pulls from the
seeder), in the same invocation.  Per run it prints:

* ``time``: from the first peer's ``join()`` call to the last peer's last
  verified chunk (the join reports carry wall-clock ``started_at``/``done_at``);
* ``t/floor``: time over floor = S / B (model size over the configured rate);
* ``seed tx/S``: frame bytes host 0's eth0 sent over S (the kernel's count);
* ``worst peer``: the slowest peer's own seconds (its join() to done);
* ``CPU s/GB/peer``: user+sys seconds of the peer processes per GB each received;
* ``CPU busy``: both cores' busy fraction during the transfer (shared machine);
* ``sim``: ``p2pweights.simulate`` for the same N, S, B, chunk and topology, and
  sim / measured.

The rate for large N: a 2-core VM cannot move N x B through N processes for
every N.  After each N the benchmark knows the peers' CPU seconds per byte and
picks the next N's rate so that the peers need at most ``--cpu-budget`` of the
cores (rounded down to 50 Mbit/s, never above ``--rate``); the table says which
rate each row ran at, and the busy column shows whether the CPU or the caps were
the limit.  Peers keep the model in memory unless ``--disk`` (then each writes
its copy under a temporary directory, as a real deployment would).

Results go to stdout and to ``bench/results/broadcast.md`` (``--md``).
Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "netbed"))

from testbed import Testbed, cpu_busy, cpu_times  # noqa: E402

from p2pweights.cli import size as parse_size  # noqa: E402
from p2pweights.simulate import simulate  # noqa: E402
from p2pweights.synth import write_synthetic_model  # noqa: E402

PORT = 7420
P2PW = [sys.executable, "-m", "p2pweights"]
# A peer: `p2pw join ...` through the CLI, but with the modules imported first and join() called
# at a common wall-clock time, so that N Python start-ups on 2 cores do not stagger the joins.
JOIN_AT = ("import sys, time; import p2pweights.cli as cli, p2pweights.api; "
           "t = float(sys.argv[1]); time.sleep(max(0.0, t - time.time())); "
           "sys.exit(cli.main(sys.argv[2:]))")
DEFAULT_TOPOLOGIES = "star,binomial,chain,striped:2,kary:2"


def _wait4(p: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """Wait for ``p``; returns (exit status, its user+sys CPU seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return p.returncode, ru.ru_utime + ru.ru_stime
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {p.pid} still running after {timeout:.0f} s")
        time.sleep(0.02)


def run_once(tb: Testbed, model_dir: str, n: int, topo: str, chunk: int, work: str, disk: bool,
             timeout: float) -> dict:
    """One broadcast to hosts 1..n; returns the measurements of that run."""
    tag = f"{topo.replace(':', '')}-{n}-{time.monotonic_ns()}"
    ready, seed_report = f"{work}/{tag}.ready", f"{work}/{tag}.seed.json"
    seeder = tb.popen(0, [*P2PW, "seed", model_dir, "--topology", topo, "--port", str(PORT),
                          "--host", tb.addr(0), "--advertise", f"{tb.addr(0)}:{PORT}",
                          "--chunk-size", str(chunk), "--exit-after", str(n), "--ready", ready,
                          "--report", seed_report], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t_wait = time.monotonic() + 120
    while not os.path.exists(ready):
        if seeder.poll() is not None:
            raise RuntimeError(f"seeder exited: {seeder.stderr.read().decode()[-2000:]}")
        if time.monotonic() > t_wait:
            raise TimeoutError("seeder not ready after 120 s")
        time.sleep(0.05)
    total = json.load(open(ready))["total_size"]
    tx0 = [tb.tx_bytes(i) for i in range(n + 1)]
    t_launch = time.time() + 1.0 + 0.15 * n  # time for the peers' imports
    peers = []
    for i in range(1, n + 1):
        argv = [sys.executable, "-c", JOIN_AT, repr(t_launch), "join", "--parent", f"{tb.addr(0)}:{PORT}", "--host", tb.addr(i),
                "--advertise", tb.addr(i), "--report", f"{work}/{tag}.p{i}.json", "-q"]
        if disk:
            argv += ["--out", f"{work}/{tag}.out{i}"]
        peers.append(tb.popen(i, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    time.sleep(max(0.0, t_launch - time.time()))
    c0 = cpu_times()
    peer_cpu = []
    for i, p in enumerate(peers, 1):
        rc, cpu = _wait4(p, timeout)
        if rc != 0:
            raise RuntimeError(f"peer {i} exited {rc}: {p.stderr.read().decode()[-2000:]}")
        peer_cpu.append(cpu)
    c1 = cpu_times()
    rc, seed_cpu = _wait4(seeder, 60)
    tx1 = [tb.tx_bytes(i) for i in range(n + 1)]
    reports = [json.load(open(f"{work}/{tag}.p{i}.json")) for i in range(1, n + 1)]
    seed_doc = json.load(open(seed_report))
    if disk:
        subprocess.run(["rm", "-rf", *[f"{work}/{tag}.out{i}" for i in range(1, n + 1)]])
    start = min(r["started_at"] for r in reports)
    end = max(r["done_at"] for r in reports)
    busy = cpu_busy(c0, c1)
    return {
        "n": n, "topology": topo, "size": total, "time": end - start,
        "launch_spread": max(r["started_at"] for r in reports) - start,
        "from_launch": end - t_launch,
        "worst_peer": max(r["seconds"] for r in reports),
        "seed_tx": tx1[0] - tx0[0],
        "host_tx": [round((b - a) / total, 3) for a, b in zip(tx0, tx1)],
        "peer_cpu": peer_cpu, "seed_cpu": seed_cpu, "busy": sum(busy) / len(busy),
        "ranks": {r["rank"]: r["parents"] for r in reports},  # as given at join
        "settled": {int(r): m["parents"] for r, m in seed_doc["peers"].items()},  # after adoptions
        "peer_bytes": [r["bytes"] for r in reports],
        "per_rank": {r["rank"]: {"first": round(r.get("first_chunk_at", start) - start, 3),
                                 "done": round(r["done_at"] - start, 3)} for r in reports},
        "forwarded": sum(r["bytes_sent"] for r in reports) / total,
    }


def summarize(runs: list[dict], rate_mbit: float, chunk: int, window: int) -> dict:
    """Medians over repeats of one (N, topology), with the floor and the simulator's prediction."""
    r0 = runs[0]
    n, topo, total = r0["n"], r0["topology"], r0["size"]
    rate = rate_mbit * 1e6 / 8
    floor = total / rate
    t = statistics.median(r["time"] for r in runs)
    sim = simulate(n, total, rate, chunk, topo, window=window)
    cpu_per_gb = statistics.median(statistics.mean(r["peer_cpu"]) / (total / 1e9) for r in runs)
    return {
        "n": n, "topology": topo, "rate_mbit": rate_mbit, "repeats": len(runs), "time": t,
        "times": [round(r["time"], 2) for r in runs],
        "floor": floor, "ratio": t / floor,
        "seed_tx_ratio": statistics.median(r["seed_tx"] for r in runs) / total,
        "worst_peer": statistics.median(r["worst_peer"] for r in runs),
        "launch_spread": statistics.median(r["launch_spread"] for r in runs),
        "cpu_per_gb": cpu_per_gb, "busy": statistics.median(r["busy"] for r in runs),
        "sim": sim.time_last, "sim_ratio": sim.time_last / t, "sim_seed_tx": sim.seeder_tx_bytes / total,
    }


HEADER = ("| N | topology | Mbit/s | time s | t/floor | seed tx/S | worst peer s | CPU s/GB/peer | CPU busy "
          "| sim s | sim/meas |\n|---|---|---|---|---|---|---|---|---|---|---|")


def row(s: dict) -> str:
    return (f"| {s['n']} | {s['topology']} | {s['rate_mbit']:.0f} | {s['time']:.2f} | {s['ratio']:.2f} | "
            f"{s['seed_tx_ratio']:.2f} | {s['worst_peer']:.2f} | {s['cpu_per_gb']:.2f} | {s['busy']:.0%} | "
            f"{s['sim']:.2f} | {s['sim_ratio']:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, help="checkpoint size (256MiB)")
    ap.add_argument("--peers", help="comma-separated N values (1,2,4,8,16)")
    ap.add_argument("--topologies", default=DEFAULT_TOPOLOGIES, help=f"comma-separated ({DEFAULT_TOPOLOGIES})")
    ap.add_argument("--rate", type=float, default=400, help="uplink cap of every host, Mbit/s (400)")
    ap.add_argument("--full-rate-upto", type=int, default=8,
                    help="N up to which every run uses --rate (8); beyond, the rate may be lowered (see above)")
    ap.add_argument("--cpu-budget", type=float, default=0.75,
                    help="largest share of the cores the peers may need before the rate is lowered (0.75)")
    ap.add_argument("--chunk-size", type=parse_size, default=parse_size("1MiB"), help="chunk size (1MiB)")
    ap.add_argument("--window", type=int, default=8, help="credit window the simulator assumes (p2pw's default 8)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per (N, topology); the table shows medians")
    ap.add_argument("--star-repeat", type=int, default=1,
                    help="runs of the star baseline (N x floor by construction, and the slowest), default 1")
    ap.add_argument("--disk", action="store_true", help="peers write their copy to disk (--out)")
    ap.add_argument("--quick", action="store_true", help="defaults for a smoke run: 32 MiB, N = 1, 3")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    ap.add_argument("--md", default=str(ROOT / "bench" / "results" / "broadcast.md"),
                    help="write the markdown table here ('' for none)")
    ap.add_argument("--json", help="also write every run's raw measurements here")
    args = ap.parse_args(argv)
    args.size = args.size or (32 << 20 if args.quick else 256 << 20)
    args.peers = args.peers or ("1,3" if args.quick else "1,2,4,8,16")
    ok, why = Testbed.available()
    if not ok:
        print(f"broadcast: cannot build the testbed: {why}", file=sys.stderr)
        return 2
    ns = [int(x) for x in args.peers.split(",")]
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    ncpu = os.cpu_count() or 1
    summaries, raw = [], []
    cpu_per_byte = None  # peer CPU seconds per byte received, from the last N measured
    with tempfile.TemporaryDirectory(prefix="p2pw-bcast-") as work:
        model = f"{work}/model"
        write_synthetic_model(model, size_mb=args.size / (1 << 20), shards=2)
        print(f"# broadcast: {args.size / (1 << 20):.0f} MiB synthetic checkpoint, chunks of "
              f"{args.chunk_size >> 10} KiB, {'disk' if args.disk else 'memory'} sink, {ncpu} CPUs", flush=True)
        print(HEADER, flush=True)
        for n in ns:
            rate = args.rate
            if cpu_per_byte and n > args.full_rate_upto:
                # the peers together receive about n x rate bytes/s
                fit = args.cpu_budget * ncpu / (n * cpu_per_byte) * 8 / 1e6
                rate = max(50.0, min(args.rate, 50 * (fit // 50)))
            runs = {t: [] for t in topologies}
            with Testbed(n + 1, rate_mbit=rate) as tb:
                for rep in range(args.repeat):  # interleaved, so that the machine's noise hits all alike
                    for topo in topologies:
                        if topo == "star" and rep >= args.star_repeat:
                            continue
                        runs[topo].append(run_once(tb, model, n, topo, args.chunk_size, work, args.disk,
                                                   args.timeout))
            for topo in topologies:
                raw.extend(runs[topo])
                s = summarize(runs[topo], rate, args.chunk_size, args.window)
                summaries.append(s)
                print(row(s), flush=True)
            fwd = [s for s in summaries if s["n"] == n and s["topology"] != "star"] or \
                  [s for s in summaries if s["n"] == n]
            cpu_per_byte = max(s["cpu_per_gb"] for s in fwd) / 1e9
    if args.md:
        cmd = "sudo .venv/bin/python bench/broadcast.py " + " ".join(argv if argv is not None else sys.argv[1:])
        text = (f"# Broadcast on emulated hosts\n\n`{cmd.strip()}`\n\n"
                f"{args.size / (1 << 20):.0f} MiB checkpoint, {args.chunk_size >> 10} KiB chunks, "
                f"{'disk' if args.disk else 'in-memory'} sink, medians of {args.repeat} run(s), {ncpu} CPUs; "
                f"floor = S / B at the row's rate.\n\n{HEADER}\n" + "\n".join(row(s) for s in summaries) + "\n")
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"summaries": summaries, "runs": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
