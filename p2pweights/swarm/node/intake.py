"""Intake: what the loop does with a chunk received, and with the verdict on it.

``PartnerHandlers.on_chunk`` (``pulled``) takes a chunk's frame off the wire (no copy) and hands
it here.  A copy of a chunk already being checked waits behind it (the first
that verifies wins; the others are dropped unwritten).  Otherwise it takes a
free ring slot, where the store has a ring, and goes to the workers
(``storage.workers``), which hash it and write it only if it matches (with
the pool full, the loop first waits for a verdict; with no workers it checks
the chunk itself).  On the verdict, on
the loop: the pull scheduler hears of it, and a verified chunk is published
(held, announced, sent to whoever waits on it) while a bad one is dropped,
counted and fetched again.  Every state change stays on the loop.
"""
from __future__ import annotations

import logging

from ...storage.workers import ChunkWorkers, Job, Read

log = logging.getLogger("p2pw")

MAX_BAD_FROM_PARENT = 4  # chunks failing verification before a partner is given up


class Intake:
    """Received chunks of one node (its loop thread only), checked by ``workers`` threads."""

    def __init__(self, node, workers: int = 0):
        self.node = node
        self.pool = ChunkWorkers(node.store, workers, wake=lambda: node.post(b"checked"))
        self.waiting: dict[int, list[Job]] = {}  # chunk being checked -> later copies of it, in arrival order
        self.on_loop = 0  # jobs checked on the loop (no workers)

    def arrived(self, rank: int, index: int, frame) -> None:
        """Chunk ``index`` came from partner ``rank`` in ``frame`` (a ZeroMQ frame, or a buffer)."""
        job = Job(index, rank, frame, getattr(frame, "buffer", frame))
        later = self.waiting.get(index)
        if later is not None:
            later.append(job)
            return
        self.waiting[index] = []
        self._start(job)

    def busy(self, index: int) -> bool:
        """Whether a copy of chunk ``index`` is being checked."""
        return index in self.waiting

    def _start(self, job: Job) -> None:
        store = self.node.store
        while self.pool.full:  # asleep until a worker is done with one: the loop does no byte work
            for done in self.pool.wait():
                self._done(done)
        if store.ring is not None:
            lo, hi = store.manifest.chunk_span(job.index)
            job.slot, job.into = store.ring.take(hi - lo)
        if not self.pool.submit(job):
            self.on_loop += 1
            self.verdict(self.pool.check(job))

    def checked(self) -> None:
        """The workers have verdicts (a wake on the inbox): act on each."""
        for job in self.pool.take():
            self._done(job)

    def _done(self, job) -> None:
        """A worker is done with ``job``: a chunk checked, or one read back to be sent (``forward``)."""
        if type(job) is Read:
            self.node.forwarding.done(job)
        else:
            self.verdict(job)

    def verdict(self, job: Job) -> None:
        """``job`` was checked: publish its chunk, or drop it and try its next copy or another holder."""
        n, index, rank = self.node, job.index, job.rank
        held = n.store.has(index)  # published meanwhile by another path (an origin read)
        if job.slot is not None:
            if job.ok and not held:
                n.store.ring.hold(job.slot, index)
            else:
                n.store.ring.release(job.slot)
        n.store.write_seconds += job.seconds
        if job.error is not None:
            n._fail(f"writing chunk {index} into the local copy failed: {job.error}")
            return
        later = self.waiting.pop(index, [])  # copies that arrived while this one was checked
        link = n.pull.links.get(rank)  # None: given up meanwhile (its requests went back then)
        planned = n.pull.plan[index % n.pull.stripes]
        if link is not None:
            n.pull.arrived(rank, index, job.ok)
        if job.ok:
            n.stats.duplicates += len(later) + held
            if not held:
                n.stats.switches += planned != rank
                if n.stats.arrivals is not None:
                    n.stats.arrivals.append((n.clock(), index, rank, planned))  # when it verified
                n.publish(index)
            return
        self._bad(job, link)
        if later and not n.store.has(index):  # the next copy is checked now
            self.waiting[index] = later[1:]
            self._start(later[0])
        else:
            n.stats.duplicates += len(later)

    def _bad(self, job: Job, link) -> None:
        n = self.node
        n.stats.bad_chunks += 1
        partner = n.partners.links.get(job.rank)
        if partner is not None:
            n.stats.bad_from[partner.addr] = n.stats.bad_from.get(partner.addr, 0) + 1
        log.warning("chunk %d from partner rank %d failed verification (%d bytes): dropped, fetching it again",
                    job.index, job.rank, job.got)
        if link is not None and link.bad >= MAX_BAD_FROM_PARENT:
            n.partners.give_up(job.rank, f"sent {link.bad} chunks that failed verification")

    def close(self) -> None:
        self.pool.close()
