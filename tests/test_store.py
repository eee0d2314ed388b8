"""Store backings on real files: one mapping of the blob over its files, the copy's files finalised one by one,
the completion marker, restarts, the seeder's read-only source mapping, the temporary file over the budget."""
import json
import mmap
import os
import time

import numpy as np
import pytest

from p2pweights.storage.cache import CacheError, DiskCache
from p2pweights.sources.chunker import build
from p2pweights.sources.source import BlobSource
from p2pweights.storage.store import FileMap, SourceStore, Store, blob_backing

CHUNK = 64 << 10


def checkpoint(root, sizes: dict, seed=0):
    """Files of random bytes under ``root``: name -> size."""
    rng = np.random.default_rng(seed)
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return root


def blob(path, m) -> bytes:
    out = bytearray(m.total_size)
    BlobSource(path, m.files).read_into(0, memoryview(out))
    return bytes(out)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.fixture
def src(tmp_path):
    # sizes that are not page multiples leave padding between files; blob order is by name here
    return checkpoint(tmp_path / "src", {"a.json": 300, "b.json": 5000, "c.bin": 200_001,
                                         "sub/d.bin": 150_000, "sub/empty.txt": 0})


def fill(store, data: bytes, indices):
    """Land chunks as the node does: into store.chunk(i) (memory) or through store.write (files), then
    verified(i)."""
    for i in indices:
        lo, hi = store.manifest.chunk_span(i)
        if store.in_place:
            store.chunk(i)[:] = data[lo:hi]
        else:
            store.write(i, memoryview(data)[lo:hi])
        store.verified(i)


def test_file_map_is_the_blob_over_the_files(src):
    m, _, _ = build(src, CHUNK)
    fds = [(os.open(src / f["name"], os.O_RDONLY), f["offset"], f["size"]) for f in m.files]
    fm = FileMap(m.total_size, fds, writable=False)
    for fd, _, _ in fds:
        os.close(fd)
    assert bytes(memoryview(fm.buffer)[: m.total_size]) == blob(src, m)  # padding reads as zeros


