"""A/B of two versions of p2pweights on the broadcast bed, runs alternating in the same hour.

This machine is shared and its load swings within minutes (the same
configuration took 1.42 and 1.65 x S/B an hour apart), so a change is judged
only against the code before it, run by run, on the same bed: B then A, then
A then B, and so on (ABBA), so that neither side always runs first: on this
VM what a run's joins spend filling new page cache depends on how recently
the pages were freed (bench/JOURNAL.md, 448f955: what a no-op change reads here).
Each side runs from its own git worktree (A: ``--a``, default HEAD; B:
``--b``, or HEAD with ``--patch``, or by default HEAD with the working tree's
uncommitted changes), so the checkout is never touched.  Every run is one
``bench/broadcast.py --tools p2pw --repeat 1 --trace`` of the side's own tree,
its package first on the path; the seeder's log names each run's demotions.

    sudo .venv/bin/python bench/ab.py --pairs 4 -- --rate 400 --cases slow2

prints one line per run (t/floor of each case, CPU busy, CPU s/GB/peer and
the part spent writing the copy, the hosts made leaves and when)
and, per case, both sides' medians and in how many pairs B was faster, then
the same for CPU: where the cores are the bound, a change's CPU reads through
noise that its time does not.  Needs root, as ``bench/broadcast.py`` does.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args, cwd=ROOT, input=None) -> str:
    cp = subprocess.run(["git", *args], cwd=cwd, input=input, capture_output=True, text=True)
    if cp.returncode:
        raise SystemExit(f"ab: git {' '.join(args)} failed: {cp.stderr.strip()}")
    return cp.stdout


def worktree(where: Path, rev: str, patch: str | None) -> Path:
    """A detached worktree of ``rev`` at ``where``, with ``patch`` (a diff's text) applied."""
    git("worktree", "add", "--detach", "-q", str(where), rev)
    if patch:
        git("apply", "--whitespace=nowarn", "-", cwd=where, input=patch)
    return where


def run_side(tree: Path, bench_args: list[str], out: Path) -> dict:
    """One broadcast of ``tree``'s package: {case: t/floor}, busy and demotions, or an error."""
    env = {**os.environ, "PYTHONPATH": str(tree)}  # its package before the installed (editable) one
    cmd = [sys.executable, str(tree / "bench" / "broadcast.py"), *bench_args, "--tools", "p2pw", "--repeat", "1",
           "--trace", "--json", str(out), "--md", str(out.with_suffix(".md"))]
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:  # Ctrl-C or SIGTERM here: the bench tears its namespaces down on SIGTERM
        proc.terminate()
        proc.wait(60)
        raise
    if proc.returncode or not out.exists():
        return {"error": (stderr or stdout).strip()[-300:]}
    return summarize(json.loads(out.read_text()))


@functools.lru_cache(maxsize=None)
def _trace_module():
    """``bench/trace.py``, loaded by path (``import trace`` could find the standard library's)."""
    spec = importlib.util.spec_from_file_location("bench_trace", Path(__file__).with_name("trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summarize(doc: dict) -> dict:
    """What one ``bench/broadcast.py --json`` file says, per case: t/floor, busy, CPU s/GB/peer (and the part
    spent writing the copy), demotions (host @ s), and the median end phase of its traced p2pw runs (the last
    peer done after the seeder's last chunk: ``trace.phases``)."""
    phases = _trace_module().phases
    cases = {}
    for s in doc["summaries"]:
        if s.get("ratio") is None:
            continue
        leaves = [f"h{h} @ {t:.1f}" for run in s.get("demoted") or [] for h, t in run]
        ends = [p["end"] for run in doc.get("runs", []) if run.get("tool") == "p2pw" and run.get("case") == s["case"]
                and run.get("n") == s["n"] and run.get("reports") and (p := phases(run))]
        cases[f"{s['case']} N={s['n']}"] = {"ratio": s["ratio"], "busy": s.get("busy"), "cpu": s.get("cpu_per_gb"),
                                            "writing": s.get("write_cpu_per_gb"), "leaves": leaves,
                                            "end": statistics.median(ends) if ends else None}
    return {"cases": cases}


def compare(pairs: list[tuple[dict, dict]]) -> list[str]:
    """Per case: each side's median t/floor over the pairs and in how many pairs B was faster."""
    lines = []
    cases = sorted({c for b, a in pairs for c in (b.get("cases") or {})})
    for case in cases:
        both = [(b["cases"][case], a["cases"][case]) for b, a in pairs
                if case in (b.get("cases") or {}) and case in (a.get("cases") or {})]
        if not both:
            continue
        bs, as_ = [x["ratio"] for x, _ in both], [y["ratio"] for _, y in both]
        wins = sum(x < y for x, y in zip(bs, as_))
        line = (f"{case}: B median {statistics.median(bs):.3f} ({min(bs):.3f}-{max(bs):.3f}), "
                f"A median {statistics.median(as_):.3f} ({min(as_):.3f}-{max(as_):.3f}), "
                f"B faster in {wins} of {len(both)} pairs")
        cpu = [(x.get("cpu"), y.get("cpu")) for x, y in both]
        if all(x is not None and y is not None for x, y in cpu):  # a CPU change shows here first
            line += (f"; CPU s/GB/peer B {statistics.median(x for x, _ in cpu):.2f}, "
                     f"A {statistics.median(y for _, y in cpu):.2f}, B less in {sum(x < y for x, y in cpu)} of {len(cpu)}")
        lines.append(line)
    return lines


def _line(i: int, side: str, res: dict) -> str:
    if "error" in res:
        return f"[{i}] {side} FAILED: {res['error']}"
    cells = [f"{c} {v['ratio']:.3f} busy {v['busy'] or 0:.0%}"
             + (f" cpu {v['cpu']:.2f}" if v.get("cpu") is not None else "")
             + (f" (writing {v['writing']:.2f})" if v.get("writing") is not None else "")
             + (f" end {v['end']:.2f} s" if v.get("end") is not None else "")
             + f" leaves {', '.join(v['leaves']) or 'none'}" for c, v in res["cases"].items()]
    return f"[{i}] {side} " + "; ".join(cells)


def _sigterm(*_):
    raise SystemExit(143)  # unwind: the running bench is stopped and the worktrees removed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="bench/ab.py [--a REV] [--b REV | --patch FILE] [--pairs N] -- BROADCAST ARGS")
    ap.add_argument("--a", default="HEAD", help="the version to compare against (HEAD)")
    ap.add_argument("--b", help="the version to judge (default: HEAD with the working tree's uncommitted changes)")
    ap.add_argument("--patch", help="or: HEAD with this diff applied")
    ap.add_argument("--pairs", type=int, default=4, help="pairs, B first in odd ones, A first in even ones (4)")
    ap.add_argument("--keep", help="keep every run's --json (B1.json, A1.json, ...) in this folder, for bench/trace.py")
    ap.add_argument("bench", nargs="*", help="arguments for bench/broadcast.py (after --)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    if args.b and args.patch:
        ap.error("give --b or --patch, not both")
    patch = Path(args.patch).read_text() if args.patch else None if args.b else git("diff", "HEAD")
    if not args.b and not patch:
        ap.error("nothing to judge: no --b, no --patch, and no uncommitted change")
    with tempfile.TemporaryDirectory(prefix="p2pw-ab-") as tmp:
        tmp = Path(tmp)
        keep = Path(args.keep) if args.keep else tmp
        keep.mkdir(parents=True, exist_ok=True)
        trees = {}
        try:
            trees["A"] = worktree(tmp / "a", args.a, None)
            trees["B"] = worktree(tmp / "b", args.b or "HEAD", patch)
            pairs = []
            for i in range(1, args.pairs + 1):
                got = {}
                for side in ("B", "A") if i % 2 else ("A", "B"):
                    got[side] = run_side(trees[side], args.bench, keep / f"{side}{i}.json")
                    print(_line(i, side, got[side]), flush=True)
                pairs.append((got["B"], got["A"]))
            print("\n".join(compare(pairs)))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
