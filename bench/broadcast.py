#!/usr/bin/env python3
"""Broadcast on emulated hosts, timed as a user waits, against libtorrent on the same bed.

    sudo .venv/bin/python bench/broadcast.py [--peers 8] [--rate 400] [--size 256MiB]
        [--cases equal,slow1,slow2,kill] [--plans default] [--tools p2pw,libtorrent]
        [--repeat 2] [--warm] [--quick] [--json FILE] [--md FILE]

One testbed of N+1 hosts per N (``bench/netbed/testbed.py``: network namespaces
on a bridge, every uplink capped with htb at ``--rate`` Mbit/s and shared
fairly between destinations, as a Linux host's default fq_codel shares it;
downloads uncapped; ``--fifo``: one FIFO under the cap instead).  Host 0 seeds a synthetic checkpoint; hosts 1..N receive it.  For
every case, every p2pw plan and libtorrent run in the same invocation, runs
interleaved (the order of the tools alternates between repeats), and the tables
show medians of ``--repeat`` runs.  ``bench/fleet.py`` does one run:

* time = from launching the N receiver processes (``p2pw join --parent H0
  --out DIR``, the venv's console script, default flags; imports included) to the LAST one
  exiting 0; t/floor divides by floor = S / B (S the checkpoint's file bytes,
  B the configured uplink rate; TCP through htb gets 0.956 of B, so 1.05 is the
  best a run can show).  Every copy is compared byte for byte with the source;
  a difference aborts the benchmark (exit 1).
* libtorrent (``bench/bt_peer.py``): a v1 torrent of the same directory
  (``--piece-size``, 256 KiB), a seeder in host 0, one leecher per host given
  every other host's address (no tracker, DHT, LSD), each staying until every
  leecher is complete; timed the same way.
* cases: ``equal`` uplinks; ``slow1`` / ``slow2``: the first one / two of
  ``--slow-hosts`` (1,2) at rate / ``--slow-factor`` (4), the floor staying
  S / B of the fast rate; ``kill``: SIGKILL of one receiver at a third of the
  transfer (the live receiver that has uploaded most, once it has received
  S/3), timed to the survivors' last exit; ``late``: equal uplinks, the
  receivers launched one by one over ``--late-span`` floors (host h at
  (h - 1) / (N - 1) of it), as an autoscaler starts pods, and timed against
  the fluid bound for those arrivals (``late_bound``) as well as the floor.
* seed tx/S: frame bytes host 0's link carried during the run over S (headers
  make one copy read about 1.046); CPU s/GB/peer: user+sys seconds of each
  receiver process (``os.wait4``) per GB of S, mean over receivers, and in
  brackets the part a p2pw join's loop spent writing verified chunks into its
  copy (``write_cpu_seconds`` of its --report: on this VM, whose host backs new
  guest pages lazily, filling new page cache is most of it, and it swings
  between runs); CPU busy: the machine's cores during the run (it is shared:
  read ratios, not seconds).
* sim: ``p2pw simulate`` for the same N, S, B, chunk and plan (slow hosts as
  the uplinks of those ranks, the kill as rank 1 at a third, ``--startup`` the
  runs' median join() time since the launch; n/a where the simulator cannot
  say).
* ``--warm`` (a diagnostic of the bed, never the headline): each p2pw plan is
  also run with its joins launched first (``bench/warm_join.py``: interpreter
  started, a join's modules imported, blocked on stdin) and timed from the
  byte that lets them all go, so the rows ", warm" leave out N interpreters
  starting at once on this machine's cores, which hosts with cores of their
  own would not wait for.

Needs root (network namespaces).  Results go to stdout and ``--md``
(``bench/results/broadcast.md``); ``--json`` dumps every run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "netbed"))

import fleet  # noqa: E402
from testbed import Testbed, cpu_plan  # noqa: E402

from p2pweights.cli import size as parse_size  # noqa: E402
from p2pweights.sources.synth import write_synthetic_model  # noqa: E402

CASES = ("equal", "slow1", "slow2", "kill", "late")
BT = "libtorrent"
WARM = "@warm"  # a variant's suffix: its joins started before the clock (--warm)


def split_variant(variant: str) -> tuple[str, bool]:
    """A p2pw variant's plan ('default' or a --topology value) and whether its joins run warm."""
    return variant.removesuffix(WARM), variant.endswith(WARM)


