#!/usr/bin/env bash
# GPU check (prepared; needs a CUDA host): correctness of the CUDA sink, and its h2d GB/s
# against a plain pinned copy_ of the same bytes, in the same run.  Bounded to ~3 minutes.
#   bash bench/gpu_check.sh [SIZE_MB]
set -euo pipefail
SIZE_MB=${1:-2048}
PY=${PY:-.venv/bin/python}
timeout 180 "$PY" - "$SIZE_MB" <<'PY'
import os, sys, tempfile, time
import torch
import p2pweights
from safetensors.torch import load_file
from p2pweights.storage.device import format_report
from p2pweights.sources.pack import pack
from p2pweights.sources.synth import write_synthetic_model

assert torch.cuda.is_available(), "no CUDA here"
size_mb = float(sys.argv[1])
with tempfile.TemporaryDirectory() as work:
    write_synthetic_model(f"{work}/m", size_mb=size_mb, shards=2)
    pack(f"{work}/m", f"{work}/p")
    with p2pweights.seed(f"{work}/p", port=0, host="127.0.0.1") as s:
        dl = p2pweights.join(f"127.0.0.1:{s.port}", host="127.0.0.1", device="cuda:0")
        sd = dl.state_dict(timeout=120)
        torch.cuda.synchronize()
        rep = dl.stage_report()
        ref = {}
        for f in sorted(os.listdir(f"{work}/m")):
            if f.endswith(".safetensors"):
                ref.update(load_file(f"{work}/m/{f}"))
        bad = [k for k in ref if not torch.equal(sd[k].cpu().view(torch.uint8), ref[k].view(torch.uint8))]
        print(format_report(rep))
        print(f"correctness: {len(ref) - len(bad)}/{len(ref)} tensors equal" + (f"; BAD: {bad[:5]}" if bad else ""))
        nbytes = dl.manifest.total_size
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host.copy_(dl.loader.sink.buffer.cpu())
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True); torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        sink = rep["h2d"]["GBps"]
        print(f"h2d: sink {sink} GB/s (busy time, 4 MiB copies from the staging ring) vs plain pinned copy_ "
              f"{nbytes / best / 1e9:.2f} GB/s -> ratio {sink / (nbytes / best / 1e9):.2f}")
        dl.close()
        sys.exit(1 if bad else 0)
PY
