"""The ring of reused chunk slots (sans-IO), and a copy written through it: O_DIRECT files, chunks served from
slots while they last and read back from the files after."""
import ctypes
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from p2pweights.storage.cache import DiskCache
from p2pweights.sources.chunker import build
from p2pweights.storage.ring import MIN_SLOTS, RATE_WINDOW, RING_BYTES, ChunkRing, ring_budget
from p2pweights.storage.store import Store

C = 64 << 10


class Tracker:
    """Stands in for ``zmq.MessageTracker``: ``done`` once ZeroMQ no longer reads the frame."""

    def __init__(self):
        self.done = False


def test_slots_are_taken_oldest_first_and_drop_what_they_held():
    ring = ChunkRing(C, slots=3)
    for index in range(3):
        slot, view = ring.take(C)
        assert len(view) == C and slot == index
        view[:] = bytes([index]) * C
        ring.hold(slot, index)
    assert bytes(ring.view(1, C)[1]) == b"\x01" * C
    slot, _ = ring.take(100)  # the oldest slot: chunk 0 is no longer held
    assert slot == 0 and ring.view(0, C) == (None, None) and ring.view(2, C)[0] == 2
    assert ring.report() == {"slots": 3, "most_slots": 3, "held": 3, "full": 0, "sent_from_slots": 2,
                             "sent_from_files": 1, "read_back": 0}


def test_a_chunk_held_again_in_another_slot_leaves_the_first_holding_nothing():
    """Read back twice (two partners asking at once), a chunk lands in two slots: the later one holds it, the
    earlier one nothing, and taking every slot over and over finds them consistent."""
    ring = ChunkRing(C, slots=3)
    a, _ = ring.take(C, received=False)
    b, _ = ring.take(C, received=False)
    ring.hold(a, 7, received=False)
    ring.hold(b, 7, received=False)
    assert ring.view(7, C)[0] == b and ring.chunk_in[a] == -1
    for _ in range(2 * ring.slots):
        slot, _ = ring.take(C)
        ring.hold(slot, 100 + slot)
    assert ring.view(7, C) == (None, None)
    assert all(ring.chunk_in[s] == i for i, s in ring.slot_of.items())


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_ring_grows_with_the_rate_of_chunks_held_up_to_its_most():
    clock = Clock()
    ring = ChunkRing(C, slots=2, busy=1, most=10, clock=clock)
    assert ring.slots == 3 and ring.report()["most_slots"] == 11
    for index in range(3):  # nobody asks for what it no longer holds: it keeps its first slots
        slot, _ = ring.take(C)
        clock.now += RATE_WINDOW / 3 + 1e-9
        ring.hold(slot, index)
    assert ring.slots == 3
    assert ring.view(77, C) == (None, None)  # a miss: partners ask for more than it holds
    for index in range(3):  # 3 chunks in 0.25 s: 12 a second, 6 in RING_SECONDS (0.5 s)
        slot, _ = ring.take(C)
        clock.now += RATE_WINDOW / 3 + 1e-9
        ring.hold(slot, index)
    assert ring.slots == 6 + 1
    ring.view(77, C)
    for index in range(3, 40):  # far faster: capped at most (and the busy slot)
        slot, _ = ring.take(C)
        clock.now += RATE_WINDOW / 30
        ring.hold(slot, index)
    assert ring.slots == 11
    ring.view(77, C)
    clock.now += 10 * RATE_WINDOW  # slower again: it does not shrink (the slots keep their chunks)
    slot, _ = ring.take(C)
    ring.hold(slot, 99)
    assert ring.slots == 11 and ring.view(99, C)[0] == slot


def test_chunks_read_back_count_neither_as_received_nor_as_full():
    clock = Clock()
    ring = ChunkRing(C, slots=1, most=4, clock=clock)
    slot, _ = ring.take(C, received=False)
    ring.hold(slot, 5, received=False)
    ring.pin(slot, Tracker())
    assert ring.take(C, received=False) == (None, None)
    assert ring.report()["held"] == 0 and ring.report()["full"] == 0 and ring.report()["read_back"] == 1
    clock.now += 2 * RATE_WINDOW
    ring.grow(clock.now)
    assert ring.slots == 1  # nothing received: no rate to grow for


def test_ring_budget_is_an_eighth_of_the_memory_budget_and_caps_the_first_ring():
    assert ring_budget(4 << 20, 8 << 30) == 256 and ring_budget(4 << 20, 0) == MIN_SLOTS
    assert ring_budget(C, 1 << 30) == (1 << 30) // 8 // C
    assert ChunkRing(C, most=ring_budget(C, 1 << 30)).slots == RING_BYTES // C  # 16 MiB first
    assert ChunkRing(C, busy=2, most=ring_budget(C, 1 << 20)).slots == MIN_SLOTS + 2  # a budget of 1 MiB


def test_a_slot_being_sent_from_is_not_reused_until_the_send_is_done():
    ring = ChunkRing(C, slots=2)
    for index in range(2):
        slot, _ = ring.take(C)
        ring.hold(slot, index)
    sending = Tracker()
    ring.pin(0, sending)
    assert ring.take(C)[0] == 1  # slot 0 skipped: ZeroMQ still reads chunk 0 from it
    assert ring.view(0, C)[0] == 0
    ring.pin(1, Tracker())
    assert ring.take(C) == (None, None)  # every slot pinned: the caller receives the old way
    assert ring.report()["full"] == 1 and ring.report()["held"] == 2
    sending.done = True
    assert ring.take(C)[0] == 0 and ring.view(0, C) == (None, None)


def test_pins_of_finished_sends_do_not_pile_up_on_a_slot_served_over_and_over():
    ring = ChunkRing(C, slots=1)
    slot, _ = ring.take(C)
    ring.hold(slot, 7)
    for _ in range(1000):
        t = Tracker()
        ring.pin(slot, t)
        t.done = True
    assert len(ring.pins[slot]) <= 16


