"""Cache: the checkpoint's files under ``out`` are the node's store, each made final as soon as it is verified.

Each file of the manifest's file table is preallocated under ``out`` as
``NAME.partial`` (free space is checked first: too little is one error and
nothing is written) and mapped shared at its blob offset (``store.FileMap``),
so children and readers are served from the files' page cache.  Each chunk
is verified in its network buffer and only then written into its files
(``pwrite``: see ``Store.write``), and the kernel writes the pages back.
With ``direct`` (a join with a ``ring.ChunkRing``) a verified chunk is
copied into a ring slot and written from there around the page cache
(``write_direct``: ``O_DIRECT``, only a file's last partial page through
the cache), so the copy never fills the page cache.  Not on a filesystem
in memory (tmpfs: /dev/shm, a Kubernetes ``emptyDir`` of ``medium:
Memory``), whose pages are the copy: ``O_DIRECT`` there is a copy into them
like ``pwrite``, and receiving into a slot first added one more (a 1 GiB
hop into /dev/shm took twice as long as without the ring, its loop thread
1.6 times the CPU).  Nothing copies the
bytes a second time, and no unverified byte reaches a file.  When every
chunk covering a file is verified, a finisher thread fsyncs it and renames
it to its final name (the blob layout puts small files first, so config and
tokenizer are final within the first chunks).  On the page-cache path it
also starts writeback of verified chunks as they come
(``sync_file_range``, 4 MiB at a time), so dirty pages never pile up (in a
small memory cgroup, on a small host) and the disk writes during the
transfer: measured on the 8-host bed (one shared disk), the last exit came
0.9-1.7 s after the last chunk instead of 2.0-2.4 s.
After the last file, ``out/.p2pw/complete.json`` (model id, files with
sizes and mtimes, bytes, time) is written atomically.  A file under its final
name is always complete.

Restarts: a join into ``out`` whose marker names this model, every file's
size and mtime unchanged, holds every chunk at once without re-hashing
(``verify="full"`` re-hashes anyway).  Otherwise the marker is removed first
and whatever an earlier run left (partial or final files) is re-hashed chunk
by chunk against the manifest; matching chunks are adopted, the rest fetched.
Everything p2pw keeps about a copy lives under ``out/.p2pw/`` (also
``progress.json`` while downloading: verified bytes and chunks, final files).
"""
from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import queue
import threading
import time

from ..errors import UserError
from ..sources.manifest import chunk_hasher
from ..sources.validate import STATE_DIR  # what p2pw keeps about a copy; a seeder never serves it
from .paths import PathError, StateDir, inside, read_state, write_text
from .readback import DIRECT_ALIGN, ChunkReads
from .store import FileMap, check_space

PARTIAL = ".partial"
MARKER = "complete.json"
PROGRESS = "progress.json"
VERIFY_MODES = ("marker", "full")
PROGRESS_EVERY = 1.0  # seconds between progress.json updates (each a temporary file and a rename: 3 ms of a
#                      join's CPU, which at every 0.25 s was a tenth of its Python time in a broadcast)
WRITE_BACK_EVERY = 4 << 20  # writeback of verified chunks is started every this many bytes (the last batch
#                             is what the final fsync waits for: eight joins on one disk wrote 16 MiB each then)
SYNC_FILE_RANGE_WRITE = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


class CacheError(UserError, OSError):
    """The local copy could not be written."""


def write_atomically(path: str, doc: dict, durable: bool = True) -> None:
    """Write ``doc`` as JSON to ``path`` by rename (fsynced, directory too, when ``durable``)."""
    write_text_atomically(path, json.dumps(doc, indent=1), durable)


def write_text_atomically(path: str, text: str, durable: bool = False) -> None:
    """Write ``text`` to ``path`` by rename from a temporary name of its own.

    The temporary name is unique, so processes sharing a directory (joiners
    sharing one model cache) never rename each other's half-written file.
    """
    d, base = os.path.split(os.path.abspath(path))
    fd, tmp = _create_unique(d, f".{base}.", ".tmp")
    try:
        write_text(fd, text, durable)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(d)


