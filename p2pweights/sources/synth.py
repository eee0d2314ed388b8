"""Synth: a realistic synthetic Llama-style checkpoint for the demo, tests and benchmarks.

Tensor bytes are pseudo-random (``numpy.random.default_rng(seed).bytes``): fast
and deterministic for a seed, but for float dtypes they are NOT guaranteed to be
finite numbers (NaN and inf bit patterns occur).  Use them to move and verify
bytes, not to run a forward pass.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from .formats import DTYPE_SIZES, tensor_nbytes

CHUNK = 8 << 20  # bytes drawn from the generator per call (fixed: part of the output for a seed)
HIDDEN_SIZES = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)
BASE_VOCAB = 32000
MIN_LAYERS = 4
TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _header(tensors, metadata) -> bytes:
    """Safetensors header block for ``(name, dtype, shape)`` laid out back to back."""
    header = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, dtype, shape in tensors:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        nbytes = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path, tensors, metadata: dict | None = None) -> None:
    """Write a valid safetensors file from ``[(name, dtype, shape, bytes | ndarray)]`` in the given order.

    The header is little-endian u64 length + JSON padded with spaces to a multiple of 8;
    ValueError if a tensor's data size does not match its dtype and shape.
    """
    views = []
    for name, dtype, shape, data in tensors:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                          if isinstance(data, np.ndarray) else data).cast("B")
        want = tensor_nbytes(dtype, shape)
        if view.nbytes != want:
            raise ValueError(f"tensor {name!r}: {view.nbytes} data bytes, {dtype}{list(shape)} needs {want}")
        views.append(view)
    with open(path, "wb") as f:
        f.write(_header([t[:3] for t in tensors], metadata))
        for view in views:
            f.write(view)


def _shapes(hidden: int, inter: int, vocab: int, layers: int) -> list[tuple[str, tuple]]:
    """Llama tensor names and shapes in forward-pass order."""
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,))]
        out += [(p + f"self_attn.{x}_proj.weight", (hidden, hidden)) for x in "qkvo"]
        out += [(p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (inter, hidden)),
                (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter))]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def _intermediate(hidden: int) -> int:
    step = 256 if hidden >= 1024 else 16
    return -(-(8 * hidden // 3) // step) * step


def _dims(budget: int, elem: int) -> tuple[int, int, int, int]:
    """(hidden, intermediate, vocab, layers) whose parameter bytes come close to ``budget``.

    The largest hidden size whose two embeddings fit in half the budget with at least
    MIN_LAYERS layers; vocab is 32000 (less when small), then grown to absorb the remainder.
    """
    best = None
    for hidden in HIDDEN_SIZES:
        inter = _intermediate(hidden)
        unit = 64 if hidden >= 256 else 8
        vocab = min(BASE_VOCAB, budget // (4 * hidden * elem) // unit * unit)
        if vocab < unit:
            continue
        per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * elem
        fixed = (2 * vocab * hidden + hidden) * elem
        layers = (budget - fixed) // per_layer
        if layers >= 1 and (best is None or layers > best[3]):
            best = (hidden, inter, vocab, layers, unit)
        if layers >= MIN_LAYERS:
            break
    if best is None:
        raise ValueError(f"{budget} bytes is too small for a synthetic model")
    hidden, inter, vocab, layers, unit = best
    spare = budget - (2 * vocab * hidden + hidden) * elem - layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * elem
    vocab += spare // (2 * hidden * elem) // unit * unit
    return hidden, inter, vocab, layers


def _split(sizes: list[int], shards: int) -> list[int]:
    """Shard index of each tensor: forward order, about equal bytes, no empty shard."""
    owner, shard, filled, left = [], 0, 0, sum(sizes)
    target = left / shards
    for i, size in enumerate(sizes):
        tensors_left = len(sizes) - i
        if filled and shard < shards - 1 and (filled >= target or tensors_left == shards - shard - 1):
            shard, filled = shard + 1, 0
            target = left / (shards - shard)
        owner.append(shard)
        filled += size
        left -= size
    return owner


def _tokenizer(vocab_size: int) -> dict:
    """A small byte-level BPE tokenizer.json (256 byte tokens + specials, no merges)."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(specials)],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "ByteFallback"},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "vocab": vocab, "merges": []},
    }


def write_synthetic_model(out_dir, size_mb: float = 256, shards: int = 2, dtype: str = "BF16",
                          seed: int = 0) -> dict:
    """Write a Llama-style checkpoint of about ``size_mb`` MiB of tensors into ``out_dir``.

    Files: ``model-0000k-of-0000n.safetensors`` shards split in forward order with
    ``model.safetensors.index.json`` (one ``model.safetensors`` and no index when
    ``shards == 1``), ``config.json`` and a small ``tokenizer.json``.  Data are
    pseudo-random bytes, deterministic for ``seed`` (floats may be NaN/inf).
    Returns ``{"dir", "files" (names, sorted), "total_bytes" (all files), "tensors", "layers"}``.
    """
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    hidden, inter, vocab, layers = _dims(int(size_mb * (1 << 20)), DTYPE_SIZES[dtype])
    specs = _shapes(hidden, inter, vocab, layers)
    if shards > len(specs):
        raise ValueError(f"{shards} shards but the model has only {len(specs)} tensors")
    sizes = [tensor_nbytes(dtype, shape) for _, shape in specs]
    owner = _split(sizes, shards)

    os.makedirs(out_dir, exist_ok=True)
    names = (["model.safetensors"] if shards == 1 else
             [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)])
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, fname in enumerate(names):
        members = [(n, dtype, shape) for (n, shape), o in zip(specs, owner) if o == k]
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(_header(members, {"format": "pt"}))
            for name, _, shape in members:
                weight_map[name] = fname
                left = tensor_nbytes(dtype, shape)
                while left:
                    n = min(left, CHUNK)
                    f.write(rng.bytes(n))
                    left -= n

    heads = max(1, hidden // (128 if hidden >= 2048 else 64))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": TORCH_DTYPES.get(dtype, dtype.lower()),
    }
    side = {"config.json": config, "tokenizer.json": _tokenizer(vocab)}
    if shards > 1:
        side["model.safetensors.index.json"] = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    for fname, obj in side.items():
        with open(os.path.join(out_dir, fname), "w") as f:
            json.dump(obj, f, indent=2)

    files = sorted(names + list(side))
    return {"dir": os.path.abspath(out_dir), "files": files,
            "total_bytes": sum(os.path.getsize(os.path.join(out_dir, n)) for n in files),
            "tensors": len(specs), "layers": layers}
