"""Execute while loading: a small GPT-style model whose layers wait for their own weights.

The example writes the model's weights once (packed, forward-pass order), seeds them over a
throttled loopback seeder (P2PW_FAULTS=delay_send, so loading takes visible time), joins with
``device=`` and runs a forward pass whose blocks each wait for their tensors in a forward
pre-hook: block 0 computes while later blocks are still arriving.  It prints per-block arrival
and compute times, and time to first output against load-then-run, and checks that both give the
original model's outputs and greedy tokens (``examples/transformers_load.py`` does the same for a
transformers Llama through ``p2pweights.hf``).

    .venv/bin/python examples/execute_while_load.py [--device cuda:0] [--delay-ms 5]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn
from safetensors.torch import save_file

import p2pweights
from p2pweights.sources.pack import pack

D, LAYERS, VOCAB, SEQ = 512, 8, 4096, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 8, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def greedy(model, ids, steps: int = 8):
    """``ids`` followed by ``steps`` greedily chosen next tokens."""
    for _ in range(steps):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def seeder(path, work, delay_ms):
    ready = os.path.join(work, "ready")
    env = dict(os.environ, P2PW_FAULTS=f"delay_send={delay_ms}")
    proc = subprocess.Popen([sys.executable, "-m", "p2pweights", "seed", path, "--port", "0", "--host",
                             "127.0.0.1", "--chunk-size", str(256 << 10), "--ready", ready], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise SystemExit("seeder failed to start")
        time.sleep(0.05)
    with open(ready) as f:
        return proc, json.load(f)["port"]


def attach_waits(model, dl, log, t0):
    """Give each top-level module a pre-hook that waits for (and assigns) its own tensors."""
    def hook(prefix):
        def pre(module, args):
            for name, _ in list(module.named_parameters(recurse=True)) + list(module.named_buffers()):
                t = dl.wait_tensor(prefix + name, timeout=60)
                owner, leaf = module, name
                while "." in leaf:
                    head, leaf = leaf.split(".", 1)
                    owner = getattr(owner, head)
                if isinstance(getattr(owner, leaf), nn.Parameter):
                    setattr(owner, leaf, nn.Parameter(t, requires_grad=False))
                else:
                    setattr(owner, leaf, t)
            log.append((prefix.rstrip("."), time.perf_counter() - t0))
        return pre
    for name in ("embed", "norm", "head"):
        getattr(model, name).register_forward_pre_hook(hook(name + "."))
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(hook(f"layers.{i}."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--delay-ms", type=float, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    with tempfile.TemporaryDirectory(prefix="p2pw-ewl-") as work:
        reference = GPT().eval()
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, os.path.join(work, "m.safetensors"))
        pack(os.path.join(work, "m.safetensors"), os.path.join(work, "packed"))
        with torch.no_grad():
            want = reference(ids)
            want_tokens = greedy(reference, ids)
        equal = True
        proc, port = seeder(os.path.join(work, "packed"), work, args.delay_ms)
        try:
            runs = {}
            for mode in ("execute-while-load", "load-then-run"):
                with torch.device("meta"):
                    model = GPT().eval()
                t0 = time.perf_counter()
                dl = p2pweights.join(f"127.0.0.1:{port}", host="127.0.0.1", device=args.device)
                log = []
                if mode == "load-then-run":
                    model.load_state_dict(dl.state_dict(timeout=120), assign=True)
                    log.append(("all weights", time.perf_counter() - t0))
                else:
                    attach_waits(model, dl, log, t0)
                with torch.no_grad():
                    out = model(ids.to(args.device))
                    first_output = time.perf_counter() - t0
                    got = greedy(model, ids.to(args.device)).cpu()
                runs[mode] = first_output
                assert torch.allclose(out.cpu().float(), want, atol=1e-4), "output differs from the original"
                equal &= torch.equal(got, want_tokens)
                print(f"\n{mode} on {args.device}:")
                prev = None
                for name, at in log:
                    print(f"  {name:<14} weights usable at {at * 1e3:8.1f} ms")
                print(f"  first output at {first_output * 1e3:.1f} ms (blob complete at "
                      f"{dl.stage_report()['fetch']['seconds'] * 1e3:.1f} ms after join)")
                dl.close()
            print(f"\ntime to first output: execute-while-load {runs['execute-while-load'] * 1e3:.0f} ms, "
                  f"load-then-run {runs['load-then-run'] * 1e3:.0f} ms")
            print(f"greedy tokens: {want_tokens[0, SEQ:].tolist()}")
            assert equal, "greedy tokens differ from the original model's"
            print("tokens equal")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
