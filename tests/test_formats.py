"""formats: safetensors headers and the blob layout agree with the safetensors library and the bytes on disk."""
import json
import os
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from p2pweights.sources.formats import ALIGN, FormatError, checkpoint_files, layout, read_safetensors_header, scan
from p2pweights.sources.synth import write_safetensors


def numpy_tensors():
    rng = np.random.default_rng(1)
    return {
        "mask": rng.integers(0, 2, (3, 5)).astype(bool),
        "codes": rng.integers(-128, 127, (7,), dtype=np.int8),
        "half": rng.standard_normal((4, 3)).astype(np.float16),
        "single": rng.standard_normal((2, 2, 2)).astype(np.float32),
        "ids": np.arange(5, dtype=np.int64),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def check_against_file(path, tensors, arrays):
    raw = open(path, "rb").read()
    assert {t["name"] for t in tensors} == set(arrays)
    for t in tensors:
        a = arrays[t["name"]]
        assert tuple(t["shape"]) == a.shape
        assert t["nbytes"] == a.nbytes
        assert raw[t["offset"]:t["offset"] + t["nbytes"]] == a.tobytes()


def test_header_matches_safetensors_numpy(tmp_path):
    path = tmp_path / "m.safetensors"
    arrays = numpy_tensors()
    save_file(arrays, str(path), metadata={"format": "np"})
    tensors, data_start = read_safetensors_header(path)
    (header_len,) = struct.unpack("<Q", open(path, "rb").read(8))
    assert data_start == 8 + header_len
    assert [t["offset"] for t in tensors] == sorted(t["offset"] for t in tensors)
    assert {t["name"]: t["dtype"] for t in tensors}["mask"] == "BOOL"
    assert {t["name"]: t["dtype"] for t in tensors}["codes"] == "I8"
    assert {t["name"]: t["dtype"] for t in tensors}["half"] == "F16"
    with safe_open(str(path), framework="numpy") as f:
        check_against_file(path, tensors, {k: f.get_tensor(k) for k in f.keys()})


def test_header_matches_safetensors_torch_bf16_f8(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch
    g = torch.Generator().manual_seed(0)
    ts = {
        "bf": torch.randn(6, 5, generator=g).to(torch.bfloat16),
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(2, 3, generator=g).to(torch.float8_e5m2),
        "b": torch.tensor([True, False, True]),
        "i8": torch.tensor([-1, 2, 3], dtype=torch.int8),
        "h": torch.randn(3, 3, generator=g).to(torch.float16),
    }
    path = tmp_path / "t.safetensors"
    save_torch(ts, str(path))
    tensors, _ = read_safetensors_header(path)
    dtypes = {t["name"]: t["dtype"] for t in tensors}
    assert dtypes == {"bf": "BF16", "f8": "F8_E4M3", "f8b": "F8_E5M2", "b": "BOOL", "i8": "I8", "h": "F16"}
    raw = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        for t in tensors:
            x = f.get_tensor(t["name"])
            assert list(x.shape) == t["shape"]
            assert raw[t["offset"]:t["offset"] + t["nbytes"]] == x.contiguous().view(torch.uint8).numpy().tobytes()


def test_write_safetensors_roundtrip(tmp_path):
    arrays = numpy_tensors()
    path = tmp_path / "w.safetensors"
    write_safetensors(path, [(k, {"bool": "BOOL", "int8": "I8", "float16": "F16", "float32": "F32",
                                   "int64": "I64"}[str(a.dtype)], a.shape, a) for k, a in arrays.items()],
                      metadata={"format": "pt"})
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        for k, a in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(k), a)
    check_against_file(path, read_safetensors_header(path)[0], arrays)


def test_write_safetensors_rejects_wrong_size(tmp_path):
    with pytest.raises(ValueError, match="needs 8"):
        write_safetensors(tmp_path / "x.safetensors", [("w", "F32", (2,), b"\0" * 7)])


def read_blob(files, root, total):
    blob = bytearray(total)
    for f in files:
        data = (root / f["name"]).read_bytes() if root.is_dir() else root.read_bytes()
        assert len(data) == f["size"]
        blob[f["offset"]:f["offset"] + f["size"]] = data
    return bytes(blob)


def test_layout_directory(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".p2pw").mkdir()
    (root / ".p2pw" / "cache.bin").write_bytes(b"x" * 100)
    (root / "sub" / ".hidden").write_bytes(b"h")
    (root / "config.json").write_text('{"a": 1}')
    (root / "empty.txt").write_bytes(b"")
    (root / "sub" / "deeper" / "note.txt").write_bytes(b"n" * 5000)
    a = {"x": np.arange(1000, dtype=np.float32), "y": np.ones((3, 3), dtype=np.int8)}
    b = {"z": np.arange(7, dtype=np.int16).reshape(7, 1)}
    save_file(a, str(root / "sub" / "a.safetensors"))
    save_file(b, str(root / "b.safetensors"))

    names = [n for n, _, _ in checkpoint_files(root)]
    assert names == sorted(names) == ["b.safetensors", "config.json", "empty.txt",
                                      "sub/.hidden", "sub/a.safetensors", "sub/deeper/note.txt"]
    files, tensors, total = layout(root)
    # small non-tensor files first (final within the first chunks of a copy), then the tensor files
    assert [f["name"] for f in files] == ["config.json", "empty.txt", "sub/.hidden", "sub/deeper/note.txt",
                                          "b.safetensors", "sub/a.safetensors"]
    assert all(f["offset"] % ALIGN == 0 for f in files)
    assert files[1]["size"] == 0
    for prev, cur in zip(files, files[1:]):
        assert cur["offset"] >= prev["offset"] + prev["size"]
        assert cur["offset"] - (prev["offset"] + prev["size"]) < ALIGN
    assert total == files[-1]["offset"] + files[-1]["size"]
    assert {t["name"]: t["file"] for t in tensors} == {"x": "sub/a.safetensors", "y": "sub/a.safetensors",
                                                      "z": "b.safetensors"}
    blob = read_blob(files, root, total)
    arrays = {**a, **b}
    for t in tensors:
        assert blob[t["offset"]:t["offset"] + t["nbytes"]] == arrays[t["name"]].tobytes()
    # padding between files is zero bytes
    end0 = files[0]["offset"] + files[0]["size"]
    assert blob[end0:files[1]["offset"]] == b"\0" * (files[1]["offset"] - end0)


def test_layout_single_file(tmp_path):
    path = tmp_path / "one.safetensors"
    arrays = numpy_tensors()
    save_file(arrays, str(path))
    files, tensors, total = layout(path)
    assert files == [{"name": "one.safetensors", "offset": 0, "size": path.stat().st_size}]
    assert total == path.stat().st_size
    assert all(t["file"] == "one.safetensors" for t in tensors)
    check_against_file(path, tensors, arrays)


def test_layout_many_files(tmp_path):
    for i in range(2000):
        (tmp_path / f"f{i:05d}.bin").write_bytes(b"a" * (1 + i % 7))
    files, tensors, total = layout(tmp_path)
    assert len(files) == 2000 and tensors == []
    assert files[-1]["offset"] == 1999 * ALIGN


def test_duplicate_tensor_across_shards(tmp_path):
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "a.safetensors"))
    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(FormatError, match=r"b\.safetensors.*'w'.*a\.safetensors"):
        layout(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(FormatError, match="nope"):
        layout(tmp_path / "nope")


def test_empty_directory(tmp_path):
    (tmp_path / "d" / ".cache" / "huggingface").mkdir(parents=True)
    (tmp_path / "d" / ".cache" / "huggingface" / "x").write_bytes(b"x")
    with pytest.raises(FormatError, match=r"d: directory holds no"):
        checkpoint_files(tmp_path / "d")


def test_unreadable_file(tmp_path, monkeypatch):
    p = tmp_path / "secret.bin"
    p.write_bytes(b"x")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).endswith("secret.bin")
                        and real_access(path, mode))
    with pytest.raises(FormatError, match="secret.bin: not readable"):
        checkpoint_files(tmp_path)
    with pytest.raises(FormatError, match="secret.bin: not readable"):
        checkpoint_files(p)


