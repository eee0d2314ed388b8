"""Origin shares: which origin reader reads which chunks (pure, no I/O).

Every member that can read the origin (the bucket, a shared path, a hub
cache) registers as a reader.  The chunks nobody holds yet (the ``pool``)
are handed out in blob order, a share of ``batch`` chunks at a time, each
chunk to one reader only: the origin is read about once in all, by every
reader in parallel.  A reader reports what it holds of its share (READ) and
is handed more once half of it is read, so its pipe to the origin stays full
while the first readers to ask take the front of the blob and later ones the
rest.  A reader that goes gives back what it had not read.  While a member
holds the whole model, nobody is handed anything: its uplink serves.
"""
from __future__ import annotations

from ..wire.chunkset import bitset_of, lowest_of

MAX_SHARE = 64  # chunks one share names at most (256 MiB of 4 MiB chunks)
SHARES_PER_MODEL = 16  # a model is cut into at least this many shares, so several readers take part


def share_size(n_chunks: int) -> int:
    """Chunks per share: a sixteenth of the model, 1 to ``MAX_SHARE``."""
    return max(1, min(MAX_SHARE, n_chunks // SHARES_PER_MODEL))


class OriginShares:
    """The readers of one model's origin and the chunks each is to read (bitsets: bit i for chunk i)."""

    def __init__(self, n_chunks: int, batch: int | None = None):
        self.n = n_chunks
        self.batch = batch or share_size(n_chunks)
        self.pool = (1 << n_chunks) - 1  # neither held by a reader nor handed to a live one
        self.read = 0  # reported held by some reader
        self.out: dict[int, int] = {}  # reader rank -> handed to it, not yet reported held
        self.handed = 0  # chunks handed out in all (a chunk handed again after its reader went counts twice)
        self.read_by: dict[int, int] = {}  # reader rank -> what it reported held
        self.orphans = 0  # read only by readers that left since (their peers may hold them, or nobody)

    @property
    def readers(self) -> list[int]:
        return sorted(self.out)

    def register(self, rank: int) -> None:
        """Member ``rank`` can read the origin."""
        self.out.setdefault(rank, 0)

    def held(self, rank: int, chunks) -> None:
        """``rank`` holds ``chunks`` now (read from the origin, or taken from a peer)."""
        bits = bitset_of(i for i in chunks if 0 <= i < self.n)
        self.read |= bits
        self.pool &= ~bits
        self.orphans &= ~bits
        if rank in self.out:
            self.out[rank] &= ~bits
            self.read_by[rank] = self.read_by.get(rank, 0) | bits

    def gone(self, rank: int) -> None:
        """Reader ``rank`` left: what it had not read goes back to the pool; what it alone read is an orphan."""
        self.pool |= self.out.pop(rank, 0) & ~self.read
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
        """Whether reader ``rank`` is at most half through its share while the pool holds more."""
        return bool(self.pool) and rank in self.out and self.out[rank].bit_count() <= self.batch // 2

    def hand(self, rank: int, complete_holder: bool = False) -> list[int]:
        """The next share for reader ``rank``: the lowest chunks of the pool, up to ``batch`` outstanding, once
        at most half a share is; nothing while a member holds every chunk (``complete_holder``)."""
        if complete_holder or not self.hungry(rank):
            return []
        outstanding = self.out[rank].bit_count()
        take = lowest_of(self.pool, self.batch - outstanding)
        bits = bitset_of(take)
        self.pool &= ~bits
        self.out[rank] |= bits
        self.handed += len(take)
        return take

    @property
    def done(self) -> bool:
        """Every chunk has been read by some reader."""
        return self.read == (1 << self.n) - 1