def _create_unique(directory: str, prefix: str, suffix: str) -> tuple[int, str]:
    """(fd, path) of a new file of our own in ``directory`` (``O_EXCL``, mode 0600): ``tempfile.mkstemp``'s
    contract without importing ``tempfile`` (with shutil, bz2 and lzma, 2 ms of every join's start-up)."""
    for _ in range(100):
        path = os.path.join(directory, f"{prefix}{os.urandom(6).hex()}{suffix}")
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary name in {directory}")


def remove_tree(path: str) -> None:
    """Remove a folder and whatever is left in it, errors ignored (shutil imported here: only a failed join
    or an eviction needs it, and with bz2 and lzma it would cost every join 2 ms of start-up)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_marker(out: str) -> dict | None:
    """The completion marker of the copy under ``out``, or None."""
    data = read_state(out, MARKER)
    try:
        doc = json.loads(data) if data is not None else None
        return doc if isinstance(doc, dict) else None
    except ValueError:
        return None


def copy_paths(manifest, out: str, names: list[str] | None = None) -> list[str]:
    """Absolute final path of each file of ``manifest`` in a copy under ``out`` (its name, or ``names[i]``)."""
    out = os.path.abspath(out)
    paths = []
    for i, f in enumerate(manifest.files):
        name = names[i] if names is not None else f["name"]
        try:
            path = inside(out, name)
        except PathError as e:
            raise CacheError(f"file name in the manifest: {e}") from None
        if os.path.relpath(path, out).split(os.sep)[0] == STATE_DIR:
            raise CacheError(f"file name {name!r} in the manifest is inside {STATE_DIR}/, which p2pw keeps for itself")
        paths.append(path)
    return paths


def marker_matches(manifest, out: str, paths: list[str] | None = None) -> bool:
    """Whether ``out`` holds a complete copy of ``manifest``: its marker names the model, and every file has the
    size and mtime the marker recorded (a stat per file; no byte is read)."""
    doc = read_marker(out)
    if not doc or doc.get("model_id") != manifest.model_id:
        return False
    recorded = {f.get("name"): f for f in doc.get("files", []) if isinstance(f, dict)}
    for f, path in zip(manifest.files, paths if paths is not None else copy_paths(manifest, out)):
        r = recorded.get(f["name"])
        try:
            st = os.stat(path)
        except OSError:
            return False
        if r is None or st.st_size != f["size"] or r.get("size") != f["size"] or r.get("mtime_ns") != st.st_mtime_ns:
            return False
    return True


MEMORY_FS = (0x01021994, 0x858458F6)  # statfs f_type of tmpfs and ramfs: a file's pages are its only copy


def memory_backed(path: str) -> bool:
    """Whether ``path`` (or, not made yet, its nearest existing parent) is on a filesystem kept in memory
    (tmpfs, ramfs: /dev/shm, an ``emptyDir`` with ``medium: Memory``), where the page cache is the copy
    itself: ``O_DIRECT`` there is one more memory copy, not a way around one."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in MEMORY_FS


def open_direct(paths: list[str]) -> dict[int, int]:
    """``paths`` opened for O_DIRECT writes (index -> fd); none where the filesystem refuses it (tmpfs)."""
    fds: dict[int, int] = {}
    try:
        for i, path in enumerate(paths):
            fds[i] = os.open(path, os.O_WRONLY | os.O_DIRECT)
        return fds
    except OSError as e:
        for fd in fds.values():
            os.close(fd)
        if e.errno != errno.EINVAL:
            raise
        return {}


