"""Local copy: one download per host, however many local processes want the model.

A copy's folder has one lock, ``<copy>/.p2pw/lock`` (``flock``; the same file
``modelcache.CopyLock`` takes).  ``claim`` takes it without waiting:

- ``write``: we hold it exclusively: this process downloads the copy (a join);
  it holds it shared once the copy is complete (``share``).
- ``read``: the copy is complete (its marker matches); held shared, so the
  copy is not evicted while read.
- ``attach``: another local process holds it exclusively and is writing the
  copy.  We take no lock: we read what it verifies (``Attached``).

The writer publishes its progress beside the copy (``Progress``, a store
sink): ``.p2pw/manifest.json`` (the manifest, kept: a complete copy can be
read later without asking the swarm), ``.p2pw/chunks-RUN`` (one byte per
chunk, set to 1 once the chunk's verified bytes are in the files) and, last,
``.p2pw/attach.json`` (``{"run", "model_id", "pid"}``), removed when the
writer stops.  An attached reader maps the copy's files read-only (the writer's
``NAME.partial`` or, once final, ``NAME``: the same inode, so one page-cache
copy for every process) and the chunk bytes, and polls them: a chunk whose
byte is 1 is usable.  When the writer stops before the copy is complete, the
lock comes free and the reader's waits fail with ``WriterGone``; its caller
may claim the copy and resume it (the chunks on disk are verified again, never
fetched again).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import threading
import time

from ..errors import P2PError
from ..sources.manifest import Manifest, ManifestError
from .cache import PARTIAL, STATE_DIR, copy_paths, marker_matches, read_marker, remove_tree
from .paths import StateDir, read_state
from .store import FileMap, Store, StoreClosed

log = logging.getLogger("p2pw")

LOCK = "lock"
MANIFEST = "manifest.json"
POINTER = "attach.json"
CHUNKS = "chunks-"
POLL = 0.01  # seconds between looks at the writer's chunk bytes while none changed (doubling up to POLL_MAX)
POLL_MAX = 0.1
LIVENESS_EVERY = 0.5  # seconds between checks that the writer still holds the lock
WRITE_WAIT = 300.0  # how long a claim waits for the readers of a copy that is not complete to let go
PUBLISH_WAIT = 120.0  # how long a reader waits for a writer that holds the lock to publish (its handshake)


class WriterGone(P2PError):
    """The local process writing the copy stopped before it was complete."""


def _state(copy: str, *name: str) -> str:
    return os.path.join(os.path.abspath(copy), STATE_DIR, *name)


class CopyClaim:
    """This process's hold on a copy's lock: ``mode`` is ``write``, ``read`` or ``attach`` (no lock held)."""

    progress = None  # the writer's ``Progress`` once it publishes
    created = False  # the folder was made by this claim (removed again on release if nothing was written)

    def __init__(self, copy: str, mode: str, fd: int | None):
        self.copy, self.mode, self.fd = os.path.abspath(copy), mode, fd

    def publish(self, manifest: Manifest) -> "Progress":
        """As the writer: tell local readers about the copy, and each chunk as it is verified (a store sink)."""
        self.progress = Progress(self.copy, manifest)
        return self.progress

    def share(self) -> None:
        """The copy is complete: let readers in (a writer's hold becomes shared)."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            self.mode = "read"

    def release(self) -> None:
        """Stop publishing and let go (a folder this claim made, still empty, goes too)."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.fd is not None:
            if self.created and os.listdir(self.copy) == [STATE_DIR]:
                remove_tree(self.copy)
            os.close(self.fd)
            self.fd = None


def _open_lock(copy: str) -> int:
    """An fd of the copy's lock, made if missing (``StateDir``: no link followed)."""
    try:
        d = StateDir(copy)
    except OSError as e:  # a read-only mount of the copy (a pod reading its node's): flock needs no write
        if e.errno not in (errno.EROFS, errno.EACCES):
            raise
        d = StateDir(copy, create=False)
    with d:
        try:
            fd = d.open(LOCK, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES):
                raise
            fd = d.open(LOCK, os.O_RDONLY)
        return fd


def _lock_inode(copy: str) -> int | None:
    """The inode ``.p2pw/lock`` names now (None: gone, evicted)."""
    try:
        with StateDir(copy, create=False) as d:
            return d.inode(LOCK)
    except FileNotFoundError:
        return None


def _try(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def complete_copy(copy: str, model_id: str | None = None) -> Manifest | None:
    """The manifest of the complete copy under ``copy`` (of ``model_id`` if given: an id or a prefix), or None."""
    marker = read_marker(copy)
    if not marker or not isinstance(marker.get("model_id"), str):
        return None
    if model_id is not None and not marker["model_id"].startswith(model_id):
        return None
    manifest = _read_manifest(read_state(copy, MANIFEST), marker["model_id"])
    if manifest is None or not marker_matches(manifest, copy):
        return None
    return manifest


def _wait_to_write(fd: int, copy: str, model_id: str | None, wait: float) -> str:
    """``write`` once the readers of a copy that is not complete let go, ``read`` if it is complete meanwhile;
    P2PError (one line, the fd closed) after ``wait`` seconds."""
    deadline, delay = time.monotonic() + wait, POLL
    if wait > 0:
        log.warning("%s is held by a reader and not complete: waiting up to %g s to write it", copy, wait)
    while True:
        if _try(fd, fcntl.LOCK_EX):
            return "write"
        if complete_copy(copy, model_id) is not None and _try(fd, fcntl.LOCK_SH):
            return "read"
        if time.monotonic() >= deadline:
            os.close(fd)
            raise P2PError(f"{copy} is held by a reader and not complete"
                           f"{f': gave up waiting to write it after {wait:g} s' if wait > 0 else ''}")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def claim(copy: str, model_id: str | None = None, write_wait: float = WRITE_WAIT) -> CopyClaim:
    """Take the copy's lock without waiting for a writer: ``write``, ``read`` (complete) or ``attach``; where
    only readers hold a copy that is not complete, wait up to ``write_wait`` seconds for them to let go."""
    created = not os.path.exists(copy)
    try:
        os.makedirs(copy, exist_ok=True)
        while True:
            fd = _open_lock(copy)
            if _try(fd, fcntl.LOCK_EX):
                mode = "write"
                if complete_copy(copy, model_id) is not None:  # a complete copy nobody holds: read it
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    mode = "read"
            elif _try(fd, fcntl.LOCK_SH):  # only readers hold it
                mode = "read" if complete_copy(copy, model_id) is not None else None
                if mode is None:  # readers of a copy not complete (a seeder of it): write once they let go
                    mode = _wait_to_write(fd, copy, model_id, write_wait)
            else:
                os.close(fd)
                return CopyClaim(copy, "attach", None)
            if _lock_inode(copy) == os.fstat(fd).st_ino:  # not evicted under us
                break
            os.close(fd)
    except OSError as e:
        raise P2PError(f"cannot lock the copy in {copy}: {e.strerror or e}") from None
    if mode == "write":
        with StateDir(copy, create=False) as d:
            d.remove(POINTER)  # a writer that died left it: nobody writes under it now
    held = CopyClaim(copy, mode, fd)
    held.created = created
    return held


def writer_active(copy: str) -> bool:
    """Whether a process holds the copy's lock exclusively (writes it) now."""
    try:
        fd = _open_lock(copy)
    except (OSError, ValueError):  # (PathError: a linked state folder)
        return False
    try:
        return not _try(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


def _read_manifest(data: bytes | None, model_id: str | None) -> Manifest | None:
    try:
        return Manifest.from_json(data, expect_id=model_id) if data is not None else None
    except (ManifestError, ValueError):
        return None


class Progress:
    """The writer's side: publishes each verified chunk to local readers (a ``Store`` sink)."""

    def __init__(self, copy: str, manifest: Manifest):
        self.copy = os.path.abspath(copy)
        self.state = d = StateDir(copy)  # every name below is in this folder, no link followed
        for stale in d.names():
            if stale.startswith(CHUNKS):
                d.remove(stale)
        self.run = os.urandom(6).hex()
        self.name = CHUNKS + self.run
        self.path = os.path.join(d.path, self.name)
        fd = d.open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.ftruncate(fd, max(manifest.n_chunks, 1))
            self.bits = mmap.mmap(fd, max(manifest.n_chunks, 1))
        finally:
            os.close(fd)
        d.write(MANIFEST, manifest.to_json())
        d.write(POINTER, json.dumps({"run": self.run, "model_id": manifest.model_id, "pid": os.getpid()}))

    def put(self, index: int, data) -> None:
        self.bits[index] = 1

    def close(self) -> None:
        """Stop publishing (readers that attached keep their mapping, all ones if the copy is complete)."""
        d = self.state
        try:
            mine = json.loads(d.read(POINTER) or b"{}").get("run") == self.run
        except (ValueError, AttributeError):
            mine = False
        if mine:
            d.remove(POINTER)
        d.remove(self.name)
        d.close()
        self.bits.close()


def _open_file(path: str) -> int:
    """An fd of a copy's file under either of its names (the writer renames NAME.partial to NAME when final)."""
    for _ in range(3):
        for p in (path + PARTIAL, path):
            try:
                return os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
    raise P2PError(f"{path} is missing from the copy being written")


class _Nodeless:
    """What ``device.Loader`` asks of a node, for a copy read from disk: nothing is hashed here."""

    def __init__(self, store):
        self.fail = store.fail

    @staticmethod
    def digest(*_):
        return None


class Attached:
    """A local copy read from its files: complete (``claim`` said ``read``), or while another process writes
    it.  The ``Download`` surface a loader needs: ``wait_range``, ``wait``, ``iter_tensors``,
    ``wait_tensor``, ``state_dict``, ``stage_report``, ``progress``, ``close``."""

    attached = True
    loader = None

    def __init__(self, copy: str, model_id: str | None = None, device: str | None = None,
                 held: CopyClaim | None = None, publish_wait: float = PUBLISH_WAIT):
        self.started = time.monotonic()
        self.path = os.path.abspath(copy)
        self.lock = held
        if held is not None and held.mode == "read":
            self.manifest, self.bits_path = complete_copy(copy, model_id), None
            if self.manifest is None:
                raise P2PError(f"the copy in {copy} is no longer complete")
        else:
            self.manifest, self.bits_path = self._published(model_id, publish_wait)
        m = self.manifest
        fds = []
        try:
            for f, path in zip(m.files, copy_paths(m, self.path)):
                fds.append((_open_file(path) if f["size"] else -1, f["offset"], f["size"]))
            self.filemap = FileMap(m.total_size, [p for p in fds if p[2]], writable=False)
        except OSError as e:
            raise P2PError(f"cannot map the copy in {copy}: {e.strerror or e}") from None
        finally:
            for fd, _, _ in fds:
                fd >= 0 and os.close(fd)
        self.store = Store(m, self.filemap.buffer)
        if self.bits_path is None:
            self.store.hold_all()
            self.bits = None
        else:
            try:
                with open(self.bits_path, "rb") as f:
                    self.bits = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            except OSError:
                raise WriterGone(f"the process writing {copy} stopped as we attached") from None
        if device is not None:
            from .device import Loader  # torch: only for tensors

            self.loader = Loader(_Nodeless(self.store), self.store, device, self.started)
            if self.bits is None:
                for i in range(m.n_chunks):
                    self.loader.sink.put(i, None)
        self.closed = threading.Event()
        self.thread = None
        if self.bits is not None:
            self.thread = threading.Thread(target=self._follow, name="p2pw-attach", daemon=True)
            self.thread.start()

    def _published(self, model_id: str | None, wait: float) -> tuple[Manifest, str]:
        """The manifest and chunk-bytes path the writer published (it may still be handshaking)."""
        deadline = time.monotonic() + wait
        said = False
        while True:
            try:
                ptr = json.loads(read_state(self.path, POINTER) or b"")
                manifest = _read_manifest(read_state(self.path, MANIFEST), ptr["model_id"])
                bits = _state(self.path, CHUNKS + str(ptr["run"]))
                if manifest is not None and os.path.exists(bits):
                    if model_id is not None and not manifest.model_id.startswith(model_id):
                        raise P2PError(f"{self.path} is being written with model {manifest.model_id[:16]}, "
                                       f"not {model_id[:16]}: give another folder")
                    return manifest, bits
            except (OSError, ValueError, KeyError, TypeError):
                pass
            if not writer_active(self.path):
                raise WriterGone(f"the process writing {self.path} stopped before it published its progress")
            if time.monotonic() > deadline:
                raise P2PError(f"another process holds {self.path} but published nothing in {wait:g} s")
            if not said:
                log.warning("another process on this host is downloading into %s: attaching to it", self.path)
                said = True
            time.sleep(0.05)

    def _follow(self) -> None:
        """Mark chunks verified as the writer's bytes say; fail every wait if the writer stops short."""
        n, seen, delay = self.manifest.n_chunks, 0, POLL
        checked = time.monotonic()
        have = self.store.have
        while not self.closed.is_set():
            try:
                now_set = self.bits[:n]
            except ValueError:  # closed
                return
            fresh = [i for i in range(n) if now_set[i] and not have[i]] if now_set.count(1) != seen else []
            for i in fresh:
                self.store.verified(i)  # the loader's sink, if any, is one of the store's
            seen = now_set.count(1)
            if seen == n:
                return
            if fresh:
                delay = POLL
            else:
                if time.monotonic() - checked > LIVENESS_EVERY:
                    checked = time.monotonic()
                    if not writer_active(self.path):
                        if self.bits[:n].count(1) == seen:
                            self.store.fail(f"the process writing {self.path} stopped with {seen} of {n} chunks "
                                            "verified")
                            return
                        continue
                delay = min(delay * 2, POLL_MAX)
            self.closed.wait(delay)

    # ----- the Download surface -----------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    @property
    def progress(self) -> dict:
        elapsed = time.monotonic() - self.started
        return {"bytes": self.store.bytes, "total": self.manifest.total_size, "chunks": self.store.count,
                "n_chunks": self.manifest.n_chunks, "elapsed": elapsed,
                "rate": self.store.bytes / elapsed if elapsed > 0 else 0.0, "complete": self.store.complete}

    def _error(self) -> P2PError:
        e = self.store.error or "closed"
        return WriterGone(e) if "stopped" in e else P2PError(e)

    def wait_range(self, lo: int, hi: int, timeout: float | None = None) -> None:
        chunks = self.manifest.chunks_covering(lo, hi)
        try:
            ok = self.store.wait_chunks(chunks, timeout)
        except StoreClosed:
            raise self._error() from None
        if not ok:
            raise TimeoutError(f"bytes [{lo}, {hi}) of {self.path} not written after {timeout} s")

    def wait(self, timeout: float | None = None) -> None:
        self.wait_range(0, self.manifest.total_size, timeout)

    def _device(self):
        if self.loader is None:
            raise P2PError("tensors need a device: attach(..., device='cpu' or 'cuda:N')")
        return self.loader

    def wait_tensor(self, name: str, timeout: float | None = None):
        return self._device().wait_tensor(name, timeout)

    def iter_tensors(self, timeout: float | None = None):
        try:
            yield from self._device().iter_tensors(timeout)
        except P2PError:
            if self.store.error:
                raise self._error() from None
            raise

    def state_dict(self, timeout: float | None = None) -> dict:
        return self._device().state_dict(timeout)

    def stage_report(self) -> dict:
        return self._device().report()

    def close(self, linger: bool = False, timeout: float | None = None) -> None:
        """Stop following the writer and unmap (views handed out keep the mapping until dropped)."""
        self.closed.set()
        if self.thread is not None:
            self.thread.join(5)
        self.store.fail("closed")
        if self.loader is not None:
            self.loader.close()
        if self.bits is not None:
            self.bits.close()
        self.store.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def attach(copy: str, model_id: str | None = None, device: str | None = None) -> Attached:
    """Read the copy under ``copy`` from its files: at once if complete, else as the local process writing it
    verifies it.  P2PError if nobody writes it and it is not complete (``api.join`` fetches it then)."""
    held = claim(copy, model_id, write_wait=0)  # a copy its readers hold, not complete (being mended): P2PError
    if held.mode == "write":
        held.release()
        raise P2PError(f"{copy} holds no complete copy{' of model ' + model_id[:16] if model_id else ''} "
                       "and no process on this host is writing one: join the swarm to fetch it")
    return Attached(copy, model_id, device, held=held if held.mode == "read" else None)
