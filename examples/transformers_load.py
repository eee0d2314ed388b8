"""Load a transformers Llama through p2pweights (skips cleanly when transformers is not installed).

Builds a small random-config Llama, saves it as safetensors, seeds it on loopback, builds the
same architecture on the meta device, loads the weights from a ``join(..., device=...)`` with
``load_state_dict(..., assign=True)``, generates a few tokens and checks they equal the original's.

    .venv/bin/python examples/transformers_load.py [--device cuda:0]
"""
import argparse
import sys
import tempfile

try:
    import transformers
except ImportError:
    print("transformers is not installed: skipping (pip install transformers to run this example)")
    sys.exit(0)

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import p2pweights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    original = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 8))
    want = original.generate(prompt, max_new_tokens=8, do_sample=False)
    with tempfile.TemporaryDirectory(prefix="p2pw-hf-") as work:
        original.save_pretrained(work, safe_serialization=True)
        with p2pweights.seed(work, port=0, host="127.0.0.1") as s:
            with torch.device("meta"):
                model = LlamaForCausalLM(config).eval()
            dl = p2pweights.join(f"127.0.0.1:{s.port}", host="127.0.0.1", device=args.device)
            try:
                model.load_state_dict(dl.state_dict(timeout=120), assign=True, strict=False)
                model.tie_weights()
                model = model.to(args.device)  # non-persistent buffers (rotary inv_freq) are rebuilt here
                got = model.generate(prompt.to(args.device), max_new_tokens=8, do_sample=False).cpu()
            finally:
                dl.close()
    print(f"original : {want.tolist()}\np2pweights: {got.tolist()}")
    assert torch.equal(want, got), "tokens differ"
    print("tokens equal")


if __name__ == "__main__":
    main()
