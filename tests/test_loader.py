"""Loader: tensors stream into a device buffer over real sockets and are waited for by name (CPU here)."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import p2pweights
from p2pweights.storage.device import TensorNotFound
from p2pweights.sources.pack import pack
from p2pweights.sources.synth import write_safetensors, write_synthetic_model

from test_pack import assert_same, mixed_tensors

CHUNK = 64 << 10


def reference(path) -> dict:
    if os.path.isfile(path):
        return load_file(str(path))
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.fixture
def seeders():
    started = []

    def start(path, **kw):
        s = p2pweights.seed(path, port=0, host="127.0.0.1", chunk_size=CHUNK, **kw)
        started.append(s)
        return s
    yield start
    for s in started:
        s.close()


@pytest.fixture
def downloads():
    started = []

    def start(port, **kw):
        dl = p2pweights.join(f"127.0.0.1:{port}", host="127.0.0.1", connect_timeout=20, **kw)
        started.append(dl)
        return dl
    yield start
    for dl in started:
        dl.close()


def unaligned_model(path):
    """A file whose F32 and F16 tensors start at odd offsets (a 3-byte bool tensor comes first)."""
    t = {"a.mask": torch.tensor([True, False, True]), "b.f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
         "c.bf16": torch.arange(5, dtype=torch.bfloat16), "d.i8": torch.arange(4, dtype=torch.int8)}
    write_safetensors(path, [("a.mask", "BOOL", [3], t["a.mask"].numpy()),
                             ("b.f32", "F32", [2, 3], t["b.f32"].numpy()),
                             ("c.bf16", "BF16", [5], t["c.bf16"].view(torch.int16).numpy()),
                             ("d.i8", "I8", [4], t["d.i8"].numpy())])
    return t


@pytest.mark.parametrize("kind", ["sharded", "packed", "dtypes", "dtypes-packed", "unaligned"])
def test_state_dict_equals_safetensors(tmp_path, seeders, downloads, kind):
    if kind in ("sharded", "packed"):
        src = tmp_path / "m"
        write_synthetic_model(src, size_mb=3, shards=3)
    elif kind.startswith("dtypes"):
        src = tmp_path / "m.safetensors"
        save_file(mixed_tensors(), str(src))
    else:
        src = tmp_path / "u.safetensors"
        unaligned_model(src)
    want = reference(src)
    path = src
    if kind.endswith("packed"):
        path = tmp_path / "p"
        pack(src, path)
    s = seeders(path)
    dl = downloads(s.port, device="cpu")
    sd = dl.state_dict(timeout=60)
    assert_same(sd, want)
    report = dl.stage_report()
    base = dl.loader.sink.buffer.untyped_storage().data_ptr()
    views = [t for t in sd.values() if t.untyped_storage().data_ptr() == base]
    if kind == "unaligned":
        assert report["unaligned_copies"] == 2 and report["copied_bytes"] == 24 + 10
        assert len(views) == 2
    else:
        assert report["unaligned_copies"] == 0
        assert len(views) == len(sd)  # every tensor is a view of the one buffer, no copy
    assert report["fetch"]["seconds"] > 0 and report["last_tensor_usable_s"] >= report["first_tensor_usable_s"]


def test_throttled_seeder_first_layer_usable_before_the_rest(tmp_path, procs, downloads):
    write_synthetic_model(tmp_path / "m", size_mb=6, shards=2)
    pack(tmp_path / "m", tmp_path / "p")
    _, info = procs.seeder(tmp_path / "p", "--chunk-size", CHUNK, env={"P2PW_FAULTS": "delay_send=20"})
    dl = downloads(info["port"], device="cpu", window=2)
    name = "model.layers.0.self_attn.q_proj.weight"
    t = next(x for x in dl.manifest.tensors if x["name"] == name)
    chunks = dl.manifest.chunks_covering(t["offset"], t["offset"] + t["nbytes"])
    assert chunks.stop < dl.manifest.n_chunks - 20  # precondition: most of the blob comes after layer 0

    with pytest.raises(TimeoutError, match=r"tensor 'lm_head.weight' .* not on cpu after 0.05 s: \d+ of \d+ bytes"):
        dl.wait_tensor("lm_head.weight", timeout=0.05)
    with pytest.raises(TensorNotFound, match=r"no tensor 'model.layers.0.q_proj' .* did you mean"):
        dl.wait_tensor("model.layers.0.q_proj")

    first_name, _ = next(dl.iter_tensors(timeout=30))
    assert first_name == "model.embed_tokens.weight"
    q = dl.wait_tensor(name, timeout=30)
    assert all(dl.store.have[chunks.start:chunks.stop])
    assert not dl.store.have[-1] and not dl.store.complete  # later chunks still missing
    assert q.dtype == torch.bfloat16 and list(q.shape) == t["shape"]
    assert_same({name: q}, {name: reference(tmp_path / "m")[name]})


def test_errors_without_device_and_for_a_bad_device(tmp_path, seeders, downloads):
    write_synthetic_model(tmp_path / "m", size_mb=1, shards=1)
    s = seeders(tmp_path / "m")
    dl = downloads(s.port)
    with pytest.raises(p2pweights.P2PError, match="tensors need a device"):
        dl.wait_tensor("lm_head.weight")
    with pytest.raises(p2pweights.P2PError, match="not supported"):
        downloads(s.port, device="tpu")


def test_cpu_loading_peer_still_forwards(tmp_path, seeders, downloads):
    write_synthetic_model(tmp_path / "m", size_mb=3, shards=2)
    s = seeders(tmp_path / "m", topology="chain")
    a = downloads(s.port, device="cpu")
    b = downloads(s.port, device="cpu", out=str(tmp_path / "b"))
    assert [p["rank"] for p in b.parents] == [a.rank]
    b.wait(timeout=60)
    assert a.stats.bytes_sent > 0
    assert_same(b.state_dict(), reference(tmp_path / "m"))
    assert_same(a.state_dict(timeout=60), reference(tmp_path / "m"))
    assert sorted(os.listdir(tmp_path / "b")) == sorted(os.listdir(tmp_path / "m") + [".p2pw"])  # + the marker


def test_cli_join_device_prints_stage_report(tmp_path, procs):
    write_synthetic_model(tmp_path / "m", size_mb=2, shards=1)
    _, info = procs.seeder(tmp_path / "m")
    j = procs.join(info["port"], tmp_path / "out", "--device", "cpu")
    assert j.wait(60) == 0, j.output()
    for line in ("load to cpu", "fetch", "verify", "stage_host", "h2d", "first tensor usable",
                 "last tensor usable"):
        assert line in j.output()


def test_seed_and_relay_modules_do_not_import_torch():
    code = "import p2pweights.cli, p2pweights.api, p2pweights.swarm.node.node, p2pweights.sources.pack, sys; " \
           "assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_join_to_disk_does_not_import_numpy(tmp_path, procs):
    """numpy was half of a joiner's start-up CPU, paid by every host of a broadcast at the same moment:
    the CLI join path (scheduler, store, protocol, copy to disk) runs without it; dataclasses (with
    inspect, and each decorated class) was a sixth of what is left, and the other commands' parsers
    a tenth; shutil (with bz2 and lzma), tempfile and socket's enum classes, 5-9 ms more at sixteen
    joins at once; OpenSSL (hashlib, for one SHA-256 of the manifest) and the idna codec (getaddrinfo given
    a str host, in the uplink probe), 6 ms of imports."""
    write_synthetic_model(tmp_path / "m", size_mb=2, shards=1)
    _, info = procs.seeder(tmp_path / "m")
    code = ("import sys; from p2pweights.cli import main; "
            f"rc = main(['join', '--parent', '127.0.0.1:{info['port']}', '--out', sys.argv[1], '-q']); "
            "assert 'numpy' not in sys.modules, 'numpy imported'; "
            "assert 'dataclasses' not in sys.modules, 'dataclasses imported'; "
            "assert not {'shutil', 'tempfile', 'socket'} & set(sys.modules), 'shutil, tempfile or socket'; "
            "assert not {'_hashlib', 'encodings.idna'} & set(sys.modules), 'OpenSSL or the idna codec'; "
            "sys.exit(rc)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], check=True, timeout=60)
    for name in os.listdir(tmp_path / "m"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "m" / name).read_bytes()
