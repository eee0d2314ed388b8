"""Workers: received chunks verified and written by a few threads, off the event loop.

The loop receives a chunk's frame (ZeroMQ's buffer, no copy) and hands it
here as a ``Job``; a worker hashes it against the manifest and, only where
it matches, puts the bytes where they belong (``Store.land``: the blob, a
ring slot and from there the files around the page cache, or the files by
``pwrite``).  Then it hands the job back: ``take`` on the loop, which alone
marks the chunk held, announces it and serves it.  Nothing unverified is
written, and a verified chunk is written before the loop hears of it.
xxh3, ``pwrite`` and the copy (``store.copy_into``) run outside the GIL, so
the workers use cores beside the loop's.

At most ``limit`` jobs are in flight (queued or being worked on): with that
many, the loop waits for one to be done (``wait``, asleep) before it hands
over the next, so the queue never grows and the loop spends no CPU on
bytes; the frames it has not taken yet stay in ZeroMQ's queues, within the
credit windows that let them be sent.  With no threads every job is done on
the loop (``check``), as before the pool.

The workers also read verified chunks back from the files into ring slots
for the loop to send (``Read``, ``swarm.node.forward``): a chunk served after its
slot was reused costs the loop nothing, and libzmq's I/O thread no page
faults.
"""
from __future__ import annotations

import os
import queue
import threading

from ..sources.manifest import chunk_hasher

MAX_WORKERS = 4  # the default pool's size on a host with many cores (``default_workers``)


def default_workers(cores: int | None = None) -> int:
    """Worker threads for a host with ``cores`` usable cores (this process's): ``P2PW_WORKERS`` if set, else none
    on 1-2 cores (the loop verifies and writes: the workers would take the cores of the loop and of libzmq's I/O
    thread), else ``min(MAX_WORKERS, cores - 1)``."""
    env = os.environ.get("P2PW_WORKERS", "")
    if env.strip().isdigit():
        return int(env)
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return 0 if cores <= 2 else min(MAX_WORKERS, cores - 1)


def in_flight_limit(threads: int) -> int:
    """Jobs that may be in flight at once with ``threads`` workers (each may hold a ring slot): enough that
    every worker has the next one queued."""
    return 2 * threads + 2 if threads else 0


class Job:
    """One received copy of chunk ``index`` from partner ``rank``: its bytes (``frame``'s), the ring slot to
    land in (``slot``, its view ``into``) if any; ``ok``, ``error`` and ``seconds`` (CPU seconds the write
    took) once checked."""

    __slots__ = ("index", "rank", "frame", "data", "got", "slot", "into", "ok", "error", "seconds")

    def __init__(self, index: int, rank, frame, data):
        self.index, self.rank, self.frame, self.data = index, rank, frame, data
        self.got = len(data)
        self.slot = self.into = None
        self.ok, self.error, self.seconds = False, None, 0.0


class Read:
    """Verified chunk ``index``, asked for by ``ident``, to be read back from the files into ``into`` (ring
    ``slot``'s view) to be sent; ``ok`` and ``error`` once read."""

    __slots__ = ("index", "ident", "slot", "into", "ok", "error", "data", "frame")

    def __init__(self, index: int, ident: bytes, slot: int, into):
        self.index, self.ident, self.slot, self.into = index, ident, slot, into
        self.ok, self.error, self.data, self.frame = False, None, None, None


class ChunkWorkers:
    """``threads`` workers checking and landing ``store``'s chunks; ``wake()`` (from a worker) tells the loop
    there are jobs to ``take``."""

    def __init__(self, store, threads: int, wake=None, limit: int | None = None):
        self.store, self.wake, self.size = store, wake, threads
        self.digest, self.hashes = chunk_hasher(store.manifest.hash), store.manifest.chunks
        self.limit = limit if limit is not None else in_flight_limit(threads)
        self.in_flight = 0  # submitted and not yet taken back (the loop's count)
        self.waits = 0  # times the loop waited for a worker (``wait``)
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.woken = False  # a wake is on its way to the loop: the next done job need not send another
        self.threads = [threading.Thread(target=self._run, name=f"p2pw-worker-{k}", daemon=True)
                        for k in range(threads)]
        for t in self.threads:
            t.start()

    @property
    def full(self) -> bool:
        """Whether ``limit`` jobs are in flight (``wait`` before the next ``submit``)."""
        return bool(self.threads) and self.in_flight >= self.limit

    def submit(self, job: Job) -> bool:
        """Hand ``job`` to a worker; False if there are none (the caller ``check``s it itself)."""
        if not self.threads:
            return False
        self.in_flight += 1
        self.todo.put(job)
        return True

    def check(self, job: Job) -> Job:
        """Verify ``job``'s bytes and, if they match, land them (any thread); the frame is let go."""
        data, size = job.data, self.store.manifest.chunk_span(job.index)
        job.ok = job.got == size[1] - size[0] and self.digest(data) == self.hashes[job.index]
        if job.ok:
            try:
                job.seconds = self.store.land(job.index, data, job.into)
            except OSError as e:
                job.ok, job.error = False, e.strerror or str(e)
        job.data = job.frame = None
        return job

    def read(self, job: Read) -> Read:
        """Read ``job``'s chunk back from the files into its slot (any thread; ``readback``)."""
        try:
            self.store.files.reads.read(job.index, job.into)
            job.ok = True
        except OSError as e:
            job.error = e.strerror or str(e)
        return job

    def take(self) -> list[Job]:
        """Jobs checked since the last call, in the order they were done (the loop's thread)."""
        self.woken = False  # before draining: a job done after this sends a wake of its own
        out, done = [], self.done
        while not done.empty():  # the loop alone takes: not empty, so the get finds one
            out.append(done.get_nowait())
        self.in_flight -= len(out)
        return out

    def wait(self, timeout: float = 60.0) -> list[Job]:
        """Jobs done, at least one if any is in flight: asleep until a worker finishes one (the loop's thread,
        with the pool ``full``); RuntimeError if none does within ``timeout`` seconds."""
        out = self.take()
        if out or not self.in_flight:
            return out
        self.waits += 1
        try:
            out.append(self.done.get(timeout=timeout))  # a worker hands back every job it takes, errors too
        except queue.Empty:
            raise RuntimeError(f"no worker finished a chunk in {timeout:g} s") from None
        self.in_flight -= 1
        return out + self.take()

    def _run(self) -> None:
        _name_self(threading.current_thread().name)
        while (job := self.todo.get()) is not None:
            try:
                self.read(job) if type(job) is Read else self.check(job)
            except Exception as e:  # a bug: the loop fails the download with it rather than lose the job
                job.ok, job.error, job.data, job.frame = False, f"internal error: {e!r}", None, None
            self.done.put(job)
            if not self.woken:
                self.woken = True
                if self.wake is not None:
                    self.wake()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers once the jobs queued are done (their results are not taken)."""
        for _ in self.threads:
            self.todo.put(None)
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout)
        self.threads = []


def _name_self(name: str) -> None:
    """Name the calling thread as ``top`` and /proc show it (``Download.threads`` counts ``p2pw-worker*``)."""
    try:
        with open("/proc/thread-self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
