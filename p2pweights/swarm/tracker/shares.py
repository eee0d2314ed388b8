"""Origin shares: which origin reader reads which chunks (pure, no I/O).

Every member that can read the origin (the bucket, a shared path, a hub
cache) registers as a reader.  The chunks nobody holds yet (the ``pool``)
are handed out in blob order, a share of ``batch`` chunks at a time, each
chunk to one reader only: the origin is read about once in all, by every
reader in parallel.  A reader reports each chunk it holds (READ: of its
share, or taken from a peer) and is handed more once half of its share is
read, so its pipe to the origin stays full while the first readers to ask
take the front of the blob and later ones the rest.  A reader that goes gives back what it had not read.

Claims are hints.  A READ from a member that is no registered reader changes
nothing.  A share handed out, or a chunk a reader says it read, that no second
reader has reported held (``vouched``) stands while the fleet moves; once it is
``CLAIM_BOUND`` old and some unfinished member has verified nothing for
``CLAIM_BOUND`` (``Progress``), it goes back to the pool, never to be handed to
that reader again (``refuted``).  A member holding the whole model (DONE)
pauses the handing until the fleet stalls (``registry.Swarm``): its uplink
serves.
"""
from __future__ import annotations

import time
from collections import deque

from ...wire.chunkset import bitset_of, lowest_of

MAX_SHARE = 64  # chunks one share names at most (256 MiB of 4 MiB chunks)
SHARES_PER_MODEL = 16  # a model is cut into at least this many shares, so several readers take part
CLAIM_BOUND = 5.0  # seconds an unvouched claim stands, and an unfinished member may verify nothing, before the claim
#                    goes back to the pool (well below a joiner's give-up time, 20 s by default)
SHARE_BOUND = 3 * CLAIM_BOUND  # seconds a share may stay with a reader still reading some of it, while the fleet stalls


