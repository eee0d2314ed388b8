#!/usr/bin/env python3
"""A fleet with no seeder on the emulated bed: N hosts take a model from an S3 server, each client capped.

    sudo .venv/bin/python bench/fleet_bed.py [--hosts 8] [--size 256MiB] [--rate 400] [--runs 3] [--json OUT]

N + 1 emulated hosts (``bench/netbed/testbed.py``, uplinks capped at ``--rate`` Mbit/s): hosts 0..N-1 want
the model; host N is the object store and the fleet's service host: ``moto_server`` (the S3 API server the
tests use) and, in mode fleet, ``p2pw tracker``.  The S3 host's egress has one htb class per destination
whose ceil is ``--client-rate`` (default a quarter of an uplink: an object store's throughput per client,
below the NIC), under an uplink of ``--origin-rate`` (default N x the client rate: all clients at once).
Modes, alternated over ``--runs``, each timed from launching its processes to the last exit 0:

* fleet: ``p2pw tracker`` on the S3 host (up before the clock, as a Deployment is); every host runs
  ``p2pw get s3://... --tracker S3HOST --out DIR`` (host 0 also ``--manifest M``, publishing it);
* seeder: host 0 runs ``p2pw seed s3://... --manifest M`` (it reads the bucket alone) and hosts 1..N-1
  ``p2pw join --parent H0 --out DIR``, all launched at once; the hosts that join need no credentials;
* alone: every host downloads the objects itself with a plain client (``bench/s3_client.py``: boto3's
  transfer manager, as ``aws s3 cp --recursive``).

Every copy is compared byte for byte with the source.  Origin bytes read are the sum of the hosts'
``--report`` ``origin_bytes_read`` (the seeder's ``bytes_read``; the model's size per host alone),
cross-checked with the bytes the S3 host's link sent (HTTP and headers included).
The bound is max(S / (N x client rate), S / uplink).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "netbed"))

import fleet  # noqa: E402
from testbed import Testbed  # noqa: E402

from p2pweights.cli import size as parse_size  # noqa: E402
from p2pweights.sources.synth import write_synthetic_model  # noqa: E402

S3_PORT, TRACKER_PORT, SEED_PORT = 5000, 7430, 7420
URL = "s3://bench/model"
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
         "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
S3_CLIENT = [sys.executable, str(ROOT / "bench" / "s3_client.py")]
MODES = ("fleet", "seeder", "alone")


def start(tb: Testbed, host: int, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as f:
        return tb.popen(host, argv, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))


def wait_port(tb: Testbed, host: int, port: int, p: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    """Until ``host`` accepts TCP on ``port`` (asked from inside its namespace)."""
    probe = [sys.executable, "-c", f"import socket; socket.create_connection(({tb.addr(host)!r}, {port}), 1)"]
    deadline = time.monotonic() + timeout
    while tb.popen(host, probe, stderr=subprocess.DEVNULL).wait() != 0:
        if p.poll() is not None or time.monotonic() > deadline:
            raise fleet.RunFailed(f"port {port} of host {host} never opened: {fleet._tail(log)}")
        time.sleep(0.1)


def last_exit(procs: list[tuple[subprocess.Popen, Path]], t0: float, timeout: float = 600) -> float:
    """Seconds from ``t0`` to the last of ``procs`` exiting 0; RunFailed with its log if one does not."""
    left, last = dict(procs), t0
    while left:
        for p in list(left):
            got = fleet._reap(p)
            if got is not None:
                log = left.pop(p)
                if got[0] != 0:
                    raise fleet.RunFailed(f"{log.name} exited {got[0]}: {fleet._tail(log)}")
                last = time.monotonic()
        if time.monotonic() - t0 > timeout:
            raise fleet.RunFailed(f"still running after {timeout:.0f} s: {[log.name for log in left.values()]}")
        time.sleep(fleet.POLL)
    return last - t0


def launch(tb: Testbed, mode: str, n: int, run: Path, manifest: Path, env: dict):
    """Start the mode's processes: the timed ones as (popen, log), the seeder (or None), the copies by host.

    ``env`` holds the S3 endpoint and credentials: the hosts that read the bucket get it."""
    s3, log = tb.hosts - 1, (lambda h: run / f"h{h}.log")
    out = {h: run / f"h{h}" for h in range(n)}
    if mode == "alone":
        return [(start(tb, h, [*S3_CLIENT, "get", URL, str(out[h])], log(h), env), log(h)) for h in out], None, out
    if mode == "seeder":
        seeder = start(tb, 0, [*fleet.P2PW, "seed", URL, "--manifest", str(manifest), "--host", tb.addr(0), "--port",
                               str(SEED_PORT), "--exit-after", str(n - 1), "--report", str(run / "h0.json")],
                       log(0), env)
        del out[0]
        joins = [(start(tb, h, [*fleet.P2PW, "join", "--parent", f"{tb.addr(0)}:{SEED_PORT}", "--host", tb.addr(h),
                                "--out", str(out[h]), "-q"], log(h), {"P2PW_CACHE_DIR": env["P2PW_CACHE_DIR"]}),
                  log(h)) for h in out]
        return joins, seeder, out
    gets = [(start(tb, h, [*fleet.P2PW, "get", URL, "--tracker", f"{tb.addr(s3)}:{TRACKER_PORT}", "--host",
                           tb.addr(h), "--out", str(out[h]), "-q", "--report", str(run / f"h{h}.json"),
                           *(["--manifest", str(manifest)] if h == 0 else [])], log(h), env), log(h))
            for h in out]
    return gets, None, out


def origin_read(mode: str, n: int, size: int, run: Path) -> int:
    """Bytes the hosts read from the bucket: their reports' count (the seeder's ``bytes_read``)."""
    if mode == "alone":
        return n * size  # a plain client reads each object whole
    reports = [json.loads((run / f"h{h}.json").read_text()) for h in range(n if mode == "fleet" else 1)]
    return sum(r["origin_bytes_read"] if mode == "fleet" else r["bytes_read"] for r in reports)


def one_run(tb: Testbed, mode: str, n: int, model: str, size: int, work: Path, manifest: Path, s3_env: dict):
    """One timed run of ``mode``: seconds to the last exit 0, origin bytes read, the S3 host's tx bytes."""
    run = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work))
    s3, tracker, seeder, procs = tb.hosts - 1, None, None, []
    try:
        if mode == "fleet":
            tracker = start(tb, s3, [*fleet.P2PW, "tracker", "--host", tb.addr(s3), "--port", str(TRACKER_PORT)],
                            run / "tracker.log")
            wait_port(tb, s3, TRACKER_PORT, tracker, run / "tracker.log")
        tx0 = tb.counters()[s3][0]
        t0 = time.monotonic()
        procs, seeder, outs = launch(tb, mode, n, run, manifest, {**s3_env, "P2PW_CACHE_DIR": str(run / "cache")})
        took = last_exit(procs, t0)
        if seeder is not None:
            last_exit([(seeder, run / "h0.log")], time.monotonic(), 60)  # its report is written as it exits
        tx = tb.counters()[s3][0] - tx0
        for h, out in outs.items():
            fleet.compare_copy(model, str(out), h)
        return {"mode": mode, "seconds": took, "origin_read": origin_read(mode, n, size, run), "s3_tx": tx}
    finally:
        for p in [tracker, seeder, *(p for p, _ in procs)]:
            if p is not None:
                fleet._stop(p, 10)
        shutil.rmtree(run, ignore_errors=True)


