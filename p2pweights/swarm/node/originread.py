"""Origin reader: a member's reading of its share of the origin, on a thread of its own.

The tracker hands an origin reader shares of the chunks nobody holds yet
(SHARE).  This thread reads each chunk of them that the store does not hold
from the origin (``source.BlobSource``, ``objstore.S3Source``: anything with
``read_chunks``; an object store's reader asks for two ranged GETs' worth of
consecutive chunks at a time, each GET a run of them) into a buffer of its
own, verifies each chunk against the manifest,
and hands it to the loop (``b"origin"`` on the inbox), which writes it into
the store (unless a peer's copy came first), publishes it (partners hear of
it at once and parked requests are served) and reports it to the tracker
(READ).  Nothing read is written, forwarded or shown before its hash matched,
and the store keeps one writer: the loop.  A member that pulls and reads a
chunk whole that is not the manifest's fails: the manifest is not the origin's,
so the swarm's copy of that chunk is not taken instead.

With the tracker away (silent a few seconds: killed, evicted, restarting), no
share comes; the loop then asks this thread for its part of what no live
partner holds (``back_to_source``, by ``policy.backtosource``), so downloads go
on; once the tracker speaks again its shares rule, and each chunk is asked of
the origin once per host either way.
"""
from __future__ import annotations

import logging
import queue
import struct
import threading

import zmq

from ...sources.manifest import chunk_hasher
from ..policy.backtosource import BackToSource, tracker_away
from ..policy.link import held_by

log = logging.getLogger("p2pw")

READY = struct.Struct("<I?")  # reader -> loop: chunk index, matched the manifest (as ``handlers.READY``)
GROUP = 4  # chunks read at once from a source that reads one at a time (a parallel one reads its concurrency)
RUNS = 2  # ranged GETs in flight per reader where a source reads runs of consecutive chunks (``range_size``)
FALLBACK_INTERVAL = 0.5  # seconds between looks at what to read while the tracker is away


class OriginReader:
    """Reads shares of ``manifest``'s chunks from ``source``; ``on_ready(index, ok)`` from its thread."""

    def __init__(self, source, manifest, has, on_ready, on_exit=None):
        self.source, self.manifest, self.has, self.on_ready, self.on_exit = source, manifest, has, on_ready, on_exit
        self.digest = chunk_hasher(manifest.hash)
        per_run = getattr(source, "range_size", 0) // manifest.chunk_size  # chunks one ranged GET reads
        self.group = RUNS * per_run if per_run > 1 else max(1, getattr(source, "concurrency", GROUP))
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.ready: dict[int, memoryview] = {}  # read and verified, not yet taken by the loop
        self.mismatched: set[int] = set()  # read whole, and not the manifest's hash (not merely unreadable)
        self.stopping = False
        self.fallback = BackToSource(manifest.n_chunks)  # what we read while the tracker is away
        self.next_fallback, self.away = 0.0, False  # (away: reading back to source since the tracker went silent)
        self.thread = threading.Thread(target=self._run, name="p2pw-origin", daemon=True)
        self.thread.start()

    @property
    def bytes_read(self) -> int:
        """Bytes this source read from the origin (all readers of one ``S3`` client count together)."""
        return self.source.bytes_read

    def share(self, chunks) -> None:
        """Read ``chunks`` (the loop's thread: from a SHARE, or back to source)."""
        chunks = self.fallback.first_asks(chunks)  # (one asked back to source meanwhile is in flight)
        if chunks:
            self.requests.put(chunks)

    def take(self, index: int):
        """The verified bytes of chunk ``index``, once (the loop's thread)."""
        return self.ready.pop(index, None)

    def stop(self) -> None:
        self.stopping = True
        self.requests.put(None)

    def _run(self) -> None:
        try:
            while (todo := self.requests.get()) is not None:
                todo = [i for i in todo if not self.has(i)]
                for k in range(0, len(todo), self.group):
                    if self.stopping:
                        return
                    self._read(todo[k:k + self.group])
        finally:
            if self.on_exit:
                self.on_exit()

    def _read(self, chunks: list[int]) -> None:
        spans = {i: self.manifest.chunk_span(i) for i in chunks}
        bufs: dict[int, memoryview] = {}  # chunk -> where it is read (its own buffer, or a slice of its run's)

        def span_of(lo: int, hi: int) -> memoryview:
            """A run of consecutive chunks lands in one buffer, each chunk's bytes a slice of it (no copy out)."""
            run = memoryview(bytearray(hi - lo))
            for i, (a, b) in spans.items():
                if lo <= a and b <= hi:
                    bufs[i] = run[a - lo: b - lo]
            return run

        def view_of(i: int) -> memoryview:
            if i not in bufs:
                a, b = spans[i]
                bufs[i] = memoryview(bytearray(b - a))
            return bufs[i]

        hashed: set[str] = set()  # every hash the source took of what it read (a chunk it could not read has none)

        def digest(view) -> str:
            h = self.digest(view)
            hashed.add(h)
            return h

        for i, ok in self.source.read_chunks(self.manifest, chunks, view_of, digest, span_of=span_of):
            if ok:
                self.ready[i] = bufs[i]
            elif i in bufs and self.digest(bufs[i]) in hashed:
                self.mismatched.add(i)
            self.on_ready(i, ok)