def share_size(n_chunks: int) -> int:
    """Chunks per share: a sixteenth of the model, 1 to ``MAX_SHARE``."""
    return max(1, min(MAX_SHARE, n_chunks // SHARES_PER_MODEL))


class OriginShares:
    """The readers of one model's origin and the chunks each is to read (bitsets: bit i for chunk i)."""

    def __init__(self, n_chunks: int, batch: int | None = None, clock=time.monotonic):
        self.n, self.clock = n_chunks, clock
        self.batch = batch or share_size(n_chunks)
        self.pool = (1 << n_chunks) - 1  # neither held by a reader nor handed to a live one
        self.read = 0  # reported held by some reader
        self.out: dict[int, int] = {}  # reader rank -> handed to it, not yet reported held
        self.handed = 0  # chunks handed out in all (a chunk handed again after its reader went counts twice)
        self.read_by: dict[int, int] = {}  # reader rank -> what it reported held
        self.orphans = 0  # read only by readers that left since (their peers may hold them, or nobody)
        self.said = 0  # reported held by some reader, ever
        self.vouched = 0  # reported held by two readers: no single reader's claim
        self.refuted: dict[int, int] = {}  # reader rank -> its claims that went back unvouched: not handed to it again
        self.claims: deque[tuple[float, int]] = deque()  # (when, chunks) handed out or first said read, oldest first
        self.aged = 0  # claimed ``CLAIM_BOUND`` ago or more
        self.ageing: deque[tuple[float, int]] = deque()  # (when, chunks) aged, until ``SHARE_BOUND`` old
        self.stale = 0  # handed out ``SHARE_BOUND`` ago or more: no reader keeps them for reading on
        self.reading: dict[int, float] = {}  # reader rank -> when it was handed a share afresh, or read of it

    @property
    def readers(self) -> list[int]:
        return sorted(self.out)

    def register(self, rank: int) -> None:
        """Member ``rank`` can read the origin."""
        self.out.setdefault(rank, 0)

    def held(self, rank: int, chunks) -> None:
        """Reader ``rank`` holds ``chunks`` now (read from the origin, or taken from a peer); from a member that
        is no reader, nothing (a claim nobody can check)."""
        if rank not in self.out:
            return
        bits = bitset_of(i for i in chunks if 0 <= i < self.n)
        new = bits & ~self.read_by.get(rank, 0)
        self.vouched |= new & self.said  # a second reader says it holds them
        self.said |= new
        if bits & self.out[rank]:
            self.reading[rank] = self.clock()
        self._claim(bits & ~self.read & ~self.out[rank])  # a chunk handed to it was claimed when handed
        self.read |= bits
        self.pool &= ~bits
        self.orphans &= ~bits
        self.out[rank] &= ~bits
        self.read_by[rank] = self.read_by.get(rank, 0) | bits

    def _claim(self, bits: int) -> None:
        if bits:
            self.claims.append((self.clock(), bits))

    def expire(self, stalled: bool) -> int:
        """Claims ``CLAIM_BOUND`` old that no second reader vouched for go back to the pool while the fleet
        ``stalled`` (``Progress``), and are never handed to their claimers again; returns them (a bitset).  A
        share stays with a reader that read some of it within ``CLAIM_BOUND`` (its pipe to the origin is full),
        up to ``SHARE_BOUND`` after it was handed."""
        now = self.clock()
        limit = now - CLAIM_BOUND
        while self.claims and self.claims[0][0] <= limit:
            self.ageing.append(self.claims.popleft())
            self.aged |= self.ageing[-1][1]
        while self.ageing and self.ageing[0][0] <= now - SHARE_BOUND:
            self.stale |= self.ageing.popleft()[1]
        back = self.aged & ~self.vouched
        if not stalled or not back:
            return 0
        kept = 0
        for r, handed in self.out.items():
            if self.reading.get(r, float("-inf")) > limit:
                kept |= handed & back & ~self.stale
        back &= ~kept
        self.aged, self.stale = kept, self.stale & kept
        for r in self.out:
            lost = (self.out[r] | self.read_by.get(r, 0)) & back
            if lost:
                self.refuted[r] = self.refuted.get(r, 0) | lost
                self.out[r] &= ~lost
        self.pool |= back
        self.read &= ~back
        self.orphans &= ~back
        return back

    def gone(self, rank: int) -> None:
        """Reader ``rank`` left: what it had not read goes back to the pool; what it alone read is an orphan."""
        self.pool |= self.out.pop(rank, 0) & ~self.read
        self.reading.pop(rank, None)
        self.orphans |= self.read_by.pop(rank, 0) & ~self._live_reads()

    def _live_reads(self) -> int:
        bits = 0
        for b in self.read_by.values():
            bits |= b
        return bits

    def reclaim(self) -> None:
        """No member holds every chunk and one still pulls: the orphans go back to the pool, to be read again
        (the peers that took them from their reader may have left too; nobody can tell)."""
        back = self.orphans & ~self._live_reads()
        self.pool |= back
        self.read &= ~back
        self.orphans = 0

    def hungry(self, rank: int) -> bool:
        """Whether reader ``rank`` is at most half through its share while the pool holds more for it."""
        return (rank in self.out and bool(self.pool & ~self.refuted.get(rank, 0))
                and self.out[rank].bit_count() <= self.batch // 2)

    def hand(self, rank: int, complete_holder: bool = False) -> list[int]:
        """The next share for reader ``rank``: the lowest chunks of the pool, up to ``batch`` outstanding, once
        at most half a share is; nothing while a member holds every chunk (``complete_holder``)."""
        if complete_holder or not self.hungry(rank):
            return []
        outstanding = self.out[rank].bit_count()
        if not outstanding:
            self.reading[rank] = self.clock()
        take = lowest_of(self.pool & ~self.refuted.get(rank, 0), self.batch - outstanding)
        bits = bitset_of(take)
        self.pool &= ~bits
        self.out[rank] |= bits
        self.handed += len(take)
        self._claim(bits)
        return take

    @property
    def done(self) -> bool:
        """Every chunk has been read by some reader."""
        return self.read == (1 << self.n) - 1


class Progress:
    """When each unfinished member last verified more chunks, as its heartbeats say (``have``): the fleet
    stalls while one has verified nothing for ``CLAIM_BOUND`` (judged at most every ``every`` seconds)."""

    def __init__(self, clock=time.monotonic, every: float = 0.5):
        self.clock, self.every = clock, every
        self.last: dict[int, tuple[int, float]] = {}  # rank -> (have, when it last rose)
        self.next, self.was = float("-inf"), False

    def stalled(self, unfinished) -> bool:
        """Whether one of ``unfinished`` ((rank, have) pairs) verified nothing for ``CLAIM_BOUND``."""
        now = self.clock()
        if now < self.next:
            return self.was
        self.next, seen, self.was = now + self.every, {}, False
        for rank, have in unfinished:
            was = self.last.get(rank)
            seen[rank] = was = (have, now) if was is None or have > was[0] else was
            self.was = self.was or now - was[1] >= CLAIM_BOUND
        self.last = seen
        return self.was
