"""Demo: the built-in default job, a local broadcast of a generated model.

It writes a Llama-style safetensors checkpoint, starts ``p2pw seed`` and N
``p2pw join`` processes on loopback, shows their progress, verifies every copy
against the manifest, and prints what happened: per-peer time and throughput,
the tree, and how much the seeder read from storage.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from .sources.chunker import build
from .sources.source import verify_copy
from .sources.synth import write_synthetic_model


def p2pw_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2pweights", *args]


def wait_for_file(path: str, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with status {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout} s")
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)


def bytes_on_disk(root: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


def run_demo(peers: int = 4, size_mb: float = 256, workdir: str | None = None, chunk_size: int | None = None,
             timeout: float = 600) -> int:
    work = workdir or tempfile.mkdtemp(prefix="p2pw-demo-")
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "model")
    procs: list[subprocess.Popen] = []
    try:
        t0 = time.monotonic()
        if not os.path.isdir(model):
            info = write_synthetic_model(model, size_mb=size_mb, shards=2)
            print(f"demo: generated a {info['layers']}-layer Llama-style checkpoint, {info['tensors']} tensors, "
                  f"{info['total_bytes'] / 2**20:.1f} MiB in {time.monotonic() - t0:.1f} s: {model}")
        ready, seed_report = os.path.join(work, "seed.ready"), os.path.join(work, "seed.json")
        for p in (ready, seed_report):
            if os.path.exists(p):
                os.remove(p)
        seeder = subprocess.Popen(p2pw_argv("seed", model, "--port", "0", "--host", "127.0.0.1",
                                            *(["--chunk-size", str(chunk_size)] if chunk_size else []),
                                            "--ready", ready,
                                            "--report", seed_report, "--exit-after", str(peers)),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(seeder)
        info = wait_for_file(ready, seeder, 120)
        print(f"demo: seeder on 127.0.0.1:{info['port']}, model id {info['model_id'][:16]}; "
              f"starting {peers} peers")
        outs, reports = [], []
        for k in range(peers):
            out, rep = os.path.join(work, f"peer{k + 1}"), os.path.join(work, f"peer{k + 1}.json")
            shutil.rmtree(out, ignore_errors=True)
            if os.path.exists(rep):
                os.remove(rep)
            outs.append(out)
            reports.append(rep)
            procs.append(subprocess.Popen(
                p2pw_argv("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "--out", out,
                          "--model-id", info["model_id"], "--report", rep, "-q"),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        start = time.monotonic()
        total = info["total_size"]
        while any(p.poll() is None for p in procs[1:]):
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"peers not done after {timeout} s")
            got = [min(bytes_on_disk(o), total) for o in outs]
            bar = " ".join(f"p{k + 1}:{100 * g / total:3.0f}%" for k, g in enumerate(got))
            sys.stdout.write(f"\rdemo: {time.monotonic() - start:5.1f}s  {bar}")
            sys.stdout.flush()
            time.sleep(0.2)
        sys.stdout.write("\n")
        failed = [(k, p) for k, p in enumerate(procs[1:]) if p.returncode != 0]
        for k, p in failed:
            print(f"demo: peer{k + 1} failed ({p.returncode}): {p.stderr.read().decode().strip()}")
        seeder.wait(30)
        with open(seed_report) as f:
            seed_info = json.load(f)
        all_ok = _report(model, chunk_size, outs, reports, seed_info, not failed, workdir)
        return 0 if all_ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def _report(model, chunk_size, outs, reports, seed_info, ok: bool, kept: str | None) -> bool:
    """Print each peer's line, the plan per stripe and the seeder's reads; True if every copy verified.
    ``kept``: the --workdir the model and copies stay in (None: a temporary one, removed after)."""
    manifest, _, _ = build(model, chunk_size)
    print(f"\n{'peer':<7}{'rank':>5}{'parent':>8}{'seconds':>9}{'MB/s':>9}  copy")
    all_ok = ok
    plans = {}  # rank -> [{stripe, rank}] its planned sources when it finished
    for k, (out, rep) in enumerate(zip(outs, reports)):
        if not os.path.exists(rep):
            all_ok = False
            print(f"peer{k + 1:<3}{'-':>5}{'-':>8}{'-':>9}{'-':>9}  FAILED")
            continue
        with open(rep) as f:
            r = json.load(f)
        _, problem = verify_copy(out, manifest)
        all_ok &= problem is None
        plans[r["rank"]] = r.get("plan", [])
        print(f"peer{k + 1:<3}{r['rank']:>5}{','.join(map(str, r['parents'])):>8}{r['seconds']:>9.2f}"
              f"{r['bytes'] / r['seconds'] / 1e6:>9.1f}  {'verified' if problem is None else problem}")
    print()
    for stripe, tree in enumerate(_trees(plans)):
        print(f"stripe {stripe}:  " + "; ".join(f"{p} -> {', '.join(map(str, c))}" for p, c in sorted(tree.items())))
    print(f"seeder read {seed_info['bytes_read'] / 2**20:.1f} MiB from storage for a "
          f"{seed_info['total_size'] / 2**20:.1f} MiB model ({seed_info['bytes_read'] / seed_info['total_size']:.2f}x), "
          f"sent {seed_info['bytes_sent'] / 2**20:.1f} MiB; peers forwarded the rest")
    where = f"the model and copies are in {kept}" if kept else "the model and copies are removed; --workdir DIR keeps them"
    print(f"demo: {'every copy verified' if all_ok else 'FAILED'} ({where})")
    return all_ok


def _trees(plans: dict) -> list[dict[int, list[int]]]:
    """Per stripe: parent rank -> the ranks it feeds by plan (``plans``: rank -> [{stripe, rank}])."""
    trees: list[dict[int, list[int]]] = []
    for rank, plan in sorted(plans.items()):
        for p in plan:
            while len(trees) <= p["stripe"]:
                trees.append({})
            trees[p["stripe"]].setdefault(p["rank"], []).append(int(rank))
    return trees
