"""synth: the synthetic checkpoint is valid safetensors, Llama-shaped, sized as asked and deterministic."""
import json
import time

import numpy as np
import pytest
from safetensors import safe_open

from p2pweights.sources.formats import layout, read_safetensors_header
from p2pweights.sources.synth import write_synthetic_model


def shard_names(info):
    return [f for f in info["files"] if f.endswith(".safetensors")]


def test_sharded_model_is_valid_safetensors(tmp_path):
    info = write_synthetic_model(tmp_path, size_mb=4, shards=3, dtype="F16", seed=7)
    assert shard_names(info) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert set(info["files"]) >= {"config.json", "tokenizer.json", "model.safetensors.index.json"}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    seen = {}
    for name in shard_names(info):
        path = tmp_path / name
        raw = path.read_bytes()
        tensors, _ = read_safetensors_header(path)
        assert tensors, f"{name} is empty"
        with safe_open(str(path), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            assert set(f.keys()) == {t["name"] for t in tensors}
            for t in tensors:
                x = f.get_tensor(t["name"])
                assert x.dtype == np.float16 and list(x.shape) == t["shape"]
                assert raw[t["offset"]:t["offset"] + t["nbytes"]] == x.tobytes()
                seen[t["name"]] = name
    assert index["weight_map"] == seen
    assert len(seen) == info["tensors"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == info["total_bytes"]


def test_llama_names_shapes_and_forward_order(tmp_path):
    info = write_synthetic_model(tmp_path, size_mb=2, shards=2, seed=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    assert L == info["layers"] >= 1 and cfg["torch_dtype"] == "bfloat16"
    assert h % cfg["num_attention_heads"] == 0
    files, tensors, _ = layout(tmp_path)
    names = [t["name"] for t in tensors]  # blob order == forward order
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    shapes = {t["name"]: tuple(t["shape"]) for t in tensors}
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (v, h)
    for n in range(L):
        p = f"model.layers.{n}."
        for x in "qkvo":
            assert shapes[p + f"self_attn.{x}_proj.weight"] == (h, h)
        assert shapes[p + "mlp.gate_proj.weight"] == shapes[p + "mlp.up_proj.weight"] == (i, h)
        assert shapes[p + "mlp.down_proj.weight"] == (h, i)
        assert shapes[p + "input_layernorm.weight"] == shapes[p + "post_attention_layernorm.weight"] == (h,)
    assert info["tensors"] == 3 + 9 * L
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of)
    assert all(t["dtype"] == "BF16" for t in tensors)
    json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]


@pytest.mark.parametrize("size_mb", [0.25, 1, 8, 64])
def test_size_close_to_request(tmp_path, size_mb):
    info = write_synthetic_model(tmp_path, size_mb=size_mb, shards=1)
    assert info["files"] == ["config.json", "model.safetensors", "tokenizer.json"]
    tensors, _ = read_safetensors_header(tmp_path / "model.safetensors")
    total = sum(t["nbytes"] for t in tensors)
    assert abs(total - size_mb * 2**20) <= 0.02 * size_mb * 2**20
    assert info["layers"] >= 1


def test_bf16_loads_with_torch(tmp_path):
    torch = pytest.importorskip("torch")
    write_synthetic_model(tmp_path, size_mb=1, shards=2, dtype="BF16")
    for path in sorted(tmp_path.glob("*.safetensors")):
        raw = path.read_bytes()
        tensors, _ = read_safetensors_header(path)
        with safe_open(str(path), framework="pt") as f:
            for t in tensors:
                x = f.get_tensor(t["name"])
                assert x.dtype == torch.bfloat16
                assert raw[t["offset"]:t["offset"] + t["nbytes"]] == x.view(torch.uint8).numpy().tobytes()


def test_deterministic_per_seed(tmp_path):
    a = write_synthetic_model(tmp_path / "a", size_mb=1, shards=2, seed=3)
    b = write_synthetic_model(tmp_path / "b", size_mb=1, shards=2, seed=3)
    c = write_synthetic_model(tmp_path / "c", size_mb=1, shards=2, seed=4)
    for name in a["files"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    shard = shard_names(a)[0]
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()
    assert a["files"] == c["files"]


def test_many_shards_none_empty(tmp_path):
    info = write_synthetic_model(tmp_path, size_mb=1, shards=8)
    assert len(shard_names(info)) == 8
    for name in shard_names(info):
        assert read_safetensors_header(tmp_path / name)[0]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        write_synthetic_model(tmp_path, size_mb=1, dtype="F4")
    with pytest.raises(ValueError, match="shards"):
        write_synthetic_model(tmp_path, size_mb=1, shards=0)
    with pytest.raises(ValueError, match="too small"):
        write_synthetic_model(tmp_path, size_mb=0.001)


def test_300mb_is_fast(tmp_path):
    t0 = time.perf_counter()
    info = write_synthetic_model(tmp_path, size_mb=300, shards=4)
    elapsed = time.perf_counter() - t0
    assert info["total_bytes"] > 290 * 2**20
    assert elapsed < 15, f"300 MiB took {elapsed:.1f}s"