def attach(node, source) -> None:
    """Make ``node`` an origin reader of ``source``: the shares the tracker hands it are read from there."""
    tx = node.ctx.socket(zmq.PUSH)  # used (and closed) only by the reader's thread from here on
    tx.setsockopt(zmq.LINGER, 0)
    tx.connect(node.inbox_addr)
    node.origin = OriginReader(source, node.manifest, node.store.has,
                               lambda i, ok: tx.send_multipart([b"origin", READY.pack(i, ok)]), on_exit=tx.close)


def back_to_source(node, now: float) -> None:
    """The tracker away: read what no live partner holds, our part of it by ``backtosource``'s split (the
    loop's thread, at its timers); nothing while the tracker speaks (its shares rule)."""
    origin, member = node.origin, node.member
    if origin is None or member is None or node.store.complete or now < origin.next_fallback:
        return
    if not tracker_away(member.heard, now, member.tracker_timeout):
        origin.away = False
        return
    origin.next_fallback = now + FALLBACK_INTERVAL
    links = node.pull.links
    known = node.pull.have | held_by(links, besides=())
    readers = list(links)  # any partner may read the origin (a plan sent before it said so names none)
    if not origin.away:
        origin.away = True
        log.warning("tracker %s silent for %.0f s: reading what no partner holds from the origin ourselves, "
                    "our part of it among %d reader(s)", member.addr, now - member.heard, len(readers) + 1)
    todo = origin.fallback.reads(node.rank, readers, known)
    if todo:
        log.info("reading %d chunk(s) from the origin (first %s)", len(todo), todo[:8])
        origin.requests.put(todo)


def landed(node, index: int, ok: bool) -> None:
    """Chunk ``index`` of ``node``'s share was read from the origin (``ok``: it matched the manifest), on the
    loop: into the store unless a peer's copy came first, published, reported to the tracker."""
    data = node.origin.take(index) if node.origin is not None else None
    if not ok and node.partners.pulls and node.origin is not None and index in node.origin.mismatched:
        node._fail(f"chunk {index} read from the origin is not the manifest's (its hash differs): the manifest "
                   "is not the origin's; not taking it from peers either (give --model-id ID of the origin's)")
        return
    if not ok or data is None:
        if node.origin is not None:
            node.origin.fallback.failed(index)
        log.error("chunk %d read from the origin does not match the manifest (or could not be read): not "
                  "serving it", index)
        return
    store = node.store
    if not store.has(index):
        try:
            if store.writable and store.in_place:
                store.chunk(index)[:] = data
            elif store.writable:
                store.write(index, memoryview(data))
        except OSError as e:
            node._fail(f"writing chunk {index} into the local copy failed: {e.strerror or e}")
            return
        node.stats.origin_chunks += 1
        node.publish(index)
    if node.member is not None:
        node.member.read(index)