def test_slots_are_page_aligned_for_o_direct():
    ring = ChunkRing(C + 100, slots=4)  # a chunk size off the page grid still gets aligned slots
    base = ctypes.addressof(ctypes.c_char.from_buffer(ring.buffer))
    assert base % 4096 == 0 and ring.stride % 4096 == 0
    ring.close()


@pytest.fixture
def src(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "src"
    root.mkdir()
    # files that end off the 4 KiB grid, one smaller than a chunk, one spanning many
    for name, size in {"a.json": 3000, "b.bin": 5 * C + 123, "c.bin": C // 2 + 7}.items():
        (root / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return root


@pytest.fixture(params=["disk", "tmpfs"])
def out(request, tmp_path):
    """Where the copy goes: the test's directory (ext4 here), or tmpfs (which takes O_DIRECT since Linux 6.6
    and caches it all the same, so a copy there is written without the ring: the test is skipped)."""
    if request.param == "disk":
        yield tmp_path / "out"
        return
    with open("/proc/mounts") as f:
        if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f):
            pytest.skip("no tmpfs at /dev/shm here")
    path = Path(f"/dev/shm/p2pw-ring-test-{os.getpid()}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ring_copy(src, out, slots: int):
    """A copy of ``src`` into ``out`` written through a ring of ``slots`` (skipped where ``out`` refuses
    O_DIRECT): the manifest, the blob's bytes, the cache, the ring and the store."""
    m, _, _ = build(src, C)
    data = bytearray(m.total_size)
    for f in m.files:
        data[f["offset"]: f["offset"] + f["size"]] = (src / f["name"]).read_bytes()
    cache = DiskCache(m, out, direct=True)
    if not cache.direct:
        cache.close()
        pytest.skip(f"{out} is written without the ring (no O_DIRECT there, or a filesystem in memory)")
    ring = ChunkRing(m.chunk_size, slots=slots)
    store = Store(m, cache.filemap.buffer, files=cache, ring=ring)
    store.sinks.append(cache)
    return m, data, cache, ring, store


def assert_files_final_and_exact(src, out, m, cache, store):
    assert cache.wait(10)
    for f in m.files:
        assert (out / f["name"]).read_bytes() == (src / f["name"]).read_bytes()
    cache.close()
    store.close()


def test_copy_through_the_ring_is_byte_exact_and_serves_evicted_chunks_from_the_files(src, out):
    m, data, cache, ring, store = ring_copy(src, out, slots=2)
    assert not store.in_place
    for i in reversed(range(m.n_chunks)):  # out of order, as a swarm delivers
        lo, hi = m.chunk_span(i)
        slot, view = ring.take(hi - lo)
        view[:] = data[lo:hi]
        store.write(i, view, slot)
        store.verified(i)
        assert bytes(store.outgoing(i)[1]) == bytes(data[lo:hi])  # served from its slot
    assert ring.view(m.n_chunks - 1, 1) == (None, None)  # evicted long ago: read back from the files
    for i in range(m.n_chunks):
        lo, hi = m.chunk_span(i)
        slot, view = store.outgoing(i)
        assert slot is not None and bytes(view) == bytes(data[lo:hi])  # into a slot, never the mapping
    assert ring.report()["read_back"] >= m.n_chunks - 2
    assert_files_final_and_exact(src, out, m, cache, store)


def test_with_every_slot_being_sent_from_chunks_go_through_the_page_cache_and_the_copy_is_exact(src, tmp_path):
    out = tmp_path / "out"
    m, data, cache, ring, store = ring_copy(src, out, slots=1)
    sending = Tracker()
    for i in range(m.n_chunks):  # slot 0 stays pinned from chunk 1 on: a partner that stopped reading
        lo, hi = m.chunk_span(i)
        slot, view = ring.take(hi - lo)
        if slot is None:  # as the node does: received into libzmq's buffer, then pwrite
            view = memoryview(bytes(data[lo:hi]))
        else:
            view[:] = data[lo:hi]
            ring.pin(slot, sending)
        store.write(i, view, slot)
        store.verified(i)
        assert bytes(store.outgoing(i)[1]) == bytes(data[lo:hi])
    assert ring.report()["held"] == 1 and ring.report()["full"] == m.n_chunks - 1
    assert_files_final_and_exact(src, out, m, cache, store)


def test_a_file_whose_o_direct_writes_are_refused_goes_through_the_page_cache_from_then_on(src, tmp_path, monkeypatch):
    # a filesystem whose blocks are larger than the 4 KiB grid opens O_DIRECT but refuses such writes (EINVAL):
    # that file's direct descriptor is closed at the first refusal, and the copy is exact all the same
    import errno

    from p2pweights.storage import cache as cache_module

    out = tmp_path / "out"
    m, data, cache, ring, store = ring_copy(src, out, slots=4)
    refused_file = max(cache.direct_fds, key=lambda i: m.files[i]["size"])  # the one spanning many chunks
    refused_fd, real = cache.direct_fds[refused_file], cache_module._pwrite_all
    tries = []

    def pwrite_all(fd, view, at):
        if fd == refused_fd:
            tries.append(at)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, view, at)

    monkeypatch.setattr(cache_module, "_pwrite_all", pwrite_all)
    for i in range(m.n_chunks):
        lo, hi = m.chunk_span(i)
        slot, view = ring.take(hi - lo)
        view[:] = data[lo:hi]
        store.write(i, view, slot)
        store.verified(i)
    assert len(tries) == 1 and refused_file not in cache.direct_fds  # asked once, then the page cache
    assert_files_final_and_exact(src, out, m, cache, store)
