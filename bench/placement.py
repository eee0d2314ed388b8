#!/usr/bin/env python3
"""The seeder's CPU per join: N peers join one tracker, as the seeder's endpoint places them.

    python bench/placement.py [--peers 1000,10000] [--slow 0,0.1] [--against REV]

Each join does what ``endpoint.TrackerEndpoint`` does for a HELLO: place the
peer in the forest (``Tracker.join``), move the peers it adopts, build its
WELCOME's parent and partner lists (each with ``downstream``), and tell
the peers whose plan changed (``take_moved`` and their lists).  ``--slow F``
gives each joiner with probability F a probe at a fifth of the others' rate
(a slow host, demoted at its probe unless it already feeds a peer), which
leaves peers without a planned slot for the forest to lend or share.
Prints the CPU seconds of the N joins and per 1,000.

``--against REV`` runs the same joins, in the same invocation, with the
package as it was at git revision REV (``git archive``) and prints the
ratio: the baseline is the code this replaced.  The tracker runs on the
seeder's one event loop, so these seconds are seconds the seeder's uplink
waits.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def joins(n: int, slow: float, seed: int = 1) -> float:
    """CPU seconds for ``n`` joins with ``slow`` of them demoted as they join (this process's package)."""
    import random
    import time

    from p2pweights.swarm.tracker.topology import make
    from p2pweights.swarm.tracker.tracker import Tracker

    rng = random.Random(seed)
    t = Tracker(make("forest:2"), "tcp://seeder:7420")
    start = time.process_time()
    for i in range(n):
        m = t.join(f"peer-{i}", f"tcp://10.0.{i >> 8}.{i & 255}:7420")
        t.adoptions(m)
        t.parent_addrs(m), t.partner_addrs(m)
        t.probed(m.rank, 10e6 if rng.random() < slow else 50e6)  # a slow one's probe: demoted
        for r in t.take_moved():
            t.parent_addrs(t.members[r]), t.partner_addrs(t.members[r])
    return time.process_time() - start


def run_at(rev: str, n: int, slow: float) -> float:
    """``joins`` in a child process importing the package as it was at ``rev``."""
    with tempfile.TemporaryDirectory(prefix="p2pw-placement-") as tmp:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "p2pweights"], check=True,
                             capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            tf.extractall(tmp, filter="data")
        out = subprocess.run([sys.executable, __file__, "--child", f"{n}:{slow}"], check=True, capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": tmp}, cwd=tmp).stdout
        return json.loads(out)["cpu"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="1000,10000", help="fleet sizes, comma-separated")
    ap.add_argument("--slow", default="0,0.1", help="shares of joiners demoted, comma-separated")
    ap.add_argument("--against", metavar="REV", help="also time the package at this git revision")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        n, slow = args.child.split(":")
        print(json.dumps({"cpu": joins(int(n), float(slow))}))
        return 0
    sys.path.insert(0, str(ROOT))
    print("| peers | slow | CPU s | per 1,000 joins |" + (f" {args.against} CPU s | ratio |" if args.against else ""))
    print("| --- | --- | --- | --- |" + (" --- | --- |" if args.against else ""))
    for n in (int(x) for x in args.peers.split(",")):
        for slow in (float(x) for x in args.slow.split(",")):
            cpu = joins(n, slow)
            row = f"| {n:,} | {slow:.0%} | {cpu:.2f} | {cpu / n * 1000:.3f} |"
            if args.against:
                old = run_at(args.against, n, slow)
                row += f" {old:.2f} | {old / cpu:.1f} x |"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