def setup(tb: Testbed, model: str, work: Path) -> tuple[subprocess.Popen, dict]:
    """moto_server on the S3 host, the model uploaded and its manifest made there (not timed)."""
    s3 = tb.hosts - 1
    env = {**CREDS, "AWS_ENDPOINT_URL": f"http://{tb.addr(s3)}:{S3_PORT}"}
    moto = start(tb, s3, [str(Path(sys.executable).with_name("moto_server")), "-H", tb.addr(s3), "-p", str(S3_PORT)],
                 work / "moto.log", CREDS)
    wait_port(tb, s3, S3_PORT, moto, work / "moto.log")
    for argv in ([*S3_CLIENT, "put", model, URL], [*fleet.P2PW, "manifest", URL, "-o", str(work / "m.json")]):
        if start(tb, s3, argv, work / "setup.log", env).wait(300) != 0:
            raise fleet.RunFailed(f"{argv[1]}: {fleet._tail(work / 'setup.log')}")
    return moto, env


def table(runs: dict, size: int, bound: float) -> list[str]:
    med = {m: statistics.median(r["seconds"] for r in rs) for m, rs in runs.items() if rs}
    lines = ["| mode | time to the last exit s | t / bound | origin bytes read / S | S3 host tx / S |",
             "| --- | --- | --- | --- | --- |"]
    for mode, rs in runs.items():
        if not rs:
            continue
        t, o, x = ([r[k] for r in rs] for k in ("seconds", "origin_read", "s3_tx"))
        lines.append(f"| {mode} | {med[mode]:.2f} [{min(t):.2f}-{max(t):.2f}] | {med[mode] / bound:.2f} | "
                     f"{statistics.median(o) / size:.3f} | {statistics.median(x) / size:.3f} |")
    if "fleet" in med:
        lines.append("\n" + ", ".join(f"{m} / fleet = {med[m] / med['fleet']:.2f}" for m in med if m != "fleet"))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=8, help="hosts that want the model (8)")
    ap.add_argument("--size", type=parse_size, default=256 << 20)
    ap.add_argument("--rate", type=float, default=400, help="uplink cap of each host, Mbit/s (400)")
    ap.add_argument("--client-rate", type=float, help="the S3 host's cap per client, Mbit/s (a quarter of --rate)")
    ap.add_argument("--origin-rate", type=float, help="the S3 host's uplink, Mbit/s (hosts x --client-rate)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    n, modes = args.hosts, args.modes.split(",")
    client = args.client_rate or args.rate / 4
    ok, why = Testbed.available()
    if not ok or not set(modes) <= set(MODES):
        print(f"fleet_bed: {why or 'modes are ' + ','.join(MODES)}", file=sys.stderr)
        return 2
    fleet.compile_package()
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="p2pw-fleet-bed-") as tmp, \
            Testbed(n + 1, rate_mbit=args.rate, rates={n: args.origin_rate or n * client},
                    dest_ceils={n: client}) as tb:
        work = Path(tmp)
        model = str(work / "model")
        write_synthetic_model(model, size_mb=args.size / (1 << 20), shards=4)
        size = sum(fleet.source_files(model).values())
        moto, env = setup(tb, model, work)
        bound = max(size * 8 / (n * client * 1e6), size * 8 / (args.rate * 1e6))
        for k in range(args.runs):
            for mode in (modes if k % 2 == 0 else modes[::-1]):
                r = one_run(tb, mode, n, model, size, work, work / "m.json", env)
                runs[mode].append(r)
                print(f"  [{k + 1}/{args.runs}] {mode:<6} {r['seconds']:6.2f} s ({r['seconds'] / bound:.2f} x bound), "
                      f"origin read {r['origin_read'] / size:.3f} S, S3 tx {r['s3_tx'] / size:.3f} S",
                      file=sys.stderr, flush=True)
        fleet._stop(moto, 10)
    print(f"N = {n} hosts, {size / (1 << 20):.0f} MiB (S = {size} bytes), {args.rate:g} Mbit/s uplinks, S3 {client:g} "
          f"Mbit/s per client; bound max(S / (N x client), S / uplink) = {bound:.2f} s; medians [min-max] of "
          f"{args.runs}\n")
    print("\n".join(table(runs, size, bound)))
    if args.json:
        Path(args.json).write_text(json.dumps({"hosts": n, "bytes": size, "rate_mbit": args.rate, "client_mbit": client,
                                               "bound_s": bound, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