def case_rates(case: str, rate: float, slow_hosts: list[int], factor: float) -> dict[int, float]:
    """Per-host uplink caps of a case (hosts not named run at ``rate``)."""
    k = {"slow1": 1, "slow2": 2}.get(case, 0)
    return {h: rate / factor for h in slow_hosts[:k]}


def default_plan() -> str | None:
    """The plan ``p2pw seed`` uses without --topology, where the package says (else None)."""
    try:
        from p2pweights.api import DEFAULT_PLAN
        return str(DEFAULT_PLAN)
    except Exception:
        return None


def sim_ratio(n: int, size: int, rate_mbit: float, chunk: int | None, plan: str,
              slow: dict[int, float] | None = None, kill: bool = False, startup: float | None = None) -> float | None:
    """p2pw simulate's time over the floor, or None where it cannot say (its API may change).

    Slow hosts go in as the uplinks of the same ranks (host h as rank h); the kill as rank 1
    failing once a third of the model has gone out; ``startup``: the runs' median join() time
    since the launch (interpreters importing on the bed's cores), which the floor does not hold.
    """
    try:
        from p2pweights.sources.manifest import default_chunk_size
        from p2pweights.swarm.simulate import simulate

        uplink = rate_mbit * 1e6 / 8
        plan = default_plan() if plan == "default" else plan
        if plan is None:
            return None
        kw = {}
        if slow:
            kw["uplinks"] = [slow.get(h, rate_mbit) * 1e6 / 8 for h in range(1, n + 1)]
        if kill:
            kw["failures"] = [(1, 1 / 3)]
        if startup:
            kw["startup"] = startup
        res = simulate(n, size, uplink, chunk or default_chunk_size(size), topology=plan, **kw)
        return res.time_last / (size / uplink)
    except Exception:
        return None


def late_arrivals(n: int, span: float) -> dict[int, float]:
    """Host h (1..n) launched at (h - 1) / (n - 1) of ``span`` seconds."""
    return {h: span * (h - 1) / max(n - 1, 1) for h in range(1, n + 1)}


def late_bound(size: int, rate_mbit: float, arrivals: dict[int, float]) -> float:
    """The fluid lower bound on the last copy's time when host h arrives at ``arrivals[h]`` s, every uplink
    (the seeder's too) B and downlinks free: the seeder sends every byte once (S / B); the last to arrive takes
    S from at most N uplinks (a_max + S / (N B)); and the N S bytes received all leave an uplink, the seeder's
    from 0 and host h's from a_h on ((N S / B + sum a_h) / (N + 1))."""
    b, n = rate_mbit * 1e6 / 8, len(arrivals)
    a = list(arrivals.values())
    return max(size / b, max(a) + size / (n * b), (n * size / b + sum(a)) / (n + 1))


def one_run(tb, variant: str, model: str, torrent: str | None, n: int, work: str, case: str, args) -> dict:
    kill = case == "kill"
    floor = sum(fleet.source_files(model).values()) / (args.rate * 1e6 / 8)
    arrivals = late_arrivals(n, args.late_span * floor) if case == "late" else None
    if variant == BT:
        return fleet.run_libtorrent(tb, model, torrent, n, work, kill=kill, utp=args.bt_utp, timeout=args.timeout,
                                    arrivals=arrivals)
    plan, warm = split_variant(variant)
    return fleet.run_p2pw(tb, model, n, work, plan=None if plan == "default" else plan, chunk=args.chunk_size,
                          kill=kill, timeout=args.timeout, trace=args.trace, warm=warm and not arrivals,
                          arrivals=arrivals)


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def writing_per_gb(r: dict) -> float | None:
    """CPU s/GB a run's joins spent writing their copies (mean of their ``write_cpu_seconds``); None: libtorrent."""
    writes = [d["write_cpu_seconds"] for d in r["reports"].values() if "write_cpu_seconds" in d]
    return statistics.mean(writes) / (r["size"] / 1e9) if writes else None


