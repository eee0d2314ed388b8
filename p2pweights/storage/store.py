"""Store: where a node keeps the blob, which chunks of it are verified, and who waits for them.

The store is one address range of the blob's size: chunk ``i`` is always
``buffer[i*C:(i+1)*C]``, so a verified chunk is served to children straight
from it (zero-copy sends) and never moves.  The range is backed by the
checkpoint's files themselves where the node has them (``FileMap``: each file
mapped shared at its blob offset, so received bytes land in the page cache of
the destination file and the kernel writes them back; a seeder maps its
source files read-only), by anonymous memory (``host_buffer``) for a blob
that fits the memory budget, or by an unlinked temporary file
(``temp_backing``) for one that does not.  A join writing files may also
hold the chunks it verified last in a ``ring.ChunkRing``: ``outgoing`` serves
a chunk from its slot while one holds it.  A chunk's bit is
set only after its hash matched; nothing reads an unset chunk.  Readers in
other threads block in ``wait_chunks`` until their chunks are verified (and
every sink that tracks readiness has them).  The node's event loop is the only
writer of this state; the bytes of a verified chunk may be put in place by a
worker thread first (``land``).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

from ..errors import UserError
from ..sources.manifest import chunk_hasher
from ..sources.source import SourceError
from .sizes import parse_size  # the one size syntax of --memory-budget and P2PW_CACHE_SIZE

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10


class SpaceError(UserError, OSError):
    """Too little free space for a file-backed store; the message names the bytes needed and free."""


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem holding ``directory`` (or its nearest
    existing ancestor)."""
    d = os.path.abspath(directory)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def check_space(directory: str, needed: int, what: str) -> None:
    free = free_bytes(directory)
    if needed > free:
        raise SpaceError(f"not enough space under {directory} for {what}: needs {needed} bytes "
                         f"({needed / 2**30:.2f} GiB), {free} bytes free ({free / 2**30:.2f} GiB)")