def _pwrite_all(fd: int, view, at: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


class ChunkWrites:
    """Verified chunks written into a ``DiskCache``'s open files from any thread (the workers').  A file's fds
    stay open while a write uses them: ``release`` waits for those before the finisher closes them (a second
    copy of a chunk may still be written as the file becomes final)."""

    def __init__(self, cache: "DiskCache"):
        self.cache, self.cond = cache, threading.Condition()
        self.writing = [0] * len(cache.manifest.files)  # writes under way into file i
        self.stale: list[int] = []  # O_DIRECT fds given up (EINVAL), closed with the rest

    def pwrite(self, index: int, data) -> None:
        """Chunk ``index``'s bytes ``data`` into the files it covers, through the page cache."""
        for i, at, piece in self._pieces(index, data):
            fd, _ = self._enter(i)
            if fd is None:
                continue
            try:
                _pwrite_all(fd, piece, at)
            finally:
                self._leave(i)

    def direct(self, index: int, data) -> None:
        """Like ``pwrite``, from page-aligned memory, around the page cache: O_DIRECT on the 4 KiB grid,
        through the page cache only a file's unaligned end (a piece starts on the grid: chunks do, and the
        blob layout starts every file there)."""
        for i, at, piece in self._pieces(index, data):
            cut = (at + len(piece)) // DIRECT_ALIGN * DIRECT_ALIGN - at
            fd, direct_fd = self._enter(i)
            if fd is None:
                continue
            try:
                try:
                    _pwrite_all(fd if direct_fd is None else direct_fd, piece[:cut], at)
                except OSError as e:  # blocks larger than the grid: this file through the page cache from now on
                    if e.errno != errno.EINVAL or direct_fd is None:
                        raise
                    with self.cond:  # closed with the others: another writer may be using it now
                        if self.cache.direct_fds.get(i) == direct_fd:
                            self.stale.append(self.cache.direct_fds.pop(i))
                    _pwrite_all(fd, piece[:cut], at)
                _pwrite_all(fd, piece[cut:], at + cut)
            finally:
                self._leave(i)

    def _pieces(self, index: int, data):
        """``(file, offset in it, bytes)`` of chunk ``index`` (``data``) in each file it covers."""
        m = self.cache.manifest
        lo, hi = m.chunk_span(index)
        for i in self.cache.chunk_files[index]:
            o = m.files[i]["offset"]
            a, b = max(lo, o), min(hi, o + m.files[i]["size"])
            yield i, a - o, data[a - lo:b - lo]

    def _enter(self, i: int):
        """``(fd, O_DIRECT fd or None)`` of file ``i``, open until ``_leave(i)``; ``(None, None)`` once it is
        final (it holds every byte of its chunks: a second copy of one has nothing to write)."""
        with self.cond:
            fd = self.cache.fds.get(i)
            if fd is None:
                return None, None
            self.writing[i] += 1
            return fd, self.cache.direct_fds.get(i)

    def _leave(self, i: int) -> None:
        with self.cond:
            self.writing[i] -= 1
            if not self.writing[i]:
                self.cond.notify_all()

    def release(self, i: int):
        """File ``i``'s ``(fd, O_DIRECT fd)``, no longer the cache's, once no write uses them (to close)."""
        with self.cond:
            self.cond.wait_for(lambda: not self.writing[i])
            return self.cache.fds.pop(i, None), self.cache.direct_fds.pop(i, None)


class DiskCache:
    """The files of ``manifest`` under ``out`` as one mapped blob (``filemap``), finalised file by file."""

    def __init__(self, manifest, out: str, verify: str = "marker", on_error=None,
                 names: list[str] | None = None, direct: bool = False):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        self.manifest = manifest
        self.out = os.path.abspath(out)
        self.on_error = on_error
        self.on_finished = None  # called (on the finisher's thread) once every file is final and the marker written
        self.error: str | None = None
        # final names: each file's own name, or ``names`` (a Hugging Face cache's blobs/<etag>, see hfcache)
        self.paths = copy_paths(manifest, self.out, names)
        self.final = [False] * len(manifest.files)  # file i is under its final name
        self.fds: dict[int, int] = {}  # open while file i is not final
        # direct: the files are open for O_DIRECT too (``write_direct``, from a ring slot), where the filesystem
        # takes it, chunks start on its grid, and nothing was read through the page cache (no resume)
        self.direct = False
        self.reads: ChunkReads | None = None  # with direct: the files open for reading chunks back (``readback``)
        self.direct_fds: dict[int, int] = {}  # open while file i is not final
        self.writes = ChunkWrites(self)  # from worker threads: file i's fds stay open while a write uses them
        self.finished = threading.Event()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.resuming = False
        self.complete = False  # the marker matched: every chunk is on disk and final
        self.chunks_done = self.bytes_done = 0
        # writeback starts as chunks verify (``_write_back``), so dirty pages never fill memory and the disk
        # works during the transfer, not after it: each file's fsync, and the join's exit, then wait for little
        self.unflushed: list[int] = []  # verified, not yet handed to the finisher (``put``, on the loop)
        self.unflushed_bytes = 0
        self.left_total = manifest.n_chunks  # chunks not yet handed to the finisher
        self.thread: threading.Thread | None = None  # the finisher (none for a copy complete at the start)
        if verify == "marker" and self._marker_matches():
            self.complete = True
            self.final = [True] * len(manifest.files)
            self.filemap = self._map(os.O_RDONLY, writable=False)
            self.finished.set()
            return
        self.left = [len(manifest.chunks_covering(f["offset"], f["offset"] + f["size"])) for f in manifest.files]
        self.chunk_files: list[list[int]] = [[] for _ in range(manifest.n_chunks)]
        for i, f in enumerate(manifest.files):
            for c in manifest.chunks_covering(f["offset"], f["offset"] + f["size"]):
                self.chunk_files[c].append(i)
        # not in memory (tmpfs): O_DIRECT there copies like any write, and the ring slot would be one copy more
        in_memory = memory_backed(self.out)
        self._preallocate(direct and manifest.chunk_size % DIRECT_ALIGN == 0 and not in_memory, allocate=not in_memory)
        self.thread = threading.Thread(target=self._run, name="p2pw-finish", daemon=True)
        self.thread.start()
        for i, n in enumerate(self.left):
            if n == 0:  # an empty file: complete already
                self.queue.put(("file", i))

    # ----- start: the marker, free space, preallocation, the mapping ---------

    def _marker_matches(self) -> bool:
        return marker_matches(self.manifest, self.out, self.paths)

    def _preallocate(self, direct: bool, allocate: bool = True) -> None:
        """Check the free space, then create (or reopen) every file at its full size, blocks allocated (with
        ``allocate``).  Not on a filesystem in memory: allocating there is clearing every page, on this thread,
        before the first byte is asked for (0.18 s per GiB here: half a minute for a 140 GB model), while a
        write into a hole takes the page it fills on the thread that writes it, as the bytes arrive.  Except
        to resume: ``recover`` reads every chunk through the mapping, and a read there takes the page too,
        where no free page is a SIGBUS rather than an error."""
        needed = 0
        for f, path in zip(self.manifest.files, self.paths):
            for p in (path + PARTIAL, path):
                if os.path.exists(p):
                    self.resuming = True
                    needed += max(f["size"] - os.stat(p).st_blocks * 512, 0)
                    break
            else:
                needed += f["size"]
        check_space(self.out, needed, f"model {self.manifest.model_id[:16]}")
        with StateDir(self.out) as d:  # a new join into out starts (a linked .p2pw/: refused, nothing written)
            d.remove(MARKER)
        created = []
        try:
            for i, path in enumerate(self.paths):
                if os.path.exists(path) and not os.path.exists(path + PARTIAL) and \
                        os.stat(path).st_size != self.manifest.files[i]["size"]:
                    os.replace(path, path + PARTIAL)  # a final name is never changed before it is verified
                if os.path.exists(path) and not os.path.exists(path + PARTIAL):
                    self.final[i] = True  # from an earlier run: re-verified by recover()
                    name = path
                else:
                    name = path + PARTIAL
                    if not os.path.exists(name):
                        created.append(name)
                os.makedirs(os.path.dirname(name), exist_ok=True)
                fd = self.fds[i] = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
                size = self.manifest.files[i]["size"]
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                if size and (allocate or self.resuming):
                    os.posix_fallocate(fd, 0, size)
            if direct and not self.resuming:
                self.direct_fds = open_direct([p + PARTIAL for p in self.paths])
                self.direct = bool(self.direct_fds)
                if self.direct:  # what the ring no longer holds is read back from here to be served
                    self.reads = ChunkReads(self.manifest, [p + PARTIAL for p in self.paths], self.chunk_files)
            self.filemap = FileMap(self.manifest.total_size,
                                   [(self.fds[i], f["offset"], f["size"]) for i, f in enumerate(self.manifest.files)],
                                   writable=True)
            if self.direct:  # no read-ahead through the mapping: it would cache what O_DIRECT is yet to write
                self.filemap.buffer.madvise(mmap.MADV_RANDOM)
        except OSError as e:
            self.close()
            for name in created:
                self._remove(name)
            raise CacheError(f"cannot create the local copy under {self.out}: {e.strerror or e}") from None

    def _map(self, flags: int, writable: bool) -> FileMap:
        fds = []
        try:
            for f, path in zip(self.manifest.files, self.paths):
                fds.append((os.open(path, flags | os.O_NOFOLLOW), f["offset"], f["size"]))
            return FileMap(self.manifest.total_size, fds, writable=writable)
        except OSError as e:
            raise CacheError(f"cannot map the copy under {self.out}: {e.strerror or e}") from None
        finally:
            for fd, _, _ in fds:
                os.close(fd)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def recover(self, store) -> list[int]:
        """Chunks an earlier run left in the files (already in ``store``, which maps them) whose hash matches.

        A file found under its final name that does not fully match goes back to ``NAME.partial``.
        """
        if self.complete:
            return list(range(self.manifest.n_chunks))
        if not self.resuming:
            return []
        digest = chunk_hasher(self.manifest.hash)
        found = [i for i in range(self.manifest.n_chunks) if digest(store.chunk(i)) == self.manifest.chunks[i]]
        ok = set(found)
        for i, path in enumerate(self.paths):
            if self.final[i] and not all(c in ok for c in self.chunk_files_of(i)):
                if os.path.exists(path):
                    os.replace(path, path + PARTIAL)
                self.final[i] = False
        return found

    def chunk_files_of(self, i: int) -> range:
        f = self.manifest.files[i]
        return self.manifest.chunks_covering(f["offset"], f["offset"] + f["size"])

    # ----- while downloading (put is called on the node's loop) -------------

    def write_chunk(self, index: int, data) -> None:
        """Write chunk ``index``'s verified bytes ``data`` into the files it covers (``Store.land``; any thread)."""
        self.writes.pwrite(index, data)

    def write_direct(self, index: int, data) -> None:
        """The same from page-aligned memory (a ring slot), around the page cache (``ChunkWrites.direct``)."""
        self.writes.direct(index, data)

    def put(self, index: int, data: memoryview) -> None:
        """Chunk ``index`` is verified (its bytes are already in the mapped files): count it, finish files."""
        if self.complete:
            return
        self.chunks_done += 1
        self.bytes_done += len(data)
        self.unflushed.append(index)  # handed to the finisher WRITE_BACK_EVERY bytes at a time, not per chunk:
        self.unflushed_bytes += len(data)  # each hand-over wakes its thread, which takes the GIL from the loop
        if self.unflushed_bytes >= WRITE_BACK_EVERY or len(self.unflushed) >= self.left_total:
            self.left_total -= len(self.unflushed)
            self.queue.put(("chunks", self.unflushed))
            self.unflushed, self.unflushed_bytes = [], 0
        for i in self.chunk_files[index]:
            self.left[i] -= 1
            if self.left[i] == 0:
                self.queue.put(("file", i))

    def _run(self) -> None:
        files_left = len(self.manifest.files)
        last_progress = 0.0
        try:
            while files_left:
                try:  # woken by the next item or when progress.json is due, whichever comes first
                    item = self.queue.get(timeout=max(0.0, last_progress + PROGRESS_EVERY - time.monotonic()))
                except queue.Empty:
                    item = ("tick", 0)
                if item is None:
                    return
                kind, n = item
                if kind == "chunks" and not self.direct:  # (direct: only files' last pages are cached)
                    self._write_back(n)
                elif kind == "file":
                    self._finish_file(n)
                    files_left -= 1
                now = time.monotonic()
                if files_left and now - last_progress >= PROGRESS_EVERY:
                    last_progress = now
                    self._progress()
            self._write_marker()
        except (OSError, PathError) as e:
            self.error = f"finishing the local copy under {self.out} failed: {getattr(e, 'strerror', None) or e}"
            if self.on_error:
                self.on_error(self.error)
            return
        self.close(reads=False)  # chunks are still read back to be served while the node stays
        self.finished.set()
        if self.on_finished:
            self.on_finished()

    def _write_back(self, chunks: list[int]) -> None:
        """Start writeback (not waiting for it) of verified ``chunks`` (WRITE_BACK_EVERY bytes of them)."""
        ranges: dict[int, list[list[int]]] = {}  # file -> merged [a, b) ranges in file offsets
        for index in sorted(chunks):
            lo, hi = self.manifest.chunk_span(index)
            for i in self.chunk_files[index]:
                f = self.manifest.files[i]
                a, b = max(lo, f["offset"]) - f["offset"], min(hi, f["offset"] + f["size"]) - f["offset"]
                spans = ranges.setdefault(i, [])
                if spans and spans[-1][1] == a:
                    spans[-1][1] = b
                elif b > a:
                    spans.append([a, b])
        for i, spans in ranges.items():
            fd = self.fds.get(i)
            for a, b in spans if fd is not None else ():
                _libc.sync_file_range(fd, a, b - a, SYNC_FILE_RANGE_WRITE)

    def _finish_file(self, i: int) -> None:
        """Every chunk of file ``i`` is verified: fsync it and give it its final name (once no writer holds its
        fds: a second copy of a chunk may still be written by a worker)."""
        fd, direct_fd = self.writes.release(i)
        if direct_fd is not None:
            os.close(direct_fd)
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if not self.final[i]:
            if os.path.exists(self.paths[i] + PARTIAL) or not os.path.exists(self.paths[i]):
                os.replace(self.paths[i] + PARTIAL, self.paths[i])  # (an empty file may share its path: done once)
            self.final[i] = True
            fsync_dir(os.path.dirname(self.paths[i]))

    def _progress(self) -> None:
        m = self.manifest
        with StateDir(self.out) as d:
            d.write(PROGRESS, json.dumps({
                "model_id": m.model_id, "bytes": self.bytes_done, "total": m.total_size, "chunks": self.chunks_done,
                "n_chunks": m.n_chunks, "files_final": sum(self.final), "files": len(m.files)}, indent=1))

    def _write_marker(self) -> None:
        m = self.manifest
        files = [{"name": f["name"], "size": f["size"], "mtime_ns": os.stat(p).st_mtime_ns}
                 for f, p in zip(m.files, self.paths)]
        with StateDir(self.out) as d:
            d.write(MARKER, json.dumps({"model_id": m.model_id, "files": files,
                                        "bytes": sum(f["size"] for f in m.files), "time": time.time()}, indent=1),
                    durable=True)
            d.remove(PROGRESS)

    def close(self, reads: bool = True) -> None:
        """Stop the finisher (if running) and close the files (``reads``: those open for reading back too); the
        mapping belongs to the store."""
        if not self.finished.is_set() and self.thread is not None and threading.current_thread() is not self.thread:
            self.queue.put(None)
            self.thread.join(5)
        with self.writes.cond:
            for fd in [*self.fds.values(), *self.direct_fds.values(), *self.writes.stale]:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.fds.clear()
            self.direct_fds.clear()
            self.writes.stale.clear()
        if reads and self.reads is not None:
            self.reads.close()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every file is complete under its final name and the marker is written."""
        return self.finished.wait(timeout)
