"""Manifest: round trip, model id stability, chunk boundaries."""
import json
import os

import pytest

from p2pweights.sources.chunker import build
from p2pweights.sources.manifest import Manifest, ManifestError, default_chunk_size, file_segments
from p2pweights.sources.source import BlobSource, verify_copy

CHUNK = 64 << 10


def blob_of(path, m: Manifest) -> bytes:
    src = BlobSource(path, m.files)
    out = bytearray(m.total_size)
    src.read_into(0, memoryview(out))
    return bytes(out)


def test_round_trip_and_stable_id(model_dir):
    m, read, _ = build(model_dir, CHUNK)
    again = Manifest.from_json(m.to_json())
    assert again.model_id == m.model_id
    assert again.to_json() == m.to_json()
    m2, _, _ = build(model_dir, CHUNK)
    assert m2.model_id == m.model_id, "same bytes must give the same model id"
    m3, _, _ = build(model_dir, 2 * CHUNK)
    assert m3.model_id != m.model_id
    assert read == sum(f["size"] for f in m.files)
    assert {t["name"] for t in m.tensors} >= {"model.embed_tokens.weight", "lm_head.weight"}


def test_id_changes_with_one_byte(tmp_path):
    p = tmp_path / "w.bin"
    p.write_bytes(b"a" * 100_000)
    a, _, _ = build(p, CHUNK)
    p.write_bytes(b"a" * 99_999 + b"b")
    b, _, _ = build(p, CHUNK)
    assert a.model_id != b.model_id
    assert a.chunks[0] == b.chunks[0] and a.chunks[1] != b.chunks[1]


def test_tampered_manifest_fails_its_own_hash(model_dir):
    m, _, _ = build(model_dir, CHUNK)
    doc = json.loads(m.to_json())
    doc["chunks"][0] = "0" * 16
    with pytest.raises(ManifestError, match="fails its own hash"):
        Manifest.from_json(json.dumps(doc))
    with pytest.raises(ManifestError, match="model id mismatch"):
        Manifest.from_json(m.to_json(), expect_id="deadbeef")
    assert Manifest.from_json(m.to_json(), expect_id=m.model_id[:12]).model_id == m.model_id
    for bad in ["{", "[]", json.dumps({"version": 99})]:
        with pytest.raises(ManifestError):
            Manifest.from_json(bad)


def test_chunk_boundaries_dir_with_empty_and_large_files(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    big = os.urandom(5 * CHUNK + 123)  # several chunks, not a multiple of the chunk size
    (d / "a_big.bin").write_bytes(big)
    (d / "b_empty.txt").write_bytes(b"")
    (d / "sub" / "c_small.json").write_bytes(b'{"x": 1}')
    m, read, _ = build(d, CHUNK)
    names = [f["name"] for f in m.files]
    assert names == ["a_big.bin", "b_empty.txt", "sub/c_small.json"]
    assert all(f["offset"] % 4096 == 0 for f in m.files)
    assert m.total_size == m.files[-1]["offset"] + 8
    assert m.n_chunks == -(-m.total_size // CHUNK)
    assert m.chunk_span(m.n_chunks - 1)[1] == m.total_size
    blob = blob_of(d, m)
    assert blob[: len(big)] == big and blob[m.files[2]["offset"]:] == b'{"x": 1}'
    assert read == len(big) + 8
    segs = list(file_segments(m.files, *m.chunk_span(5)))
    assert [s[0]["name"] for s in segs] == ["a_big.bin", "sub/c_small.json"]
    assert list(m.chunks_covering(CHUNK - 1, CHUNK + 1)) == [0, 1]
    assert list(m.chunks_covering(0, 0)) == []


def test_single_file_smaller_than_a_chunk(tmp_path):
    p = tmp_path / "tiny.bin"
    p.write_bytes(b"xyz")
    m, _, _ = build(p, CHUNK)
    assert m.n_chunks == 1 and m.total_size == 3 and m.files == [{"name": "tiny.bin", "offset": 0, "size": 3}]


def test_verify_names_first_bad_chunk(tmp_path, model_dir):
    import shutil

    m, _, _ = build(model_dir, CHUNK)
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert verify_copy(copy, m) == (m.n_chunks, None)
    victim = m.files[-2]
    with open(copy / victim["name"], "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    index, problem = verify_copy(copy, m)
    assert index == (victim["offset"] + 100) // CHUNK
    assert f"chunk {index}" in problem and victim["name"] in problem


def test_bad_chunk_size(tmp_path):
    p = tmp_path / "w.bin"
    p.write_bytes(b"x")
    with pytest.raises(ManifestError, match="multiple of 4096"):
        build(p, 1000)


def test_default_chunk_size_keeps_small_checkpoints_at_512_chunks_or_more():
    MiB = 1 << 20
    assert default_chunk_size(140 << 30) == 4 * MiB
    assert default_chunk_size(2048 * MiB) == 4 * MiB         # 512 chunks of 4 MiB
    assert default_chunk_size(2040 * MiB) == 2 * MiB         # 510 chunks of 4 MiB
    assert default_chunk_size(1024 * MiB) == 2 * MiB         # 512 chunks of 2 MiB
    assert default_chunk_size(268211885) == MiB // 2         # the 256 MiB bench checkpoint: 512 chunks
    assert default_chunk_size(100 * MiB) == MiB // 2         # never below 512 KiB
    assert default_chunk_size(3) == MiB // 2


def test_build_without_a_chunk_size_takes_the_default_for_its_size(tmp_path):
    p = tmp_path / "w.bin"
    p.write_bytes(os.urandom(3 << 20))
    m, _, _ = build(p)
    assert m.chunk_size == 512 << 10 and m.n_chunks == 6
