"""Loader benchmark (CPU): time to first tensor and to a full state_dict through p2pweights,
against ``safetensors.torch.load_file`` of the same checkpoint from local disk, in the same run
(load_file alone maps the file lazily and reads nothing; "+ clone" reads every byte into memory).

A seeder runs in a subprocess on loopback (already serving: its one read of storage is not
counted, as on a fleet where the seeder is up before the leaves join); each p2pweights load is
a fresh ``join(..., device="cpu")`` in this process.  Baseline loads read a warm page cache.

    .venv/bin/python bench/loader.py [--size-mb 512] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import p2pweights
from p2pweights.pack import pack
from p2pweights.synth import write_synthetic_model


def start_seeder(path, work, chunk_size):
    ready = os.path.join(work, f"ready-{os.path.basename(path)}")
    proc = subprocess.Popen([sys.executable, "-m", "p2pweights", "seed", str(path), "--port", "0", "--host",
                             "127.0.0.1", "--chunk-size", str(chunk_size), "--ready", ready],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("bench: seeder did not start")
        time.sleep(0.05)
    with open(ready) as f:
        return proc, json.load(f)


def p2pw_load(port):
    t0 = time.perf_counter()
    dl = p2pweights.join(f"127.0.0.1:{port}", host="127.0.0.1", device="cpu")
    try:
        name, _ = next(dl.iter_tensors())
        first = time.perf_counter() - t0
        sd = dl.state_dict()
        full = time.perf_counter() - t0
        return first, full, len(sd), dl.stage_report()
    finally:
        dl.close()


def safetensors_load(shards, touch: bool):
    """load_file of every shard; with ``touch``, also clone every tensor (its bytes really read into memory)."""
    t0 = time.perf_counter()
    with safe_open(shards[0], framework="pt") as f:
        t = f.get_tensor(next(iter(f.keys())))
        if touch:
            t.clone()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    sd = {}
    for s in shards:
        sd.update(load_file(s))
    if touch:
        sd = {k: v.clone() for k, v in sd.items()}
    return first, time.perf_counter() - t0, len(sd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=4 << 20)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="p2pw-bench-loader-") as work:
        src, packed = os.path.join(work, "model"), os.path.join(work, "packed")
        info = write_synthetic_model(src, size_mb=args.size_mb, shards=2)
        pack(src, packed)
        shards = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors"))
        size = sum(os.path.getsize(s) for s in shards)
        print(f"bench: {info['tensors']} tensors, {size / 1e9:.3f} GB in {len(shards)} shards; best of {args.repeat}")
        rows = []
        for touch, label in ((False, "safetensors load_file (lazy mmap)"), (True, "safetensors load_file + clone")):
            runs = [safetensors_load(shards, touch) for _ in range(args.repeat)]
            rows.append((label, min(r[0] for r in runs), min(r[1] for r in runs), None))
        procs = []
        try:
            for label, path in (("p2pw join, safetensors dir", src), ("p2pw join, packed", packed)):
                proc, ready = start_seeder(path, work, args.chunk_size)
                procs.append(proc)
                best = None
                for _ in range(args.repeat):
                    r = p2pw_load(ready["port"])
                    if best is None or r[1] < best[1]:
                        best = r
                rows.append((label, best[0], best[1], best[3]))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
        base = rows[1][2]
        print(f"\n{'loader':<38}{'first tensor':>14}{'state_dict':>12}{'GB/s':>8}{'vs +clone':>12}")
        for label, first, full, _ in rows:
            print(f"{label:<38}{first * 1e3:>11.1f} ms{full * 1e3:>9.1f} ms{size / full / 1e9:>8.2f}"
                  f"{base / full:>11.2f}x")
        for label, _, _, report in rows[2:]:
            print(f"\n{label}: stage report of the best run\n" + p2pweights_format(report))


def p2pweights_format(report):
    from p2pweights.device import format_report

    return format_report(report)


if __name__ == "__main__":
    main()
