"""The seeder's read-ahead on real files: every chunk read once however requests overlap, requests queued
together read as one batch, several readers for a source that reads in parallel, nothing unverified marked
good."""
import threading

import numpy as np

from p2pweights.sources.chunker import build
from p2pweights.sources.source import BlobSource, ReadAhead
from p2pweights.storage.store import Store

CHUNK = 64 << 10


def checkpoint(tmp_path, size=40 * CHUNK + 1000):
    (tmp_path / "ckpt").mkdir()
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "ckpt" / "w.bin").write_bytes(data)
    manifest, _, _ = build(tmp_path / "ckpt", chunk_size=CHUNK)
    blob = bytearray(manifest.total_size)
    BlobSource(tmp_path / "ckpt", manifest.files).read_into(0, memoryview(blob))
    assert data in blob
    return tmp_path / "ckpt", manifest, bytes(blob)


class Counting(BlobSource):
    """A file source that says it reads in parallel (as an object store's does) and counts what it reads."""

    concurrency = 4
    ahead = 3

    def __init__(self, *a, corrupt=(), **kw):
        super().__init__(*a, **kw)
        self.calls, self.read, self.corrupt, self.lock = [], [], set(corrupt), threading.Lock()

    def read_chunks(self, manifest, indices, view_of, digest, span_of=None):
        with self.lock:
            self.calls.append(list(indices))
            self.read.extend(indices)
        for i, ok in super().read_chunks(manifest, indices, view_of, digest):
            if i in self.corrupt:
                view_of(i)[0] ^= 0xFF
                ok = digest(view_of(i)) == manifest.chunks[i]
            yield i, ok


def run(source, manifest, wants, expect=None):
    """Ask for ``wants``, wait until ``expect`` chunks (every chunk) are reported, stop; (store, reports, reader)."""
    store = Store(manifest)
    ready, done, cond = {}, threading.Event(), threading.Condition()
    expect = manifest.n_chunks if expect is None else expect

    def on_ready(i, ok):
        with cond:
            ready.setdefault(i, []).append(ok)
            cond.notify_all()

    reader = ReadAhead(source, store, on_ready, on_exit=done.set)
    for i in wants:
        reader.want(i)
    with cond:
        assert cond.wait_for(lambda: sum(map(len, ready.values())) >= expect, 30)
    reader.stop()
    assert done.wait(30)
    for t in reader.threads:
        t.join(5)
    return store, ready, reader


def test_every_chunk_read_once_and_verified(tmp_path):
    root, m, data = checkpoint(tmp_path)
    source = Counting(root, m.files)
    wants = [i for k in range(3) for i in range(k, m.n_chunks, 2)]  # overlapping, scattered, repeated
    store, ready, reader = run(source, m, wants)
    assert len(reader.threads) == ReadAhead.READERS
    assert sorted(source.read) == list(range(m.n_chunks))  # no chunk twice, between both readers
    assert all(v == [True] for v in ready.values()) and len(ready) == m.n_chunks
    for i in range(m.n_chunks):
        lo, hi = m.chunk_span(i)
        assert bytes(store.chunk(i)) == data[lo:hi]


def test_requests_queued_together_are_one_batch(tmp_path):
    root, m, _ = checkpoint(tmp_path)
    source = Counting(root, m.files)
    store = Store(m)
    reader = ReadAhead.__new__(ReadAhead)  # only the claim rule: no threads
    reader.store, reader.ahead = store, source.ahead
    reader.done, reader.lock = bytearray(m.n_chunks), threading.Lock()
    assert reader.batch([10, 0]) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert reader.batch([2, 12, 39]) == [4, 5, 14, 15, 39, 40]  # what earlier batches claimed is left out
    assert reader.batch([40]) == []


def test_stop_leaves_what_is_still_asked_for(tmp_path):
    root, m, _ = checkpoint(tmp_path)
    source = Counting(root, m.files)
    store = Store(m)
    done = threading.Event()
    reader = ReadAhead(source, store, lambda i, ok: None, on_exit=done.set)
    reader.stop()
    for i in range(m.n_chunks):
        reader.want(i)  # after the stop: never read
    assert done.wait(30)
    assert source.read == [] and store.count == 0


def test_a_source_read_in_order_keeps_one_reader(tmp_path):
    root, m, _ = checkpoint(tmp_path)
    source = BlobSource(root, m.files)
    _, ready, reader = run(source, m, range(m.n_chunks))
    assert len(reader.threads) == 1
    assert len(ready) == m.n_chunks and all(v == [True] for v in ready.values())


def test_a_chunk_that_does_not_match_is_reported_bad(tmp_path):
    root, m, _ = checkpoint(tmp_path)
    source = Counting(root, m.files, corrupt={5})
    _, ready, _ = run(source, m, [0, 4], expect=8)  # chunks 0-7: each request and the 3 after it
    assert ready[5] == [False]
    assert all(v == [True] for i, v in ready.items() if i != 5)
