"""Loader benchmark (CPU): time to first tensor and to a full state_dict through p2pweights,
against ``safetensors.torch.load_file`` of the same checkpoint from local disk, in the same run
(load_file alone maps the file lazily and reads nothing; "+ clone" reads every byte into memory).
With transformers installed, a second table: time to a usable transformers model (returned, and
after its first forward pass) through ``p2pweights.hf.from_pretrained`` against
``transformers.AutoModelForCausalLM.from_pretrained`` of the same ``save_pretrained`` files on
local disk (``--hf-size-mb``, 0 to skip).

A seeder runs in a subprocess on loopback (already serving: its one read of storage is not
counted, as on a fleet where the seeder is up before the leaves join); each p2pweights load is
a fresh ``join(..., device="cpu")`` in this process.  Baseline loads read a warm page cache.

    .venv/bin/python bench/loader.py [--size-mb 512] [--hf-size-mb 512] [--repeat 3]
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
from p2pweights.sources.pack import pack
from p2pweights.sources.synth import write_synthetic_model


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
    ap.add_argument("--hf-size-mb", type=float, default=512, help="transformers model size for the hf table (0: skip)")
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
        if args.hf_size_mb > 0:
            hf_table(work, args)


def random_llama_dir(path, size_mb: float):
    """``save_pretrained`` of a random bf16 Llama of about ``size_mb`` MB (weights drawn fast, not trained)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter)
    layers = max(1, round((size_mb * 1e6 - 2 * 2 * vocab * hidden) / per_layer))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
                         dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    model.save_pretrained(path)
    return layers


def usable(load, prompt):
    """(seconds to the model object, to the end of its first forward pass, logits, first forward's end
    after the download's last chunk or None)."""
    t0 = time.perf_counter()
    model, dl = load()
    returned = time.perf_counter() - t0
    with torch.no_grad():
        logits = model(prompt).logits
    end = time.monotonic()
    first = time.perf_counter() - t0
    after = None
    if dl is not None:
        after = end - dl.store.done_at if dl.store.done_at else None
        dl.close()
    return returned, first, logits, after


def hf_table(work, args):
    try:
        import transformers
    except ImportError:
        print("\nbench: transformers is not installed: no from_pretrained table")
        return
    from p2pweights import hf

    src, packed = os.path.join(work, "hf-model"), os.path.join(work, "hf-packed")
    layers = random_llama_dir(src, args.hf_size_mb)
    pack(src, packed)
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
    prompt = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(1))
    print(f"\nbench: Llama of {layers} layers, {size / 1e9:.3f} GB bf16 (save_pretrained); best of {args.repeat}")
    logits = []

    def transformers_load():
        m = transformers.AutoModelForCausalLM.from_pretrained(src)  # dtype "auto": bf16, as saved
        return m, None

    def p2pw_load(port, stream):
        def load():
            return hf.from_pretrained(f"127.0.0.1:{port}", host="127.0.0.1", stream=stream)
        return load

    seeders = {}
    try:
        for path in (src, packed):
            seeders[path] = start_seeder(path, work, args.chunk_size)
        loads = [("transformers from_pretrained (local disk)", transformers_load)]
        loads += [(label, p2pw_load(seeders[path][1]["port"], stream)) for label, path, stream in (
            ("p2pw hf.from_pretrained, save_pretrained dir", src, False),
            ("p2pw hf.from_pretrained, packed", packed, False),
            ("p2pw hf.from_pretrained, packed, stream=True", packed, True))]
        best = {label: None for label, _ in loads}
        for _ in range(args.repeat):  # interleaved, so a noisy moment costs every row alike
            for label, load in loads:
                r = usable(load, prompt)
                if best[label] is None:
                    logits.append(r[2])
                if best[label] is None or r[1] < best[label][1]:
                    best[label] = r
        rows = [(label, *best[label][:2], best[label][3]) for label, _ in loads]
    finally:
        for proc, _ in seeders.values():
            proc.terminate()
            proc.wait(10)
    same = all(torch.equal(logits[0], x) for x in logits[1:])
    base = rows[0][2]
    print(f"\n{'time to a usable model':<48}{'returned':>11}{'first forward':>15}{'vs transformers':>17}"
          f"{'forward done after last chunk':>31}")
    for label, returned, first, after in rows:
        tail = f"{after * 1e3:>28.0f} ms" if after is not None else f"{'-':>31}"
        print(f"{label:<48}{returned * 1e3:>8.0f} ms{first * 1e3:>12.0f} ms{base / first:>16.2f}x{tail}")
    print(f"logits of every load {'equal' if same else 'DIFFER'} (first forward, same prompt)")


def p2pweights_format(report):
    from p2pweights.storage.device import format_report

    return format_report(report)


if __name__ == "__main__":
    main()
