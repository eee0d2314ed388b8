"""pack: the loading-optimised layout round-trips, is in forward-pass order and 4 KiB aligned, and seeds with its index."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2pweights.sources.formats import ALIGN, FormatError, layout
from p2pweights.sources.chunker import build
from p2pweights.sources.pack import BLOB, INDEX, forward_key, pack, unpack
from p2pweights.sources.synth import write_synthetic_model


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    out = {
        "lm_head.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "model.layers.10.mlp.weight": torch.randn(3, 3, generator=g).to(torch.float16),
        "model.layers.2.attn.weight": torch.randn(5, generator=g),
        "model.layers.2.codes": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=g),
        "model.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(11, 5, generator=g).to(torch.bfloat16),
        "model.layers.0.mask": torch.randint(0, 2, (3, 5), generator=g).bool(),
        "model.layers.0.scalar": torch.tensor(2.5),
        "model.layers.1.empty": torch.zeros(0, 4),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["model.layers.1.fp8"] = torch.randn(13, generator=g).to(torch.float8_e4m3fn)
    return out


def assert_same(got: dict, want: dict):
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), k


def test_forward_order_key():
    names = ["lm_head.weight", "model.norm.weight", "model.layers.10.a", "model.layers.2.b",
             "model.layers.2.a", "model.embed_tokens.weight"]
    ordered = [n for _, n in sorted((forward_key(n, i), n) for i, n in enumerate(names))]
    assert ordered == ["model.embed_tokens.weight", "model.layers.2.b", "model.layers.2.a", "model.layers.10.a",
                       "model.norm.weight", "lm_head.weight"]


def test_pack_roundtrip_dtypes_order_alignment(tmp_path):
    src = tmp_path / "m.safetensors"
    tensors = mixed_tensors()
    save_file(tensors, str(src))
    doc = pack(src, tmp_path / "packed")
    names = [t["name"] for t in doc["tensors"]]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layers = [int(n.split(".")[2]) for n in names if ".layers." in n]
    assert layers == sorted(layers)
    assert all(t["offset"] % ALIGN == 0 for t in doc["tensors"])
    assert os.path.getsize(tmp_path / "packed" / BLOB) == doc["total_size"]
    unpack(tmp_path / "packed", tmp_path / "back.safetensors")
    assert_same(load_file(str(tmp_path / "back.safetensors")), tensors)


def test_layout_reads_the_packed_index(tmp_path):
    write_synthetic_model(tmp_path / "m", size_mb=3, shards=2)
    pack(tmp_path / "m", tmp_path / "p")
    assert sorted(os.listdir(tmp_path / "p")) == ["config.json", BLOB, INDEX, "tokenizer.json"]
    files, tensors, total = layout(tmp_path / "p")
    blob = next(f for f in files if f["name"] == BLOB)
    assert all(t["file"] == BLOB and t["offset"] % ALIGN == 0 for t in tensors)
    raw = open(tmp_path / "p" / BLOB, "rb").read()
    ref = {}
    for f in os.listdir(tmp_path / "m"):
        if f.endswith(".safetensors"):
            ref.update(load_file(str(tmp_path / "m" / f)))
    assert {t["name"] for t in tensors} == set(ref)
    for t in tensors:
        lo = t["offset"] - blob["offset"]
        assert raw[lo:lo + t["nbytes"]] == ref[t["name"]].view(torch.uint8).numpy().tobytes()
    m, _, _ = build(tmp_path / "p", chunk_size=1 << 16)
    assert len(m.tensors) == len(ref)


def test_bad_packed_index_is_one_clear_error(tmp_path):
    write_synthetic_model(tmp_path / "m", size_mb=1, shards=1)
    pack(tmp_path / "m", tmp_path / "p")
    doc = json.loads((tmp_path / "p" / INDEX).read_text())
    doc["tensors"][1]["offset"] += 1
    (tmp_path / "p" / INDEX).write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="misaligned"):
        layout(tmp_path / "p")
    with pytest.raises(FormatError, match="already holds a packed checkpoint"):
        pack(tmp_path / "m", tmp_path / "p")


def test_cli_pack_and_unpack(tmp_path):
    write_synthetic_model(tmp_path / "m", size_mb=2, shards=2)
    run = lambda *a: subprocess.run([sys.executable, "-m", "p2pweights", *map(str, a)], capture_output=True,
                                    text=True, timeout=60)
    r = run("pack", tmp_path / "m", "-o", tmp_path / "p")
    assert r.returncode == 0 and "packed" in r.stdout, r.stderr
    r = run("pack", "--unpack", tmp_path / "p", "-o", tmp_path / "back.safetensors")
    assert r.returncode == 0, r.stderr
    ref = {}
    for f in os.listdir(tmp_path / "m"):
        if f.endswith(".safetensors"):
            ref.update(load_file(str(tmp_path / "m" / f)))
    assert_same(load_file(str(tmp_path / "back.safetensors")), ref)
    r = run("pack", tmp_path / "m" / "config.json", "-o", tmp_path / "q")
    assert r.returncode == 1 and r.stderr.startswith("p2pw: error:") and "no safetensors tensors" in r.stderr
