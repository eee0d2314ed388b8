"""Store: where a node keeps the blob, which chunks of it are verified, and who waits for them.

The store is one preallocated host buffer of the blob's size:
chunk ``i`` is always ``buffer[i*C:(i+1)*C]``, so a verified chunk is served to
children straight from it (zero-copy sends) and never moves.  A chunk's bit is
set only after its hash matched; nothing reads an unset chunk.  Readers in
other threads block in ``wait_chunks`` until their chunks are verified (and
every sink that tracks readiness has them).  The node's event loop is the only
writer.
"""
from __future__ import annotations

import mmap
import threading
import time

import numpy as np


def host_buffer(size: int):
    """A zero-filled anonymous buffer of ``size`` bytes, on huge pages where the kernel allows.

    Chunks fault it in as they land (one fault per 2 MiB huge page).  Measured
    here: first-touch copies into fresh 4 KiB pages run at 0.3-1.8 GB/s, into
    fresh huge pages at 1-4.8 GB/s.  Faulting it in ahead of the data was
    tried and dropped: MAP_POPULATE cost 0.9 s per GiB before the first byte,
    and a background MADV_POPULATE_WRITE thread (even at idle priority) slowed
    every relay's first forwarded chunk by 0.3-0.9 s when eight peers started
    at once on two cores, so a chain of 8 finished at 1.4-1.6x the floor
    instead of 1.16x.
    """
    if size == 0:
        return bytearray(0)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


class StoreClosed(RuntimeError):
    """The download this store belongs to ended with an error or was closed."""


class Store:
    """Blob buffer, bitfield of verified chunks, and range waiters."""

    def __init__(self, manifest, buffer=None):
        self.manifest = manifest
        self.buffer = buffer if buffer is not None else host_buffer(manifest.total_size)
        self.view = memoryview(self.buffer).cast("B")
        if len(self.view) < manifest.total_size:
            raise ValueError(f"buffer of {len(self.view)} bytes cannot hold a {manifest.total_size}-byte blob")
        self.have = np.zeros(manifest.n_chunks, dtype=bool)
        self.count = 0
        self.bytes = 0
        self.cond = threading.Condition()
        self.error: str | None = None
        self.sinks: list = []
        self.first_at: float | None = None  # monotonic time the first chunk was verified
        self.done_at: float | None = None

    def chunk(self, index: int) -> memoryview:
        lo, hi = self.manifest.chunk_span(index)
        return self.view[lo:hi]

    def has(self, index: int) -> bool:
        return bool(self.have[index])

    @property
    def complete(self) -> bool:
        return self.count == self.manifest.n_chunks

    def missing(self):
        """Indices of chunks not yet verified, in order."""
        return np.flatnonzero(~self.have).tolist()

    def verified(self, index: int) -> None:
        """Mark chunk ``index`` verified (its hash matched), hand it to sinks, wake waiters."""
        if self.have[index]:
            return
        data = self.chunk(index)
        for sink in self.sinks:
            sink.put(index, data)
        now = time.monotonic()
        with self.cond:
            self.have[index] = True
            self.count += 1
            self.bytes += len(data)
            self.first_at = self.first_at or now
            if self.complete:
                self.done_at = now
            self.cond.notify_all()

    def hold_all(self) -> None:
        """Every chunk is already in the buffer and verified (a seeder that hashed it while reading)."""
        with self.cond:
            self.have[:] = True
            self.count = self.manifest.n_chunks
            self.bytes = self.manifest.total_size
            self.first_at = self.done_at = time.monotonic()
            self.cond.notify_all()

    def fail(self, message: str) -> None:
        """End every wait with ``message`` (a fatal download error)."""
        with self.cond:
            self.error = self.error or message
            self.cond.notify_all()

    def wait_chunks(self, indices, timeout: float | None = None) -> bool:
        """Block until every chunk in ``indices`` is verified; False on timeout, StoreClosed on failure."""
        indices = np.asarray(list(indices), dtype=np.int64)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                if self.error:
                    raise StoreClosed(self.error)
                if indices.size == 0 or self.have[indices].all():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left if left is not None else 1.0)
