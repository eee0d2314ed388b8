#!/usr/bin/env python3
"""Three local processes on one host ask for the same model at once: through the node's agent, or each alone.

    sudo .venv/bin/python bench/agent_local.py [--size 256MiB] [--rate 400] [--procs 3] [--repeat 3]

Two emulated hosts (``bench/netbed/testbed.py``, uplinks capped at ``--rate`` Mbit/s): host 0 runs
``p2pw tracker`` and ``p2pw seed MODEL --tracker``; host 1 runs, per mode and repeat:

* agent: ``p2pw agent --tracker H0 --cache C`` (started and empty before the clock, as a DaemonSet's pod is),
  then ``--procs`` ``p2pw get MODEL_ID --agent C --out DIR_k`` launched at once;
* alone: ``--procs`` ``p2pw get MODEL_ID --tracker H0 --out DIR_k`` launched at once, no agent.

Timed from the launch to the last exit 0; every copy compared byte for byte with the source.  Reports the
bytes host 1's link received during the run over the model's size (frame bytes: one copy reads about 1.05).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "netbed"))

import fleet  # noqa: E402
from testbed import Testbed  # noqa: E402

from p2pweights.cli import size as parse_size  # noqa: E402
from p2pweights.sources.synth import write_synthetic_model  # noqa: E402

PORT = 7430


def wait_ready(p: subprocess.Popen, ready: Path, log: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while not ready.exists() or not ready.stat().st_size:
        if p.poll() is not None or time.monotonic() > deadline:
            raise fleet.RunFailed(f"not ready: {log.read_text(errors='replace')[-1500:]}")
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(ready.read_text())


def start(tb: Testbed, host: int, argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return tb.popen(host, argv, stdout=f, stderr=subprocess.STDOUT)


def one_run(tb: Testbed, mode: str, model: str, model_id: str, k: int, work: Path) -> dict:
    tag = f"{mode}-{time.monotonic_ns()}"
    outs = [work / f"{tag}.out{i}" for i in range(k)]
    agent = None
    cache = work / f"{tag}.cache"
    tracker = f"{tb.addr(0)}:{PORT}"
    if mode == "agent":
        ready, log = work / f"{tag}.agent.ready", work / f"{tag}.agent.log"
        agent = start(tb, 1, [*fleet.P2PW, "agent", "--tracker", tracker, "--cache", str(cache), "--host",
                              tb.addr(1), "--no-origin", "--ready", str(ready)], log)
        wait_ready(agent, ready, log)
    via = ["--agent", str(cache)] if mode == "agent" else ["--tracker", tracker, "--host", tb.addr(1)]
    rx0 = tb.rx_bytes(1)
    t0 = time.monotonic()
    gets = [start(tb, 1, [*fleet.P2PW, "get", model_id, *via, "--out", str(out), "-q"], Path(f"{out}.log"))
            for out in outs]
    try:
        exits = []
        for g, out in zip(gets, outs):
            rc = g.wait(300)
            exits.append(time.monotonic() - t0)
            if rc != 0:
                raise fleet.RunFailed(f"{mode}: get exited {rc}: {Path(f'{out}.log').read_text()[-1500:]}")
        rx = tb.rx_bytes(1) - rx0
        for i, out in enumerate(outs):
            fleet.compare_copy(model, str(out), 1)
    finally:
        for g in gets:
            if g.poll() is None:
                g.kill()
                g.wait()
        if agent is not None:
            fleet._stop(agent, 10)
        shutil.rmtree(cache, ignore_errors=True)
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "time": max(exits), "rx": rx}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=256 << 20)
    ap.add_argument("--rate", type=float, default=400, help="uplink cap of each host, Mbit/s (400)")
    ap.add_argument("--procs", type=int, default=3, help="local processes asking at once (3)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    ok, why = Testbed.available()
    if not ok:
        print(f"agent_local: cannot build the testbed: {why}", file=sys.stderr)
        return 2
    fleet.compile_package()
    runs: dict[str, list[dict]] = {"agent": [], "alone": []}
    with tempfile.TemporaryDirectory(prefix="p2pw-agent-") as tmp, Testbed(2, rate_mbit=args.rate) as tb:
        work = Path(tmp)
        model = str(work / "model")
        write_synthetic_model(model, size_mb=args.size / (1 << 20), shards=2)
        size = sum(fleet.source_files(model).values())
        tr = start(tb, 0, [*fleet.P2PW, "tracker", "--host", tb.addr(0), "--port", str(PORT), "--ready",
                           str(work / "tracker.ready")], work / "tracker.log")
        wait_ready(tr, work / "tracker.ready", work / "tracker.log")
        sd = start(tb, 0, [*fleet.P2PW, "seed", model, "--tracker", f"{tb.addr(0)}:{PORT}", "--host", tb.addr(0),
                           "--ready", str(work / "seed.ready")], work / "seed.log")
        model_id = wait_ready(sd, work / "seed.ready", work / "seed.log")["model_id"]
        for rep in range(args.repeat):
            for mode in (("agent", "alone") if rep % 2 == 0 else ("alone", "agent")):
                r = one_run(tb, mode, model, model_id, args.procs, work)
                runs[mode].append(r)
                print(f"  [{rep + 1}/{args.repeat}] {mode:<5} {r['time']:6.2f} s, host rx {r['rx'] / size:.2f} S",
                      file=sys.stderr, flush=True)
        fleet._stop(sd, 10)
        fleet._stop(tr, 10)
    floor = size / (args.rate * 1e6 / 8)
    print(f"{args.procs} local processes, {size / (1 << 20):.0f} MiB (S = {size} bytes), {args.rate:g} Mbit/s uplinks, "
          f"floor S / B = {floor:.2f} s; medians [min-max] of {args.repeat}\n")
    print("| mode | time to the last exit s | t/floor | bytes into the host / S |\n|---|---|---|---|")
    for mode, rs in runs.items():
        t, rx = [r["time"] for r in rs], [r["rx"] / size for r in rs]
        print(f"| {mode} | {statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}] | {statistics.median(t) / floor:.2f} | "
              f"{statistics.median(rx):.2f} [{min(rx):.2f}-{max(rx):.2f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