def summarize(runs: list[dict], case: str, variant: str, n: int, rate: float, slow: dict, args) -> dict:
    """Medians over the successful runs of one (N, case, variant)."""
    ok = [r for r in runs if "error" not in r]
    out = {"case": case, "variant": variant, "n": n, "rate_mbit": rate, "runs": len(runs),
           "failed": len(runs) - len(ok),
           "errors": [r["error"] for r in runs if "error" in r]}
    if not ok:
        return out
    size = ok[0]["size"]
    floor = size / (rate * 1e6 / 8)
    gb = size / 1e9

    def worst(r, hosts):
        t = [s for h, s in r["exits"].items() if h in hosts]
        return max(t) / floor if t else None

    def rep(r, key, f):
        xs = [d[key] for d in r["reports"].values() if key in d]
        return f(xs) if xs else None

    started = _med(rep(r, "started_at", statistics.median) for r in ok)  # the joins' start, for the simulator
    out.update({
        "size": size, "floor": floor,
        "ratio": _med(r["time"] / floor for r in ok), "ratios": [round(r["time"] / floor, 3) for r in ok],
        "seed_tx_ratio": _med(r["seed_tx"] / size for r in ok),
        "cpu_per_gb": _med(statistics.mean(r["cpu"].values()) / gb for r in ok),
        "write_cpu_per_gb": _med(writing_per_gb(r) for r in ok),
        "busy": _med(r["busy"] for r in ok),
        "slow_worst": _med(worst(r, set(slow)) for r in ok) if slow else None,
        "fast_worst": _med(worst(r, set(range(1, n + 1)) - set(slow)) for r in ok),
        "started_max": _med(rep(r, "started_at", max) for r in ok),
        "first_med": _med(rep(r, "first_chunk_at", statistics.median) for r in ok),
        "done_max": _med(rep(r, "done_at", max) for r in ok),
        "exit_max": _med(r["time"] for r in ok),
        "killed": [r["killed"] for r in ok if r.get("killed")],
        "late_ratio": _med(r["time"] / late_bound(size, rate, r["arrivals"]) for r in ok) if case == "late" else None,
        "late_ratios": [round(r["time"] / late_bound(size, rate, r["arrivals"]), 3) for r in ok] if case == "late"
        else None,
        "last_arrival": _med(_last_arrival(r) / floor for r in ok),
        "demoted": [r.get("demoted") or [] for r in ok] if variant != BT else None,
        "started_med": started,
        # The simulator models no arrivals: no prediction for case late.
        "sim": None if variant == BT or case == "late" else sim_ratio(
            n, size, rate, args.chunk_size, split_variant(variant)[0], slow, case == "kill", started),
    })
    return out


def _last_arrival(r: dict) -> float:
    """Seconds from the last receiver's launch to its exit."""
    last = max(r["arrivals"], key=lambda h: (r["arrivals"][h], h))
    return r["exits"][last] - r["arrivals"][last]


def _f(x, fmt="{:.2f}", none="n/a"):
    return none if x is None else fmt.format(x)


def _cell(s: dict | None, key: str, fmt="{:.2f}") -> str:
    if s is None:
        return "n/a"
    if s.get(key) is None and s.get("failed"):
        return "FAIL"
    return _f(s.get(key), fmt)


