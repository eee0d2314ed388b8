"""Forward: chunks sent to partners; those no ring slot holds any more read back by the workers first.

``send`` hands a chunk's bytes to ZeroMQ without a copy (a send from a ring
slot pins it until ZeroMQ lets go), on the partner's link or one of its
lanes (``lanes``), in turn.  A request for a verified chunk whose
slot was reused goes to the workers as a ``workers.Read`` into a free slot,
taken now and kept taken until the loop, told on its inbox that the read is
done, sends from it: nothing else lands in it meanwhile.  A send that would
block waits here, first in line for its partner; one to a partner gone
meanwhile is dropped.  With no workers, no free slot, or the pool full, the
chunk is read back on the loop as it is sent (``Store.outgoing``).  Loop
thread only.
"""
from __future__ import annotations

import logging
from collections import deque

from ...sources.source import SourceError
from ...storage.workers import Read
from ...wire import protocol

log = logging.getLogger("p2pw")


class Forwarding:
    """The read-backs of ``node``'s store under way (``reading``) and read, waiting to be sent (``ready``)."""

    def __init__(self, node):
        self.node = node
        self.reading = 0
        self.ready: deque = deque()  # (ident, index, slot) read, not yet sent
        self.also: dict[int, list[bytes]] = {}  # chunk being read back -> other partners that asked for it meanwhile

    def send(self, ident: bytes, index: int) -> bool:
        """Send chunk ``index`` to ``ident``, or have the workers read it back first; False if it would block
        (try again later)."""
        if self.read_ahead(ident, index):
            return True
        try:
            slot, data = self.node.store.outgoing(index)
        except SourceError as e:  # a seeder's file changed under it: it ends, no peer gets those bytes
            self.node._fail(str(e))
            return True
        return self.send_data(ident, index, slot, data)

    def send_data(self, ident: bytes, index: int, slot, data) -> bool:
        """Send chunk ``index``'s bytes ``data`` (ring ``slot``'s, which the send pins, or None) to ``ident``;
        False if it would block."""
        n = self.node
        if n.faults is not None and (data := n.faults.outgoing(index, data)) is None:
            return True  # dropped by an injected fault
        if sent := self._out(ident, protocol.chunk_header(index), data, track=slot is not None):
            if slot is not None:
                n.store.ring.pin(slot, sent)
            n.stats.chunks_sent += 1
            n.stats.bytes_sent += len(data)
            n.serve.sent(index)
            return True
        return ident not in n.children  # gone: nothing to retry

    def _out(self, ident: bytes, header: bytes, data, track: bool):
        """Hand a chunk (``header``, ``data`` without a copy) to ZeroMQ for child ``ident``, on its link or one of
        its lanes (``lanes``): the next in turn first, one whose queue is full passed; as ``Node._send``, False
        where every one is full."""
        n = self.node
        for path in n.lanes.order(ident):
            if sent := n._send(path, header, data, copy=False, track=track):
                n.lanes.took(ident, path)
                return sent
            if ident not in n.children:  # its link is gone (and with it its lanes)
                break
        return False

    def read_ahead(self, ident: bytes, index: int) -> bool:
        """Hand chunk ``index`` for ``ident`` to the workers if its slot was reused (or, being read back already,
        to that read); False where it is to be sent now (a slot holds it, there is no ring or no worker free, or
        no free slot)."""
        store, pool = self.node.store, self.node.intake.pool
        ring = store.ring
        if ring is None or getattr(store.files, "reads", None) is None or not pool.threads or index in ring.slot_of:
            return False
        if index in self.also:  # being read back for another partner: sent to this one from the same slot
            self.also[index].append(ident)
            return True
        if pool.full:
            return False
        slot, view = ring.take(ring.stride, received=False)
        if slot is None:
            return False
        pool.submit(Read(index, ident, slot, view))
        self.also[index] = []
        self.reading += 1
        return True

    def done(self, job: Read) -> None:
        """A worker read ``job``'s chunk back (or failed: it is sent from the buffer then).  The slot stays
        taken until the send pins it: a chunk arriving meanwhile cannot take it."""
        self.reading -= 1
        if not job.ok:
            self.node.store.ring.release(job.slot)
            log.warning("reading chunk %d back from the copy failed (%s): sending it as it is served",
                        job.index, job.error)
        self.ready.append((job.ident, job.index, job.slot if job.ok else None))
        for ident in self.also.pop(job.index, ()):  # sent once the first send holds the slot (``flush``)
            self.ready.append((ident, job.index, None))

    def flush(self) -> None:
        """Send what was read, in order; a send that would block stays, first in line for its partner."""
        n, ring = self.node, self.node.store.ring
        left, blocked = deque(), set()
        while self.ready:
            ident, index, slot = item = self.ready.popleft()
            if ident in blocked:
                left.append(item)
                continue
            if slot is None:
                sent = ident not in n.children or self.send(ident, index)
            else:
                lo, hi = n.manifest.chunk_span(index)
                sent = ident not in n.children or self.send_data(ident, index, slot, ring.slot_view(slot, hi - lo))
                if sent:  # pinned by the send, if there was one: held from now on
                    ring.hold(slot, index, received=False)
            if not sent:
                left.append(item)
                blocked.add(ident)
        self.ready = left
