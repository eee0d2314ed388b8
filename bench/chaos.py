#!/usr/bin/env python3
"""Chaos: a broadcast to N peers with random kills and restarts of non-seeder peers, against the same run without.

    python bench/chaos.py [--peers 8] [--size-mb 64] [--kills 4] [--seed 1]

Both runs happen in the same invocation on loopback.  A killed peer (SIGKILL)
is restarted with the same --out, so it resumes from what it verified.  Reports
whether every copy completed byte-identical, time against the calm run, and
the chunks the final (completing) run of each peer fetched / (peers x chunks): above 1
only if resumption re-fetched verified data.  A killed attempt writes no report, so what it
fetched before dying is not counted.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from p2pweights.sources.synth import write_synthetic_model  # noqa: E402

CHUNK = 256 << 10
SLOW = {"P2PW_FAULTS": "delay_recv=4ms"}  # keep the run long enough for kills to land mid-transfer


def p2pw(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "p2pweights", *map(str, args)], cwd=ROOT,
                            env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **kw)


def run(model: str, work: str, peers: int, kills: int, rng: random.Random) -> dict:
    os.makedirs(work, exist_ok=True)
    ready = os.path.join(work, "ready")
    seeder = p2pw("seed", model, "--port", 0, "--host", "127.0.0.1", "--chunk-size", CHUNK, "--ready", ready)
    procs = {}
    try:
        while not os.path.exists(ready):
            time.sleep(0.05)
        port = json.load(open(ready))["port"]

        def start(k, attempt):
            return p2pw("join", "--parent", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--out",
                        os.path.join(work, f"p{k}"), "--report", os.path.join(work, f"p{k}.{attempt}.json"),
                        "-q", "--parent-timeout", "2", env=SLOW)

        t0 = time.monotonic()
        attempts = {k: 0 for k in range(peers)}
        procs = {k: start(k, 0) for k in range(peers)}
        kill_at = sorted(rng.uniform(0.3, 2.5) for _ in range(kills))
        killed = 0
        while any(p.poll() is None for p in procs.values()):
            now = time.monotonic() - t0
            if kill_at and now >= kill_at[0]:
                kill_at.pop(0)
                alive = [k for k, p in procs.items() if p.poll() is None]
                if alive:
                    k = rng.choice(alive)
                    procs[k].kill()
                    procs[k].wait()
                    attempts[k] += 1
                    procs[k] = start(k, attempts[k])
                    killed += 1
            if now > 600:
                raise RuntimeError("chaos run did not finish in 600 s")
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        ok = all(p.returncode == 0 for p in procs.values())
        received = 0
        for k in range(peers):
            for a in range(attempts[k] + 1):
                path = os.path.join(work, f"p{k}.{a}.json")
                if os.path.exists(path):
                    received += json.load(open(path))["received"]
            cmp = filecmp.dircmp(model, os.path.join(work, f"p{k}"))
            ok &= not (cmp.left_only or cmp.right_only or cmp.diff_files)
        return {"seconds": seconds, "ok": ok, "killed": killed, "received_chunks": received}
    finally:
        for p in list(procs.values()) + [seeder]:
            if p.poll() is None:
                p.terminate()
                p.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--size-mb", type=float, default=64)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="p2pw-chaos-") as tmp:
        model = os.path.join(tmp, "model")
        info = write_synthetic_model(model, size_mb=args.size_mb, shards=2)
        n_chunks = -(-info["total_bytes"] // CHUNK)
        calm = run(model, os.path.join(tmp, "calm"), args.peers, 0, random.Random(args.seed))
        chaos = run(model, os.path.join(tmp, "chaos"), args.peers, args.kills, random.Random(args.seed))
        print(f"chaos: {args.peers} peers, {info['total_bytes'] / 2**20:.0f} MiB, {n_chunks} chunks of "
              f"{CHUNK >> 10} KiB; kills are SIGKILL + restart with the same --out")
        print(f"{'run':<7}{'kills':>6}{'complete':>10}{'seconds':>9}{'x calm':>8}{'final runs fetched / (N x S)':>30}")
        for name, r in (("calm", calm), ("chaos", chaos)):
            moved = r["received_chunks"] / (args.peers * n_chunks)
            print(f"{name:<7}{r['killed']:>6}{'yes' if r['ok'] else 'NO':>10}{r['seconds']:>9.2f}"
                  f"{r['seconds'] / calm['seconds']:>8.2f}{moved:>30.3f}")
        return 0 if calm["ok"] and chaos["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