def good_file(tmp_path):
    path = tmp_path / "good.safetensors"
    save_file({"w": np.arange(64, dtype=np.float32)}, str(path))
    return path, path.read_bytes()


@pytest.mark.parametrize("cut", ["length", "header", "data"])
def test_truncated(tmp_path, cut):
    path, raw = good_file(tmp_path)
    header_len = struct.unpack("<Q", raw[:8])[0]
    n = {"length": 5, "header": 8 + header_len // 2, "data": len(raw) - 10}[cut]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:n])
    with pytest.raises(FormatError, match="bad.safetensors"):
        read_safetensors_header(bad)
    with pytest.raises(FormatError, match="bad.safetensors"):
        layout(tmp_path)


def write_raw_header(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("header,data,msg", [
    (b"\xff\xfe not json", b"", "not valid JSON"),
    (b"[1, 2]", b"", "expected an object"),
    (json.dumps({"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4, "unknown dtype"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(), b"\0" * 4, "needs 8"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(), b"\0" * 4, "outside"),
    (json.dumps({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}).encode(), b"", "shape"),
    (json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}).encode(), b"\0" * 4, "data_offsets"),
    (json.dumps({"w": [1]}).encode(), b"", "not an object"),
])
def test_garbage_header(tmp_path, header, data, msg):
    path = tmp_path / "junk.safetensors"
    write_raw_header(path, header, data)
    with pytest.raises(FormatError, match=rf"junk\.safetensors.*{msg}"):
        read_safetensors_header(path)


def test_huge_header_length(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(FormatError, match="huge.safetensors.*header length"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(FormatError, match="past the end"):
        read_safetensors_header(path)


def test_metadata_skipped(tmp_path):
    path = tmp_path / "m.safetensors"
    write_raw_header(path, json.dumps({"__metadata__": {"format": "pt"},
                                       "w": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}).encode(), b"abc")
    tensors, start = read_safetensors_header(path)
    assert [t["name"] for t in tensors] == ["w"]
    assert path.read_bytes()[tensors[0]["offset"]:][:3] == b"abc"


def test_every_file_dot_files_included_and_default_skips_listed(tmp_path):
    """A Hugging Face local_dir is copied whole (.gitattributes too); .git/, .p2pw/, .cache/huggingface/ are not."""
    root = tmp_path / "m"
    for d in (".git/objects", ".p2pw", ".cache/huggingface/download", ".cache/other", "sub/.git"):
        (root / d).mkdir(parents=True)
    for f in (".gitattributes", ".git/HEAD", ".git/objects/x", ".p2pw/complete.json",
              ".cache/huggingface/download/a.lock", ".cache/other/keep.txt", "sub/.git/y", "sub/.env", "w.bin"):
        (root / f).write_bytes(b"x" * 10)
    w = scan(root)
    assert [n for n, _, _ in w.files] == [".cache/other/keep.txt", ".gitattributes", "sub/.env", "w.bin"]
    assert sorted(w.skipped) == [".cache/huggingface/", ".git/", ".p2pw/", "sub/.git/"]


def test_exclude_globs(tmp_path):
    root = tmp_path / "m"
    (root / "original").mkdir(parents=True)
    (root / "sub").mkdir()
    for f in ("original/consolidated.pth", "sub/a.bin", "b.bin", "keep.json", "sub/.DS_Store"):
        (root / f).write_bytes(b"x")
    w = scan(root, exclude=["original/", "*.bin", ".DS_Store"])
    assert [n for n, _, _ in w.files] == ["keep.json"]
    assert sorted(w.skipped) == ["b.bin", "original/", "sub/.DS_Store", "sub/a.bin"]
    assert [f["name"] for f in layout(root, exclude=["*.json"])[0]] == [
        "b.bin", "original/consolidated.pth", "sub/.DS_Store", "sub/a.bin"]
    assert [n for n, _, _ in checkpoint_files(root, exclude=["original", "sub"])] == ["b.bin", "keep.json"]


def test_special_files_and_bad_symlinks_are_one_error_naming_them(tmp_path):
    import socket

    root = tmp_path / "m"
    (root / "sub").mkdir(parents=True)
    (root / "w.bin").write_bytes(b"x")
    (tmp_path / "outside.bin").write_bytes(b"o")
    os.mkfifo(root / "pipe")
    os.symlink(tmp_path / "outside.bin", root / "escape")
    os.symlink(root / "loop_b", root / "loop_a")
    os.symlink(root / "loop_a", root / "loop_b")
    os.symlink("..", root / "sub" / "up")  # a directory link back to an ancestor: the walk would never end
    os.symlink("w.bin", root / "inside")  # a link to a file inside the tree is copied as that file
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock"))
    try:
        with pytest.raises(FormatError) as e:
            scan(root)
    finally:
        sock.close()
    msg = str(e.value)
    assert "\n" not in msg and "cannot copy 6 entries" in msg, msg
    for part in ("pipe (fifo)", "sock (socket)", "escape (symlink leaving the tree", "loop_a (symlink that loops",
                 "loop_b (symlink that loops", "sub/up (symlink that loops"):
        assert part in msg, msg
    os.remove(root / "pipe"), os.remove(root / "sock"), os.remove(root / "escape"), os.remove(root / "loop_a")
    os.remove(root / "loop_b"), os.remove(root / "sub" / "up")
    assert [(n, s) for n, _, s in checkpoint_files(root)] == [("inside", 1), ("w.bin", 1)]


def test_hugging_face_snapshot_links_into_its_blobs(tmp_path):
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "blobs" / "1234").write_bytes(b"{}")
    os.symlink("../../blobs/1234", repo / "snapshots" / "abc" / "config.json")
    assert [(n, s) for n, _, s in checkpoint_files(repo / "snapshots" / "abc")] == [("config.json", 2)]