class FileMap:
    """One contiguous address range of ``size`` bytes with files mapped shared over their slices.

    ``parts`` are ``(fd, offset, length)``: file ``fd``'s first ``length``
    bytes appear at ``offset`` (a multiple of the page size: the blob layout
    starts every file on a 4 KiB boundary; on a host with larger pages a
    read-only map copies the files into its memory instead, a writable one
    is refused).  The range is an anonymous
    mapping first (so padding reads as zeros) with each file mapped over its
    slice (MAP_FIXED); the tail of a file's last page past its end is the
    padding before the next file.  ``buffer`` (a Python ``mmap``) owns the
    range: closing it, or dropping the last view of it, unmaps everything.
    The fds may be closed once mapped.
    """

    def __init__(self, size: int, parts, writable: bool):
        self.size = size
        self.buffer = mmap.mmap(-1, max(align_page(size), PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        probe = ctypes.c_char.from_buffer(self.buffer)
        self.base = ctypes.addressof(probe)
        del probe  # a live export would keep the mmap from ever closing
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        misaligned = any(offset % PAGE for _, offset, length in parts if length)
        self.copied = misaligned  # pages larger than the layout's 4 KiB: read into memory, not mapped
        try:
            if misaligned and writable:
                raise OSError(f"this host's {PAGE}-byte pages are larger than the blob layout's 4 KiB "
                              "alignment: files cannot be mapped at their blob offsets")
            for fd, offset, length in parts:
                if length == 0:
                    continue
                if misaligned:
                    self._read(fd, offset, length)
                    continue
                addr = _libc.mmap(self.base + offset, align_page(length), prot, mmap.MAP_SHARED | MAP_FIXED, fd, 0)
                if addr in (None, MAP_FAILED) or addr != self.base + offset:
                    err = ctypes.get_errno()
                    raise OSError(err, f"cannot map a file into the store: {os.strerror(err)}")
        except BaseException:
            self.buffer.close()
            raise

    def _read(self, fd: int, offset: int, length: int) -> None:
        view = memoryview(self.buffer)[offset: offset + length]
        try:
            done = 0
            while done < length:
                n = os.preadv(fd, [view[done:]], done)
                if n == 0:
                    raise OSError(f"a file ended after {done} of its {length} bytes")
                done += n
        finally:
            view.release()


def copy_into(dst, src) -> None:
    """Copy the bytes of ``src`` into ``dst`` (as long), outside the GIL where both are writable buffers (a
    ZeroMQ frame, the blob, a ring slot): other threads run meanwhile, the event loop among them."""
    try:
        d, s = ctypes.c_char.from_buffer(dst), ctypes.c_char.from_buffer(src)
    except (TypeError, ValueError):  # read-only (bytes), or empty: under the GIL
        dst[:len(src)] = src
        return
    try:
        ctypes.memmove(ctypes.addressof(d), ctypes.addressof(s), len(src))
    finally:
        del d, s  # a live export would keep the buffers from being released


def align_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def temp_backing(size: int, directory: str | None = None) -> mmap.mmap:
    """A ``size``-byte buffer backed by an unlinked temporary file (for a blob over the memory budget).

    Its pages are page cache, not anonymous memory: the kernel writes them
    back and frees them under pressure.  Space is checked and allocated
    up front; the file vanishes with the mapping.
    """
    import tempfile  # here only: with shutil, bz2 and lzma, 2 ms of every join's start-up

    directory = directory or os.environ.get("P2PW_TMPDIR") or tempfile.gettempdir()
    check_space(directory, size, "the blob's temporary file")
    with tempfile.TemporaryFile(dir=directory) as f:
        os.posix_fallocate(f.fileno(), 0, max(size, 1))
        return FileMap(size, [(f.fileno(), 0, size)], writable=True).buffer


def available_memory() -> int:
    """Bytes of memory this process may still use: MemAvailable, or less under a cgroup memory limit."""
    avail = 1 << 62
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    return min([avail] + [max(limit - usage, 0) for limit, usage in _cgroup_limits()])


def _cgroup_limits():
    """(limit, usage) of this process's memory cgroup, v1 or v2, where one is set."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            places = [("/sys/fs/cgroup/memory" + path, "memory.limit_in_bytes", "memory.usage_in_bytes")]
        elif controllers == "":
            places = [(root + path, "memory.max", "memory.current") for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")]
        else:
            continue
        for d, limit_file, usage_file in places:
            try:
                with open(os.path.join(d, limit_file)) as a, open(os.path.join(d, usage_file)) as b:
                    limit, usage = a.read().strip(), int(b.read())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < 1 << 60:
                yield int(limit), usage
            break


def memory_budget() -> int:
    """Default largest blob kept in anonymous memory: half the memory available now (``P2PW_MEMORY_BUDGET``
    overrides: a size such as 8GiB, 512M or bytes; UserError if it is not one)."""
    env = os.environ.get("P2PW_MEMORY_BUDGET")
    if not env:
        return available_memory() // 2
    try:
        return parse_size(env)
    except UserError as e:
        raise UserError(f"P2PW_MEMORY_BUDGET={env!r}: {e}") from None


def blob_backing(size: int, budget: int | None = None):
    """Anonymous memory for a blob within ``budget`` bytes (default ``memory_budget()``), else a temp file."""
    budget = memory_budget() if budget is None else budget
    return host_buffer(size) if size <= budget else temp_backing(size)


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


ANY_CHUNK = -1  # ``Store.sleep_until``: wake at the next chunk verified, whichever it is


class StoreClosed(RuntimeError):
    """The download this store belongs to ended with an error or was closed."""


class Store:
    """Blob buffer, bitfield of verified chunks, and range waiters."""

    writable = True  # chunks may be written into ``chunk(i)`` (received, or read from a source)

    def __init__(self, manifest, buffer=None, files=None, ring=None):
        self.manifest = manifest
        self.buffer = buffer if buffer is not None else blob_backing(manifest.total_size)
        self.files = files  # the copy's files (cache.DiskCache) ``buffer`` maps, or None: memory
        self.ring = ring  # ring.ChunkRing: the last chunks, received, written and served from reused slots
        self.view = memoryview(self.buffer).cast("B")
        if len(self.view) < manifest.total_size:
            raise ValueError(f"buffer of {len(self.view)} bytes cannot hold a {manifest.total_size}-byte blob")
        self.have = bytearray(manifest.n_chunks)  # 1 where chunk i is verified
        self.count = 0
        self.n_chunks = manifest.n_chunks
        self.bytes = 0
        self.cond = threading.Condition()
        self.watched: dict[int, int] = {}  # chunk (or ANY_CHUNK) -> threads to wake when it is verified
        self.error: str | None = None
        self.sinks: list = []
        self.first_at: float | None = None  # monotonic time the first chunk was verified
        self.done_at: float | None = None
        self.write_seconds = 0.0  # CPU seconds ``write`` spent (on a VM that backs new pages lazily: most of a join's)

    def chunk(self, index: int) -> memoryview:
        lo, hi = self.manifest.chunk_span(index)
        return self.view[lo:hi]

    def outgoing(self, index: int):
        """``(ring slot or None, bytes)`` of chunk ``index`` for a send (which pins the slot while it reads): a
        ring slot if one holds it, or one it is read back into from the files; else the buffer."""
        lo, hi = self.manifest.chunk_span(index)
        if self.ring is not None:
            slot, view = self.ring.view(index, hi - lo)
            if slot is None:
                slot, view = self._read_back(index)
            if view is not None:
                return slot, view[:hi - lo]
        return None, self.view[lo:hi]

    def _read_back(self, index: int):
        """``(slot or None, view)`` of verified chunk ``index`` read from the files (``readback``) into a free
        ring slot, or with every slot busy into a buffer of its own (the send keeps it); ``(None, None)``
        where the files cannot be read so (the buffer serves it)."""
        reads = getattr(self.files, "reads", None)
        if reads is None:
            return None, None
        slot, view = self.ring.take(self.ring.stride, received=False)
        into = view if view is not None else memoryview(mmap.mmap(-1, self.ring.stride))
        try:
            reads.read(index, into)
        except OSError:
            if slot is not None:
                self.ring.release(slot)
            return None, None
        if slot is not None:
            self.ring.hold(slot, index, received=False)
        return slot, into

    def has(self, index: int) -> bool:
        return bool(self.have[index])

    @property
    def in_place(self) -> bool:
        """Whether chunks are received straight into ``chunk(i)`` (memory), not handed to ``write``."""
        return self.files is None

    def write(self, index: int, data, slot: int | None = None) -> None:
        """Put verified chunk ``index`` into the files behind the buffer (OSError if they refuse); only for a
        store that is not ``in_place``.  From ring ``slot`` (``ring.ChunkRing.take``): written around the page
        cache, and the slot holds it from now on.

        By ``pwrite``, not by copying into the mapping: faulting a shared file
        mapping's pages in for writing (read-around of the preallocated blocks,
        ``page_mkwrite``) cost 2 to 3 times the kernel CPU of writing the same
        bytes (a 256 MiB join on ext4: 1.3-1.5 s against 0.4-0.6 s of system
        time).  Either way the bytes are copied once, from the network buffer
        into the page cache, and the mapping, which shares those pages, serves
        them.
        """
        self.write_seconds += self.land(index, data, None if slot is None else data)
        if slot is not None:
            self.ring.hold(slot, index)

    def land(self, index: int, data, into=None) -> float:
        """Put verified chunk ``index``'s bytes ``data`` where they belong, on any thread (a worker's): into the
        blob (a store in memory); else into ``into`` (a ring slot's view, unless ``data`` is it already) and
        from there into the files around the page cache; else into the files by ``pwrite``.  Changes no
        state (the loop holds the slot and marks the chunk verified); OSError if the files refuse.  Returns
        the CPU seconds it took."""
        began = time.thread_time()
        if self.files is None:
            copy_into(self.chunk(index), data)
        elif into is None:
            self.files.write_chunk(index, data)
        else:
            if into is not data:
                copy_into(into, data)
            self.files.write_direct(index, into)
        return time.thread_time() - began

    @property
    def complete(self) -> bool:
        return self.count == self.n_chunks

    def missing(self):
        """Indices of chunks not yet verified, in order."""
        return [i for i, held in enumerate(self.have) if not held]

    def verified(self, index: int) -> None:
        """Mark chunk ``index`` verified (its hash matched), hand it to sinks, wake waiters."""
        if self.have[index]:
            return
        data = self.chunk(index)  # the buffer, never a ring slot: a sink may copy later, and a slot is reused
        for sink in self.sinks:
            sink.put(index, data)
        now = time.monotonic()
        with self.cond:
            self.have[index] = 1
            self.count += 1
            self.bytes += len(data)
            self.first_at = self.first_at or now
            if self.complete:
                self.done_at = now
            if self.watched and (index in self.watched or ANY_CHUNK in self.watched or self.complete):
                self.cond.notify_all()  # only a waiter for this chunk: waking all per chunk costs the loop the GIL

    def close(self) -> None:
        """Unmap the backing now if no view of it is still in use (else when the last one goes)."""
        if self.ring is not None:
            self.ring.close()
        try:
            self.view.release()
            if hasattr(self.buffer, "close"):
                self.buffer.close()
        except (BufferError, ValueError):
            pass

    def hold_all(self) -> None:
        """Every chunk is already in the buffer and verified (a seeder that hashed it while reading)."""
        with self.cond:
            self.have[:] = b"\x01" * self.manifest.n_chunks
            self.count = self.n_chunks
            self.bytes = self.manifest.total_size
            self.first_at = self.done_at = time.monotonic()
            self.cond.notify_all()

    def fail(self, message: str) -> None:
        """End every wait with ``message`` (a fatal download error)."""
        with self.cond:
            self.error = self.error or message
            self.cond.notify_all()

    def wait_chunks(self, indices, timeout: float | None = None) -> bool:
        """Block until every chunk in ``indices`` is verified; False on timeout, StoreClosed on failure.

        It sleeps until the highest chunk still missing is verified (chunks arrive near blob order,
        so that is about the last), not at every chunk: a wait for the whole blob wakes a few times,
        not once per chunk."""
        indices = list(indices)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                if self.error:
                    raise StoreClosed(self.error)
                have = self.have
                missing = [i for i in indices if not have[i]]
                if not missing:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.sleep_until(missing[-1], left if left is not None else 1.0)

    def sleep_until(self, index: int, timeout: float) -> None:
        """Wait on ``cond`` (held) until chunk ``index`` (or ``ANY_CHUNK``) is verified, a failure, or ``timeout``."""
        self.watched[index] = self.watched.get(index, 0) + 1
        try:
            self.cond.wait(timeout)
        finally:
            self.watched[index] -= 1
            if not self.watched[index]:
                del self.watched[index]


def _sized(path: str, fd: int, size: int) -> os.stat_result:
    """The file open as ``fd``'s stat, or SourceError where it no longer holds ``size`` bytes: a mapping past
    the end of a file faults (a send from it: libzmq aborted the seeder on EFAULT), so a resized one is
    never served."""
    st = os.fstat(fd)
    if st.st_size != size:
        raise SourceError(f"{path} is {st.st_size} bytes, the manifest says {size}: it {CHANGED}")
    return st


CHANGED = "changed under the seeder (restart p2pw seed to serve what it holds now)"


class SourceStore(Store):
    """A seeder's store: its source files mapped read-only.

    The scan read each byte from storage once and left it in the page cache,
    where these mappings find it: a chunk sent to a child is read from
    memory, not storage.  Pages the kernel dropped since are read from
    storage again by the send; the seeder counts those reads from the
    kernel's own I/O accounting for the threads that send
    (``source.sending_read_bytes``).
    """

    writable = False  # read-only mappings: nothing is ever written into this store
    sources: list = []  # (path, fd, offset, size, mtime_ns) per source file, open to see it change (``outgoing``)

    @classmethod
    def open(cls, manifest, path) -> "SourceStore":
        """Map the files of checkpoint ``path`` (a file or a directory) as ``manifest`` lays them out."""
        root = os.fspath(path)
        fds, files = [], []
        try:
            for f in manifest.files:
                full = os.path.join(root, f["name"]) if os.path.isdir(root) else root
                try:
                    fds.append(fd := os.open(full, os.O_RDONLY))
                except OSError as e:
                    raise SourceError(f"cannot read {full}: {e.strerror}") from None
                files.append((full, fd, f["offset"], f["size"], _sized(full, fd, f["size"]).st_mtime_ns))
            store = cls(manifest, FileMap(manifest.total_size, [(fd, at, n) for _, fd, at, n, _ in files],
                                          writable=False).buffer)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        store.sources, store.digest = files, chunk_hasher(manifest.hash)
        return store

    def outgoing(self, index: int):
        """Chunk ``index`` for a send, once the files under it are as they were mapped: ``SourceError`` where
        one is no longer its size (``_sized``), or was written to since (its mtime moved) and the chunk no
        longer hashes to the manifest's (an untouched file is not hashed again: its pages are read by the
        send alone, so what storage reads again stays counted by the sending threads)."""
        lo, hi = self.manifest.chunk_span(index)
        touched = [full for full, fd, at, size, mtime in self.sources
                   if at < hi and lo < at + size and _sized(full, fd, size).st_mtime_ns != mtime]
        if touched and self.digest(self.view[lo:hi]) != self.manifest.chunks[index]:
            raise SourceError(f"chunk {index} no longer matches the manifest: {', '.join(touched)} {CHANGED}")
        return super().outgoing(index)

    def close(self) -> None:
        super().close()
        for _, fd, _, _, _ in self.sources:
            os.close(fd)
        self.sources = []