MAIN_HEAD = ("| case | N | Mbit/s | plan | p2pw t/floor | libtorrent t/floor | p2pw/libtorrent | p2pw seed tx/S "
             "| bt seed tx/S | p2pw CPU s/GB/peer (writing the copy) | bt CPU s/GB/peer | sim t/floor | CPU busy |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
DETAIL_HEAD = ("| case | N | tool | plan | runs t/floor | slow hosts worst | other hosts worst | joined by s "
               "| first chunk s | last chunk s | last exit s | killed (host @ s, rx/S) | made leaves (host @ s) |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _plan(variant: str) -> str:
    plan, warm = split_variant(variant)
    d = default_plan() if plan == "default" else None
    return (f"default ({d})" if d else plan) + (", warm" if warm else "")


def _cpu(s: dict) -> str:
    """p2pw's CPU s/GB/peer, and in brackets the part spent writing the copy into the page cache."""
    w = s.get("write_cpu_per_gb")
    return _cell(s, "cpu_per_gb", "{:.1f}") + (f" ({w:.1f})" if w is not None and s.get("cpu_per_gb") else "")


def main_rows(summaries: list[dict]) -> list[str]:
    rows = []
    by = {(s["n"], s["case"], s["variant"]): s for s in summaries}
    for s in summaries:
        if s["variant"] == BT:
            continue
        bt = by.get((s["n"], s["case"], BT))
        vs = (s["ratio"] / bt["ratio"]) if s.get("ratio") and bt and bt.get("ratio") else None
        busy = [x.get("busy") for x in (s, bt) if x and x.get("busy") is not None]
        rows.append(f"| {s['case']} | {s['n']} | {s['rate_mbit']:.0f} | {_plan(s['variant'])} | {_cell(s, 'ratio')} | "
                    f"{_cell(bt, 'ratio')} | {_f(vs)} | {_cell(s, 'seed_tx_ratio')} | {_cell(bt, 'seed_tx_ratio')} | "
                    f"{_cpu(s)} | {_cell(bt, 'cpu_per_gb', '{:.1f}')} | {_f(s.get('sim'))} | "
                    f"{_f(max(busy) if busy else None, '{:.0%}')} |")
    if not rows:  # libtorrent alone
        for s in summaries:
            busy = s.get("busy")
            rows.append(f"| {s['case']} | {s['n']} | {s['rate_mbit']:.0f} | n/a | n/a | {_cell(s, 'ratio')} | n/a | "
                        "n/a | "
                        f"{_cell(s, 'seed_tx_ratio')} | n/a | {_cell(s, 'cpu_per_gb', '{:.1f}')} | n/a | "
                        f"{_f(busy, '{:.0%}')} |")
    return rows


def detail_rows(summaries: list[dict]) -> list[str]:
    rows = []
    for s in summaries:
        tool, plan = (BT, "bt") if s["variant"] == BT else ("p2pw", _plan(s["variant"]))
        if s.get("ratio") is None:
            rows.append(f"| {s['case']} | {s['n']} | {tool} | {plan} | FAIL: {'; '.join(s['errors'])[:200]} "
                        "| | | | | | | | |")
            continue
        killed = ", ".join(f"h{k['host']} @ {k['at_s']:.1f}, {k['rx'] / s['size']:.2f}" for k in s["killed"]) or ""
        fails = f" ({s['failed']} failed)" if s["failed"] else ""
        runs = ", ".join(f"{x:.2f}" for x in s["ratios"])
        rows.append(f"| {s['case']} | {s['n']} | {tool} | {plan} | {runs}{fails} | "
                    f"{_f(s['slow_worst'])} | {_f(s['fast_worst'])} | {_f(s['started_max'])} | {_f(s['first_med'])} | "
                    f"{_f(s['done_max'])} | {_f(s['exit_max'])} | {killed} | {_leaves(s.get('demoted'))} |")
    return rows


LATE_HEAD = ("| N | tool | plan | t/floor | t/bound (runs) | all at once t/floor | the last to arrive: launch to exit / floor |\n"
             "|---|---|---|---|---|---|---|")


def late_rows(summaries: list[dict]) -> list[str]:
    """Case late beside case equal of the same N and variant: the last exit over the floor and over the fluid bound
    for the arrivals (``late_bound``), and the longest any host took from its own launch."""
    by = {(s["n"], s["case"], s["variant"]): s for s in summaries}
    rows = []
    for s in summaries:
        if s["case"] != "late" or s.get("ratio") is None:
            continue
        tool, plan = (BT, "bt") if s["variant"] == BT else ("p2pw", _plan(s["variant"]))
        runs = ", ".join(f"{x:.2f}" for x in s["late_ratios"])
        rows.append(f"| {s['n']} | {tool} | {plan} | {_cell(s, 'ratio')} | {_cell(s, 'late_ratio')} ({runs}) | "
                    f"{_cell(by.get((s['n'], 'equal', s['variant'])), 'ratio')} | {_cell(s, 'last_arrival')} |")
    return rows


def _leaves(runs: list | None) -> str:
    """Each run's demotions, runs apart by ';' ("none" for a run without; blank for libtorrent)."""
    if runs is None:
        return ""
    return "; ".join(", ".join(f"h{h if h is not None else '?'} @ {t:.1f}" for h, t in run) or "none" for run in runs)


def _versions() -> str:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "?"
    try:
        from importlib.metadata import version
        lt = version("libtorrent")
    except Exception:
        lt = "not installed"
    return f"p2pweights at {commit or '?'}, libtorrent {lt}"


def _sigterm(*_):
    raise SystemExit(143)  # unwind: the testbed and the temporary directory clean up


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, help="checkpoint size (256MiB; --quick 32MiB)")
    ap.add_argument("--peers", help="N, or comma-separated N values (8; --quick 3)")
    ap.add_argument("--rate", type=float, default=400, help="uplink cap of every host, Mbit/s (400)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (all)")
    ap.add_argument("--plans", default="default",
                    help="p2pw plans, comma-separated: 'default' (no --topology flag) or a --topology value "
                         "(binomial, chain, striped:2, ...); default: just the default plan")
    ap.add_argument("--tools", default=f"p2pw,{BT}", help=f"p2pw and/or {BT} (both)")
    ap.add_argument("--slow-hosts", default="1,2", help="hosts slow1 / slow2 throttle, in that order (1,2)")
    ap.add_argument("--slow-factor", type=float, default=4, help="a slow host's uplink is rate / this (4)")
    ap.add_argument("--late-span", type=float, default=1.0,
                    help="case late: the receivers arrive one by one over this many floors (1)")
    ap.add_argument("--repeat", type=int, help="runs per (case, tool, plan); the tables show medians (2; --quick 1)")
    ap.add_argument("--chunk-size", type=parse_size, help="p2pw seed --chunk-size (default: the seeder's own)")
    ap.add_argument("--piece-size", type=parse_size, default=256 << 10, help="libtorrent piece size (256KiB)")
    ap.add_argument("--bt-utp", action="store_true", help="let libtorrent use uTP as well as TCP (default TCP only)")
    ap.add_argument("--fifo", action="store_true",
                    help="one FIFO under each host's cap (the bed before 11dfc39), not per-destination fair queuing")
    ap.add_argument("--trace", action="store_true",
                    help="p2pw joins record each verified chunk (join --trace) into --json: bench/trace.py reads it")
    ap.add_argument("--warm", action="store_true",
                    help="also run each p2pw plan with the joins started and imported before the clock "
                         "(bench/warm_join.py): how much of a run is N interpreters starting on this machine's "
                         "cores; a diagnostic of the bed, never the headline")
    ap.add_argument("--cpus-per-host", default="auto", metavar="K",
                    help="pin each emulated host's processes to K cores of its own, as real hosts have (auto: as "
                         "many as fit with one left for the bench, none where fewer cores than hosts + 1: then "
                         "every host shares the machine's, as on this 2-core VM; 0: never pin)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 32 MiB, N = 3, one repeat")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one run may take (300)")
    ap.add_argument("--md", default=str(ROOT / "bench" / "results" / "broadcast.md"),
                    help="write the markdown tables here ('' for none)")
    ap.add_argument("--json", help="also write every run's raw measurements here")
    args = ap.parse_args(argv)
    args.size = args.size or (32 << 20 if args.quick else 256 << 20)
    args.peers = [int(x) for x in str(args.peers or (3 if args.quick else 8)).split(",")]
    args.repeat = args.repeat or (1 if args.quick else 2)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {', '.join(bad)}; known: {', '.join(CASES)}")
    tools = {t.strip() for t in args.tools.split(",") if t.strip()}
    if not tools or tools - {"p2pw", BT}:
        ap.error(f"--tools takes p2pw and/or {BT}")
    plans = [p.strip() for p in args.plans.split(",") if p.strip()] if "p2pw" in tools else []
    args.variants = plans + [p + WARM for p in plans if args.warm] + ([BT] if BT in tools else [])
    args.slow_hosts = [int(x) for x in args.slow_hosts.split(",")]
    if args.cpus_per_host != "auto":
        if not args.cpus_per_host.isdigit():
            ap.error(f"--cpus-per-host takes a whole number or auto, not {args.cpus_per_host!r}")
        per_host = int(args.cpus_per_host)
        too_few = [n for n in args.peers if per_host and not cpu_plan(n + 1, per_host)]
        if too_few:
            ap.error(f"--cpus-per-host {per_host}: {len(os.sched_getaffinity(0))} cores do not give "
                     f"{too_few[0] + 1} hosts {per_host} each and the bench one")
    return args


def host_cpus(n: int, args) -> dict[int, list[int]]:
    """``Testbed(cpus=...)`` for N receivers and the seeder (``--cpus-per-host``; 0 pins none)."""
    return cpu_plan(n + 1, None if args.cpus_per_host == "auto" else int(args.cpus_per_host))


def run_n(n: int, args, model: str, torrent: str | None, work: str, size: int) -> tuple[dict, int]:
    """Every (case, variant) run for one N on one testbed, interleaved; ({(case, variant): runs}, failures).

    Raises CopyMismatch at once: a wrong copy makes every number meaningless.
    """
    floor = size / (args.rate * 1e6 / 8)
    runs = {(c, v): [] for c in args.cases for v in args.variants}
    failed = 0
    with Testbed(n + 1, rate_mbit=args.rate, fair=not args.fifo, cpus=host_cpus(n, args)) as tb:
        for rep in range(args.repeat):
            for case in args.cases:
                tb.set_rates(case_rates(case, args.rate, args.slow_hosts, args.slow_factor))
                for v in (args.variants if rep % 2 == 0 else args.variants[::-1]):
                    os.sync()  # untimed: the last run's unsynced copies (libtorrent's 2-4 GB; p2pw's joins
                    #            fsync theirs) or the model just written are not flushed during this one
                    try:
                        r = one_run(tb, v, model, torrent, n, work, case, args)
                    except fleet.CopyMismatch as exc:
                        raise fleet.CopyMismatch(f"{case}, {v}, N = {n}: {exc}") from exc
                    except fleet.RunFailed as exc:
                        failed += 1
                        r = {"error": str(exc)[:1500]}
                        print(f"broadcast: FAILED {case} {v} N={n} rep {rep + 1}: {exc}", file=sys.stderr)
                    r.update(case=case, variant=v, rep=rep, n=n)
                    runs[(case, v)].append(r)
                    if "error" not in r:
                        w = writing_per_gb(r)
                        print(f"  [{rep + 1}/{args.repeat}] N={n} {case:<5} {v:<10} {r['time']:6.2f} s = "
                              f"{r['time'] / floor:.2f} x floor, seed tx {r['seed_tx'] / size:.2f} S, busy {r['busy']:.0%}"
                              + (f", writing the copy {w:.1f} CPU s/GB/peer" if w is not None else ""),
                              file=sys.stderr, flush=True)
    return runs, failed


def main(argv=None) -> int:
    args = parse_args(argv)
    ok, why = Testbed.available()
    if not ok:
        print(f"broadcast: cannot build the testbed: {why}", file=sys.stderr)
        return 2
    if BT in args.variants:
        try:
            import libtorrent  # noqa: F401
        except ImportError:
            print("broadcast: libtorrent is not installed (pip install -e '.[bench]'), or use --tools p2pw",
                  file=sys.stderr)
            return 2
    if max(args.slow_hosts) > min(args.peers):
        print(f"broadcast: --slow-hosts {args.slow_hosts} beyond N = {min(args.peers)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)
    ncpu = os.cpu_count() or 1
    summaries, raw, failed = [], [], 0
    with tempfile.TemporaryDirectory(prefix="p2pw-bcast-") as work:
        model = f"{work}/model"
        write_synthetic_model(model, size_mb=args.size / (1 << 20), shards=2)
        size = sum(fleet.source_files(model).values())
        torrent = None
        if BT in args.variants:
            torrent = f"{work}/model.torrent"
            t = fleet.make_torrent(model, torrent, args.piece_size)
            print(f"# torrent: {t['pieces']} pieces of {t['piece_size'] >> 10} KiB (v1)", file=sys.stderr)
        intro = (f"{size / (1 << 20):.0f} MiB synthetic checkpoint (S = {size} file bytes), p2pw chunks "
                 f"{'of ' + str(args.chunk_size >> 10) + ' KiB' if args.chunk_size else 'at the seeder default'}, "
                 f"libtorrent pieces of {args.piece_size >> 10} KiB ({'TCP+uTP' if args.bt_utp else 'TCP only'}), "
                 f"medians of {args.repeat} run(s), {ncpu} CPUs; {_versions()}; the default plan is "
                 f"{default_plan() or 'unknown'}")
        pinned = {n: len(host_cpus(n, args).get(0, [])) for n in args.peers}
        intro += "; " + ", ".join(f"N = {n}: each host on {k} core{'s' * (k > 1)} of its own" if k else
                                  f"N = {n}: the {n + 1} hosts share the {len(os.sched_getaffinity(0))} cores"
                                  for n, k in pinned.items())
        starts = {n: fleet.start_cost(n) for n in args.peers} if any(v != BT for v in args.variants) else {}
        if starts:  # the bed's part of a cold start this hour (CPU speed and load differ by the hour)
            intro += "; a join's imports take " + ", ".join(
                f"{together:.2f} s {n} at once" for n, (_, together) in starts.items()) + \
                f" ({min(alone for alone, _ in starts.values()) * 1000:.0f} ms alone)"
        print(f"# broadcast: {intro}", file=sys.stderr, flush=True)
        for n in args.peers:
            try:
                runs, fails = run_n(n, args, model, torrent, work, size)
            except fleet.CopyMismatch as exc:
                print(f"broadcast: COPY MISMATCH ({exc})", file=sys.stderr)
                return 1
            failed += fails
            raw.extend(r for rs in runs.values() for r in rs)
            for case in args.cases:
                slow = case_rates(case, args.rate, args.slow_hosts, args.slow_factor)
                for v in args.variants:
                    summaries.append(summarize(runs[(case, v)], case, v, n, args.rate, slow, args))
    floors = ", ".join(f"N = {s['n']}: {s['floor']:.2f} s" for s in summaries if s.get("floor"))
    text = (f"{intro}.\n\nfloor = S / B at {args.rate:g} Mbit/s"
            f" ({floors.split(', ')[0] if floors else 'n/a'}); t/floor is launch to the last exit 0"
            f" (kill: of the survivors).\n\n{MAIN_HEAD}\n" + "\n".join(main_rows(summaries)) +
            f"\n\nPer host (medians; seconds since launch; slow/other hosts worst = that group's last exit / floor; "
            f"joined by = last join()/session start, first chunk = median first verified chunk, last chunk = last "
            f"verified chunk, from the receivers' --report):\n\n{DETAIL_HEAD}\n"
            + "\n".join(detail_rows(summaries)) + "\n")
    if late := late_rows(summaries):
        text += (f"\nLate arrivals (receivers launched one by one over {args.late_span:g} floor; bound = the fluid "
                 f"bound for the arrivals as launched, ``late_bound``):\n\n{LATE_HEAD}\n" + "\n".join(late) + "\n")
    print(text)
    if args.md:
        cmd = "sudo .venv/bin/python bench/broadcast.py " + " ".join(argv if argv is not None else sys.argv[1:])
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(f"# Broadcast on emulated hosts\n\n`{cmd.strip()}` ({when})\n\n{text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summaries": summaries, "runs": raw, "start_cost": {
            str(n): {"alone": a, "together": t} for n, (a, t) in starts.items()},
            "cores_per_host": {str(n): k for n, k in pinned.items()}}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
