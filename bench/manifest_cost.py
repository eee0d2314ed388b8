"""What checking a manifest costs a join: ``Manifest.from_wire`` (hash, parse, the strict validator) on the
manifest of the bed's 256 MiB checkpoint and of a synthetic 1 TB one, as CPU time against the time the model
itself takes through one host's uplink (400 Mbit/s, the bed's, at TCP's 95.6 %; and 100 Gbit/s).

    .venv/bin/python bench/manifest_cost.py [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pweights.sources import validate  # noqa: E402
from p2pweights.sources.chunker import build  # noqa: E402
from p2pweights.sources.formats import blob_files  # noqa: E402
from p2pweights.sources.manifest import MAX_CHUNK_SIZE, VERSION, Manifest  # noqa: E402
from p2pweights.sources.synth import write_synthetic_model  # noqa: E402

TCP_SHARE = 0.956  # of an htb rate that TCP's payload gets on the bed


def terabyte_manifest() -> Manifest:
    """1 TB in 163 shards, 150,000 tensors, 4 MiB chunks (hashes are placeholders of the right length)."""
    shards, per = 163, 10 ** 12 // 163
    files, total = blob_files([("config.json", 5000), ("tokenizer.json", 9_000_000)] +
                              [(f"model-{i:05d}-of-{shards:05d}.safetensors", per) for i in range(shards)])
    at = {f["name"]: f["offset"] + 100_000 for f in files}
    tensors = []
    for k in range(150_000):
        name = files[2 + k % shards]["name"]
        tensors.append({"name": f"model.layers.{k // 2400}.mlp.experts.{k % 256}.w{k}", "dtype": "F8_E4M3",
                        "shape": [7168, 256], "offset": at[name], "nbytes": 7168 * 256, "file": name})
        at[name] += 7168 * 256
    chunks = ["%016x" % i for i in range(-(-total // (4 << 20)))]
    return Manifest(total, 4 << 20, chunks, files, tensors)


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_model(Path(tmp) / "m", size_mb=256, shards=2)
        bed = build(Path(tmp) / "m")[0]
    print(f"{'manifest':<18}{'bytes':>12}{'from_wire ms':>14}{'validator ms':>14}{'of 400 Mbit/s':>15}"
          f"{'of 100 Gbit/s':>15}")
    for label, m, reps in (("bed 256 MiB", bed, args.reps), ("synthetic 1 TB", terabyte_manifest(), 3)):
        wire, doc = m.wire_bytes(), m.body()
        whole = timed(lambda: Manifest.from_wire(wire, m.model_id), reps)
        check = timed(lambda: validate.check(doc, MAX_CHUNK_SIZE, VERSION), reps)
        med = statistics.median(whole)
        seconds = {rate: m.total_size * 8 / (rate * TCP_SHARE) for rate in (400e6, 100e9)}
        print(f"{label:<18}{len(wire):>12,}{med * 1e3:>14.2f}{statistics.median(check) * 1e3:>14.2f}"
              f"{med / seconds[400e6]:>15.3%}{med / seconds[100e9]:>15.3%}  (CPU, median of {reps}; "
              f"range {min(whole) * 1e3:.2f}-{max(whole) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
