"""Load a transformers Llama through p2pweights, twice: load-then-run, and execute-while-load.

Builds a small random Llama, saves it with ``save_pretrained`` and packs it (forward-pass order),
seeds it on a throttled loopback seeder, and loads it with ``p2pweights.hf.from_pretrained``: once
waiting for every tensor, once with ``stream=True`` (the model comes back before its weights; each
layer waits for its own tensors when it first runs, so the first token starts on layer 0 while
later layers are still arriving).  Both generate greedily and must give
the original model's tokens.

    .venv/bin/python examples/transformers_load.py [--device cuda:0] [--delay-ms 10]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

try:
    import transformers  # noqa: F401
except ImportError:
    print("transformers is not installed: skipping (pip install transformers to run this example)")
    sys.exit(0)

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from p2pweights import hf
from p2pweights.sources.pack import pack


def seeder(path, work, delay_ms):
    """``p2pw seed`` in a subprocess; sending throttled by ``delay_ms`` per chunk (P2PW_FAULTS)."""
    ready = os.path.join(work, "ready")
    env = dict(os.environ, P2PW_FAULTS=f"delay_send={delay_ms}") if delay_ms else None
    proc = subprocess.Popen([sys.executable, "-m", "p2pweights", "seed", path, "--port", "0", "--host",
                             "127.0.0.1", "--chunk-size", str(64 << 10), "--ready", ready], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise SystemExit("seeder failed to start")
        time.sleep(0.05)
    with open(ready) as f:
        return proc, json.load(f)["port"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--delay-ms", type=float, default=10, help="seeder delay per chunk sent")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    original = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 8))
    want = original.generate(prompt, max_new_tokens=8, do_sample=False)
    print(f"original    : {want[0, 8:].tolist()}")
    equal = True
    with tempfile.TemporaryDirectory(prefix="p2pw-hf-") as work:
        original.save_pretrained(os.path.join(work, "model"))
        pack(os.path.join(work, "model"), os.path.join(work, "packed"))
        proc, port = seeder(os.path.join(work, "packed"), work, args.delay_ms)
        try:
            for stream in (False, True):
                t0 = time.perf_counter()
                model, dl = hf.from_pretrained(f"127.0.0.1:{port}", device=args.device, stream=stream,
                                               host="127.0.0.1", timeout=120)
                returned, had = time.perf_counter() - t0, dl.progress
                first = []
                model.register_forward_hook(lambda *_: first.append(time.perf_counter() - t0))
                try:
                    got = model.generate(prompt.to(args.device), max_new_tokens=8, do_sample=False).cpu()
                finally:
                    dl.close()
                mode = "execute-while-load" if stream else "load-then-run"
                print(f"{mode:<19} on {args.device}: model returned at {returned * 1e3:6.0f} ms with "
                      f"{had['chunks']:3} of {had['n_chunks']} chunks verified; first token at "
                      f"{first[0] * 1e3:6.0f} ms, all 8 at {first[-1] * 1e3:6.0f} ms")
                print(f"p2pweights  : {got[0, 8:].tolist()}")
                equal &= torch.equal(want, got)
        finally:
            proc.terminate()
            proc.wait(10)
    assert equal, "tokens differ from the original model's"
    print("tokens equal")


if __name__ == "__main__":
    main()