@pytest.mark.parametrize("through", ["write", "mapping"])
def test_copy_files_final_one_by_one_then_the_marker(src, tmp_path, through):
    m, _, _ = build(src, CHUNK)
    data = blob(src, m)
    out = tmp_path / "out"
    cache = DiskCache(m, out)  # writeback started as chunks verify
    # the node writes verified chunks into the files (pwrite); bytes put into the mapping land there too
    store = Store(m, cache.filemap.buffer, files=cache if through == "write" else None)
    store.sinks.append(cache)
    # preallocated under .partial names, blocks allocated; the empty file is final at once
    for f in m.files:
        if f["size"]:
            p = out / (f["name"] + ".partial")
            assert p.stat().st_size == f["size"] and p.stat().st_blocks * 512 >= f["size"]
    assert [f["name"] for f in m.files] == ["a.json", "b.json", "c.bin", "sub/d.bin", "sub/empty.txt"]
    first = m.chunks_covering(0, m.files[1]["offset"] + m.files[1]["size"])  # a.json, b.json
    fill(store, data, first)
    deadline = time.monotonic() + 10
    while not (out / "b.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (out / "a.json").read_bytes() == (src / "a.json").read_bytes()
    assert (out / "b.json").read_bytes() == (src / "b.json").read_bytes()
    assert (out / "sub/empty.txt").read_bytes() == b""
    assert (out / "c.bin.partial").exists() and not (out / "c.bin").exists()
    assert not (out / ".p2pw" / "complete.json").exists()
    fill(store, data, [i for i in range(m.n_chunks) if i not in first])
    assert cache.wait(10)
    for f in m.files:
        assert (out / f["name"]).read_bytes() == (src / f["name"]).read_bytes()
    assert not list(out.rglob("*.partial"))
    marker = json.loads((out / ".p2pw" / "complete.json").read_text())
    assert marker["model_id"] == m.model_id and marker["bytes"] == sum(f["size"] for f in m.files)
    assert [f["name"] for f in marker["files"]] == [f["name"] for f in m.files]
    assert not (out / ".p2pw" / "progress.json").exists()
    cache.close()
    store.close()


def complete_copy(src, out):
    m, _, _ = build(src, CHUNK)
    cache = DiskCache(m, out)
    store = Store(m, cache.filemap.buffer)
    store.sinks.append(cache)
    fill(store, blob(src, m), range(m.n_chunks))
    assert cache.wait(10)
    cache.close()
    store.close()
    return m


def test_restart_trusts_a_matching_marker_and_verify_full_rehashes(src, tmp_path):
    out = tmp_path / "out"
    m = complete_copy(src, out)
    # change one byte behind p2pw's back, keeping size and mtime: only a re-hash can notice
    victim = out / "c.bin"
    st = victim.stat()
    with open(victim, "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    quick = DiskCache(m, out)  # the marker matches: complete at once, nothing hashed, nothing re-created
    assert quick.complete and quick.finished.is_set()
    assert (out / ".p2pw" / "complete.json").exists()
    store = Store(m, quick.filemap.buffer)
    assert quick.recover(store) == list(range(m.n_chunks))
    store.close()
    full = DiskCache(m, out, verify="full")  # re-hash: the changed chunk is found; the marker is gone
    assert not full.complete and not (out / ".p2pw" / "complete.json").exists()
    store = Store(m, full.filemap.buffer)
    found = full.recover(store)
    bad = m.chunks_covering(m.files[2]["offset"] + 1000, m.files[2]["offset"] + 1003)
    assert m.files[2]["name"] == "c.bin"
    assert sorted(set(range(m.n_chunks)) - set(found)) == list(bad)
    # the file that no longer matches is not left under its final name
    assert (out / "c.bin.partial").exists() and not (out / "c.bin").exists()
    full.close()
    store.close()


def test_changed_mtime_removes_the_marker_and_rehashes(src, tmp_path):
    out = tmp_path / "out"
    m = complete_copy(src, out)
    os.utime(out / "a.json", ns=(1, 1))
    again = DiskCache(m, out)
    assert not again.complete and again.resuming
    assert not (out / ".p2pw" / "complete.json").exists()
    store = Store(m, again.filemap.buffer)
    assert again.recover(store) == list(range(m.n_chunks))
    again.close()
    store.close()


def test_manifest_names_inside_the_state_dir_are_refused(src, tmp_path):
    m, _, _ = build(src, CHUNK)
    m.files[0] = dict(m.files[0], name=".p2pw/complete.json")
    with pytest.raises(CacheError, match=r"inside \.p2pw/"):
        DiskCache(m, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_seeder_serves_its_mapped_source_and_counts_what_storage_reads_again(tmp_path):
    from p2pweights.api import join, seed
    from p2pweights.sources.source import storage_read_bytes

    src = checkpoint(tmp_path / "src", {"w.bin": 4 << 20, "x.json": 100})
    size = (4 << 20) + 100
    with seed(src, port=0, host="127.0.0.1", chunk_size=CHUNK) as s:
        assert isinstance(s.store, SourceStore)
        assert s.bytes_read == size  # the scan read each byte once
        with join(f"127.0.0.1:{s.port}", host="127.0.0.1") as d:
            d.wait(60)
            assert bytes(d.store.view[: d.manifest.total_size]) == blob(src, d.manifest)
        # served from the page cache the scan filled: nothing read again (what else this process reads, a
        # join's imports and files included, is not sending's)
        assert s.bytes_read == size
        # the kernel drops the pages, as under memory pressure: unmapped from the seeder, then evicted
        s.store.buffer.madvise(mmap.MADV_DONTNEED)
        fd = os.open(src / "w.bin", os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        before = storage_read_bytes()
        with join(f"127.0.0.1:{s.port}", host="127.0.0.1") as d:
            d.wait(60)
            assert bytes(d.store.view[: d.manifest.total_size]) == blob(src, d.manifest)
        if before is None or storage_read_bytes() == before:
            pytest.skip("this filesystem or kernel does not count reads from storage (tmpfs?)")
        assert 2 * size - (64 << 10) < s.bytes_read < 2 * size + (1 << 20)  # dropped pages read again, counted


def test_blob_over_the_budget_lives_in_a_temporary_file_not_anonymous_memory():
    size = 64 << 20
    before = rss_anon()
    buf = blob_backing(size, budget=size - 1)
    view = memoryview(buf)
    view[:] = b"\x07" * size
    assert rss_anon() - before < 16 << 20  # page cache of an unlinked file, not anonymous memory
    assert view[size - 1] == 7
    del view
    buf.close()
    before = rss_anon()
    buf = blob_backing(size, budget=size)  # within the budget: anonymous memory, as before
    memoryview(buf)[:] = b"\x07" * size
    assert rss_anon() - before >= size // 2
    buf.close()


def test_file_map_where_pages_do_not_fit_the_layout(tmp_path):
    """A file off a page boundary (a host with pages over 4 KiB): read into memory read-only, refused writable."""
    (tmp_path / "a").write_bytes(b"A" * 5000)
    fd = os.open(tmp_path / "a", os.O_RDWR)
    try:
        fm = FileMap(100 + 5000, [(fd, 100, 5000)], writable=False)
        assert fm.copied and bytes(memoryview(fm.buffer)[:5100]) == b"\0" * 100 + b"A" * 5000
        with pytest.raises(OSError, match="pages are larger than the blob layout"):
            FileMap(100 + 5000, [(fd, 100, 5000)], writable=True)
    finally:
        os.close(fd)


def test_waiters_return_when_their_chunks_are_verified_in_any_order(src):
    """A waiter sleeps until the highest chunk it still misses lands, then looks again: chunks that
    land out of order (the highest first) still end every wait, and a wait for chunks already held
    returns at once."""
    import threading

    m, _, _ = build(src, CHUNK)
    store = Store(m)
    data = blob(src, m)
    n = m.n_chunks
    assert n >= 4
    results = {}

    def wait(name, indices):
        results[name] = store.wait_chunks(indices, timeout=30)

    waiters = [threading.Thread(target=wait, args=("all", range(n))),
               threading.Thread(target=wait, args=("first two", [0, 1]))]
    for t in waiters:
        t.start()
    fill(store, data, [n - 1, 1])  # the highest first: both waiters look again and wait on
    time.sleep(0.05)
    assert results == {}
    fill(store, data, [0])
    waiters[1].join(10)
    assert results == {"first two": True}
    fill(store, data, range(2, n - 1))
    waiters[0].join(10)
    assert results == {"first two": True, "all": True}
    assert store.wait_chunks([0, n - 1], timeout=0)
    assert store.watched == {}


def test_a_seeder_store_says_when_a_source_file_changed_under_it(tmp_path):
    from p2pweights.sources.source import SourceError

    src = checkpoint(tmp_path / "src", {"a.bin": 3 * CHUNK, "b.bin": 2 * CHUNK})
    m, _, _ = build(src, CHUNK)
    s = SourceStore.open(m, src)

    def refused(index: int) -> str | None:
        try:
            s.outgoing(index)
        except SourceError as e:
            return str(e)
        return None

    try:
        b_first = m.chunks_covering(m.files[1]["offset"], m.files[1]["offset"] + 1)[0]
        assert all(refused(i) is None for i in range(m.n_chunks))
        later = time.time() + 5
        os.utime(src / "b.bin", (later, later))  # touched, bytes the same: hashed again, still fine
        assert refused(b_first) is None
        with open(src / "b.bin", "r+b") as f:  # written to: that chunk is refused, a.bin's are not
            f.write(b"\x00" * 100)
        assert "b.bin changed under the seeder" in refused(b_first)
        assert refused(0) is None
        os.truncate(src / "a.bin", CHUNK)  # shrunk: refused before any byte of the mapping is read
        assert f"a.bin is {CHUNK} bytes, the manifest says {3 * CHUNK}" in refused(0)
    finally:
        s.close()
