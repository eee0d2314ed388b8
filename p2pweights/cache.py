"""Cache: the checkpoint's files on a peer's local disk, written chunk by chunk.

Each file of the manifest's file table is written under ``out`` with its
original name, first as ``NAME.partial``; verified chunks are written with
``pwrite`` by one writer thread (so the network loop never waits on the disk),
and only when every chunk is on disk are the files fsynced and renamed to their
final names.  A file under its final name is therefore always complete.
A write error (disk full, say) fails the download with a clear message; nothing
is presented as complete.

Restarts: a peer started again with the same ``out`` re-verifies what is on
disk (partial files, or complete ones from an earlier run) by hashing every
chunk against the manifest, adopts the chunks that match, and fetches only
the rest.  We re-hash rather than trust a sidecar bitfield: xxh3 reads at
disk speed, and a sidecar cannot vouch for bytes changed behind its back.
"""
from __future__ import annotations

import os
import queue
import threading

import numpy as np

from .errors import UserError
from .manifest import chunk_hasher, file_segments
from .source import BlobSource

PARTIAL = ".partial"


class CacheError(UserError, OSError):
    """The local copy could not be written."""


class DiskCache:
    """Writes verified chunks into the checkpoint's files under ``out``."""

    def __init__(self, manifest, out: str, on_error=None):
        self.manifest = manifest
        self.out = os.path.abspath(out)
        self.on_error = on_error
        self.fds: dict[str, int] = {}
        self.written = 0
        self.error: str | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = threading.Event()
        self.on_disk = np.zeros(manifest.n_chunks, dtype=bool)
        self.resuming = False
        try:
            for f in manifest.files:
                path = self._path(f["name"]) + PARTIAL
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if os.path.exists(path[: -len(PARTIAL)]) and not os.path.exists(path):
                    os.replace(path[: -len(PARTIAL)], path)  # complete from an earlier run: re-verify it
                self.resuming |= os.path.exists(path) and os.path.getsize(path) > 0
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                os.ftruncate(fd, f["size"])
                self.fds[f["name"]] = fd
        except OSError as e:
            self.close()
            raise CacheError(f"cannot create the local copy under {self.out}: {e.strerror}") from None
        self.thread = threading.Thread(target=self._run, name="p2pw-disk", daemon=True)
        self.thread.start()

    def _path(self, name: str) -> str:
        path = os.path.normpath(os.path.join(self.out, name))
        if not path.startswith(self.out + os.sep):
            raise CacheError(f"file name {name!r} in the manifest escapes the output directory")
        return path

    def recover(self, store) -> list[int]:
        """Read what an earlier run left on disk into ``store``'s buffer; the chunks whose hash matches."""
        if not self.resuming:
            return []
        digest = chunk_hasher(self.manifest.hash)
        source = BlobSource(self.out, self.manifest.files, suffix=PARTIAL)
        try:
            found = [i for i in range(self.manifest.n_chunks)
                     if source.read_chunk(self.manifest, i, store.chunk(i), digest)]
        finally:
            source.close()
        self.on_disk[found] = True
        return found

    def put(self, index: int, data: memoryview) -> None:
        """Queue verified chunk ``index`` (its bytes must not change) for writing."""
        self.queue.put((index, data))

    def _run(self) -> None:
        remaining = self.manifest.n_chunks
        while remaining:
            item = self.queue.get()
            if item is None:
                return
            index, data = item
            if self.on_disk[index]:  # recovered from an earlier run: already there
                remaining -= 1
                continue
            lo, hi = self.manifest.chunk_span(index)
            try:
                for f, off, a, b in file_segments(self.manifest.files, lo, hi):
                    view = data[a - lo: b - lo]
                    done = 0
                    while done < len(view):
                        done += os.pwrite(self.fds[f["name"]], view[done:], off + done)
                self.written += 1
            except OSError as e:
                self.error = f"writing chunk {index} to {self.out} failed: {e.strerror}"
                if self.on_error:
                    self.on_error(self.error)
                return
            remaining -= 1
        try:
            self._finish()
        except OSError as e:
            self.error = f"finishing the local copy under {self.out} failed: {e.strerror}"
            if self.on_error:
                self.on_error(self.error)
            return
        self.finished.set()

    def _finish(self) -> None:
        for name, fd in self.fds.items():
            os.fsync(fd)
        for f in self.manifest.files:
            path = self._path(f["name"])
            os.replace(path + PARTIAL, path)
        self.close()

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every file is complete under its final name."""
        return self.finished.wait(timeout)
