"""Source: reading byte ranges of the logical blob from a checkpoint's files.

The blob is the checkpoint's files laid end to end, each starting at its
offset in the file table, with zero padding in between.  ``BlobSource`` maps a
blob range onto the files it spans and reads them with large ``preadv`` calls
straight into the caller's buffer.  It counts every byte it reads, so the
seeder can show that storage was read exactly once.
"""
from __future__ import annotations

import bisect
import os
import queue
import threading

from ..errors import UserError
from .manifest import chunk_hasher, file_segments


def storage_read_bytes(scope: str = "self") -> int | None:
    """Bytes this process (``scope='self'``) or one of its threads (``'self/task/TID'``) had the kernel read
    from storage.

    Block I/O only, from /proc/SCOPE/io: page cache hits are not counted, so a
    chunk sent from a mapping whose pages are cached costs nothing here, and
    one whose pages the kernel dropped counts what was read again.  None
    where the kernel does not keep the count.
    """
    try:
        with open(f"/proc/{scope}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def sending_read_bytes() -> dict[str, int]:
    """Bytes the kernel read from storage for each of this process's libzmq I/O threads, by thread id.

    Chunks are sent from the mapped source files without a copy, so the I/O
    thread writing one to its socket is what reads the mapping: its count is
    the pages sending read again because the kernel had dropped them, and
    nothing else.  The process's own reads (a module imported late, such as
    pyzmq's zero-copy ``zmq.utils.garbage`` on the first send, files it
    writes, the read-ahead thread's preadv) are other threads'.  Empty where
    the kernel keeps no count.
    """
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if "ZMQbg/IO/" not in f.read():
                    continue
        except OSError:  # ended since the listing
            continue
        n = storage_read_bytes(f"self/task/{tid}")
        if n is not None:
            out[tid] = n
    return out


class SourceError(UserError, OSError):
    """The checkpoint's files no longer match their file table (truncated, removed, unreadable)."""


class BlobSource:
    """Reads blob ranges from the files of a checkpoint at ``path`` (a file or a directory).

    ``suffix`` is appended to every file name (a peer's ``.partial`` files)."""

    def __init__(self, path, files: list[dict], suffix: str = ""):
        self.root = os.fspath(path)
        self.suffix = suffix
        self.is_dir = os.path.isdir(self.root)
        self.files = [f for f in files if f["size"] > 0]
        self.starts = [f["offset"] for f in self.files]
        self.fds: dict[str, int] = {}
        self.bytes_read = 0

    def _fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is None:
            full = (os.path.join(self.root, name) if self.is_dir else self.root) + self.suffix
            try:
                fd = self.fds[name] = os.open(full, os.O_RDONLY)
            except OSError as e:
                raise SourceError(f"cannot read {full}: {e.strerror}") from None
        return fd

    def read_into(self, lo: int, view: memoryview) -> None:
        """Fill ``view`` with blob bytes [lo, lo + len(view)); padding reads as zeros."""
        hi = lo + len(view)
        pos = lo
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while pos < hi:
            f = self.files[i] if i < len(self.files) else None
            if f is None or pos < f["offset"]:  # padding before the next file (or after the last)
                gap_end = hi if f is None else min(hi, f["offset"])
                view[pos - lo: gap_end - lo] = bytes(gap_end - pos)
                pos = gap_end
                continue
            f_end = f["offset"] + f["size"]
            if pos >= f_end:
                i += 1
                continue
            end = min(hi, f_end)
            self._read_exact(f, pos - f["offset"], view[pos - lo: end - lo])
            pos = end
            i += 1

    def _read_exact(self, f: dict, offset: int, out: memoryview) -> None:
        fd = self._fd(f["name"])
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise SourceError(
                    f"{f['name']} is shorter than its manifest says ({offset + done} of {f['size']} bytes): "
                    "was it truncated or replaced while being served?")
            done += n
            self.bytes_read += n

    def read_chunk(self, manifest, index: int, view: memoryview, digest) -> bool:
        """Read chunk ``index`` into ``view``; whether its hash is the manifest's."""
        lo, _ = manifest.chunk_span(index)
        self.read_into(lo, view)
        return digest(view) == manifest.chunks[index]

    def read_chunks(self, manifest, indices, view_of, digest, span_of=None):
        """Yield ``(index, verified)`` for each chunk in ``indices``, read into ``view_of(index)`` one by one
        (``span_of``, a contiguous view of several chunks, is for sources that read runs: unused here)."""
        for index in indices:
            try:
                ok = self.read_chunk(manifest, index, view_of(index), digest)
            except OSError:
                ok = False
            yield index, ok

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def verify_copy(root, manifest) -> tuple[int, str | None]:
    """Check the checkpoint files under ``root`` against ``manifest``, chunk by chunk.

    Returns (chunks checked, None) when every chunk matches, or (index of the
    first bad chunk, a message naming it and the file(s) it covers).
    """
    for f in manifest.files:
        full = os.path.join(root, f["name"]) if os.path.isdir(root) else root
        try:
            size = os.path.getsize(full)
        except OSError:
            return 0, f"{f['name']}: missing from {root}"
        if size != f["size"]:
            return 0, f"{f['name']}: {size} bytes, the manifest says {f['size']}"
    digest = chunk_hasher(manifest.hash)
    source = BlobSource(root, manifest.files)
    buf = memoryview(bytearray(manifest.chunk_size))
    try:
        for index in range(manifest.n_chunks):
            lo, hi = manifest.chunk_span(index)
            if not source.read_chunk(manifest, index, buf[: hi - lo], digest):
                names = ", ".join(f["name"] for f, *_ in file_segments(manifest.files, lo, hi)) or "padding"
                return index, f"chunk {index} (bytes {lo}-{hi} of the blob, in {names}) does not match the manifest"
    finally:
        source.close()
    return manifest.n_chunks, None


class ReadAhead:
    """Reads requested chunks (and the next few after them) from storage in background threads.

    A seeder restarted from the catalog, or one reading an object store with a
    known manifest, serves chunks it has not read yet: the node asks
    ``want(index)``; a reader thread reads the chunk, verifies it against the
    manifest, and reports ``on_ready(index, ok)``, reading ``ahead`` chunks
    past each request (or as many as the source says pay, for one that reads
    them in parallel) so storage streams while the network sends.

    Requests come from many partners at scattered places in the blob, most of
    them already covered by an earlier request's read-ahead.  So a reader takes
    every request queued at once and reads what they leave (``batch``) in one
    go, and a source that reads in parallel (``concurrency`` > 1) gets
    ``READERS`` such readers, so one batch's last GET never leaves the origin
    idle: on the bed, one-chunk GETs one after another had held a seeder of an
    object store to about 70 % of its client's rate.

    A store that maps the source files themselves (``writable`` False) is read
    into a scratch buffer per reader, only to verify: the read leaves the bytes
    in the page cache the mapping serves from.  Otherwise chunks land in the
    store's buffer; each chunk is claimed by one reader, only chunks the store
    does not hold are written, and nobody reads a chunk before it is published,
    so no lock guards the buffer.
    """

    READERS = 2  # reader threads for a source that reads in parallel (one for a source that reads in order)

    def __init__(self, source: BlobSource, store, on_ready, ahead: int = 8, on_exit=None):
        self.source, self.store, self.on_exit = source, store, on_exit
        self.ahead = getattr(source, "ahead", ahead)
        self.digest = chunk_hasher(store.manifest.hash)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.done = bytearray(store.manifest.n_chunks)  # read (or claimed) by a reader
        self.lock = threading.Lock()  # claims in ``done``; ``on_ready`` (a socket: one thread at a time)
        self._ready = on_ready
        self.mapped = not getattr(store, "writable", True)  # the store maps these very files: read only to verify
        self.local = threading.local()  # each reader's scratch buffer, where ``mapped``
        readers = self.READERS if getattr(source, "concurrency", 1) > 1 else 1
        self.running = readers
        self.stopping = False
        self.threads = [threading.Thread(target=self._run, name="p2pw-readahead", daemon=True) for _ in range(readers)]
        for t in self.threads:
            t.start()

    def view_of(self, index: int) -> memoryview:
        """Where chunk ``index`` is read: the store's buffer, or this reader's scratch buffer (a chunk at a time)."""
        if not self.mapped:
            return self.store.chunk(index)
        scratch = getattr(self.local, "scratch", None)
        if scratch is None:
            scratch = self.local.scratch = memoryview(bytearray(self.store.manifest.chunk_size))
        lo, hi = self.store.manifest.chunk_span(index)
        return scratch[: hi - lo]

    @property
    def span_of(self):
        """Where a run of consecutive chunks is read at once: the store's buffer, bytes [lo, hi) (None where
        the store maps the source files: each chunk goes to the scratch buffer)."""
        return None if self.mapped else (lambda lo, hi: self.store.view[lo:hi])

    def want(self, index: int) -> None:
        self.requests.put(index)

    def stop(self) -> None:
        """Stop the readers: requests not yet taken are dropped, a batch being read is left after its next
        chunk (the node is closing)."""
        self.stopping = True
        for _ in self.threads:
            self.requests.put(None)

    def on_ready(self, index: int, ok: bool) -> None:
        with self.lock:
            self._ready(index, ok)

    def batch(self, asked: list[int]) -> list[int]:
        """Claim the chunks requests for ``asked`` leave to read: each with the ``ahead`` after it, minus those
        read, claimed or held already; in blob order."""
        n = self.store.manifest.n_chunks
        todo = set()
        for index in asked:
            todo.update(range(index, min(index + 1 + self.ahead, n)))
        with self.lock:
            todo = [i for i in sorted(todo) if not self.done[i] and not self.store.has(i)]
            for i in todo:
                self.done[i] = 1
        return todo

    def _run(self) -> None:
        try:
            while True:
                asked = [self.requests.get()]
                try:
                    while asked[-1] is not None:
                        asked.append(self.requests.get_nowait())
                except queue.Empty:
                    pass
                if asked[-1] is None:  # stopped: what is still asked for is left
                    return
                for i, ok in self.source.read_chunks(self.store.manifest, self.batch(asked), self.view_of,
                                                     self.digest, span_of=self.span_of):
                    self.on_ready(i, ok)
                    if self.stopping:
                        return
        finally:
            with self.lock:
                self.running -= 1
                last = self.running == 0
            if last and self.on_exit:
                self.on_exit()
