"""What a peer knows of each partner it pulls from: holdings, requests, measured rate, credit window.

A link's window is ``QUEUE_TIME`` seconds of the rate measured on it, clamped to
``MIN_WINDOW``..``MAX_WINDOW`` (``DEFAULT_WINDOW`` until its first chunk).  Sets of chunks are
``chunkset`` bitsets: Python ints, bit i for chunk i.
"""
from __future__ import annotations

import math

DEFAULT_WINDOW = 2  # a link's credit window until its first chunk measures its rate
MIN_WINDOW = 2
MAX_WINDOW = 32
QUEUE_TIME = 0.25  # seconds of a link's measured rate that its window keeps asked for
RATE_TIME = 0.25  # seconds: a link's rate is the bytes it delivered over the time it was asked, time that
#                  long ago weighing 1/e (not an average of per-chunk rates: chunks read back to back after
#                  a pause of this process, one sample spanning the pause and the rest a fraction of a
#                  millisecond each, made such an average read several times the uplink)
BUNCHED = 0.1  # a parked chunk verified within this share of a chunk-time (at the link's rate) of its
#               HAVE was read with it after a pause of this process: no rate sample (it read many uplinks)
STALL_MIN = 2.0  # seconds: no request is called stalled (nor parked too long) sooner
SEEDER = 0  # rank of the seeder: serves beyond its planned stripes only what no partner holds,
#             so its uplink carries each chunk about once


class Link:
    """What this peer knows of one partner: holdings, requests, measured rate."""

    def __init__(self, rank: int, n_chunks: int, window: int = DEFAULT_WINDOW, opened: float = 0.0):
        self.rank, self.n_chunks, self.window = rank, n_chunks, window
        self.holds: int | None = None  # bitset of the chunks it holds; None until its bitfield arrives
        self.held = 0  # how many chunks it holds
        self.outstanding: dict[int, float] = {}  # chunk -> when asked
        self.rate = 0.0  # bytes/s while it had requests to serve: ``carried`` over ``busy``
        self.carried = 0.0  # bytes it delivered, each weighted by how recent (in time asked) it is
        self.busy = 0.0  # seconds it had requests to serve, weighted alike
        self.last_arrival = 0.0
        self.received = 0  # bytes that verified
        self.bad = 0  # chunks that failed verification
        self.helping: set[int] = set()  # chunks asked of it to help a lagging stripe
        self.unparked: set[int] = set()  # parked chunks its HAVE named: timed from that HAVE
        self.withdrawn: set[int] = set()  # chunks cancelled there; a copy already on its way is taken
        self.opened = opened  # when the link was added (attaching since then until its bitfield arrives)
        self.starved = False  # its requests stalled and nothing arrived since: its stripes are helped

    @property
    def ready(self) -> bool:
        return self.holds is not None

    @property
    def complete(self) -> bool:
        """It holds every chunk (a complete partner hears of every chunk it holds)."""
        return self.held >= self.n_chunks

    def unpark(self, index: int) -> bool:
        """Whether ``index`` was parked here until its HAVE (forgetting it)."""
        was = index in self.unparked
        self.unparked.discard(index)
        return was

    def measure(self, size: int, took: float, timed_by_have: bool) -> None:
        """A chunk of ``size`` bytes was served in ``took`` seconds: a rate sample, unless it was timed
        from its HAVE and came far sooner than the rate explains (read with that HAVE after a pause of
        this process: at N = 16 on 2 cores such samples made uplinks read 485 MB/s on 25 MB/s links)."""
        if timed_by_have and self.rate > 0 and took < BUNCHED * size / self.rate:
            return
        decay = math.exp(-took / RATE_TIME)  # the first sample: 0 carried over 0 s before it
        self.carried = self.carried * decay + size
        self.busy = self.busy * decay + took
        self.rate = self.carried / max(self.busy, 1e-4)

    def resize(self, chunk_size: int) -> None:
        """Its window: ``QUEUE_TIME`` of its measured rate, in chunks, clamped."""
        self.window = max(MIN_WINDOW, min(MAX_WINDOW, math.ceil(self.rate * QUEUE_TIME / chunk_size)))

    def free(self, cap: int | None = None) -> int:
        return max(0, min(self.window, cap if cap is not None else self.window) - len(self.outstanding))

    def helping_now(self) -> int:
        """Requests in flight here that help a lagging stripe."""
        return sum(1 for i in self.outstanding if i in self.helping)


def held_by(links: dict[int, Link], besides=(SEEDER,)) -> int:
    """The chunks some ready partner holds, the ranks ``besides`` aside."""
    held = 0
    for lk in links.values():
        if lk.holds is not None and lk.rank not in besides:
            held |= lk.holds
    return held


def median(values: list[float]) -> float:
    """The median of a non-empty list (``statistics`` costs a join 5 ms of start-up to import)."""
    ordered, mid = sorted(values), len(values) // 2
    return ordered[mid] if len(values) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def typical_rate(links: dict[int, Link]) -> float:
    """The median rate of the links that measured one (bytes/s; 0 if none has)."""
    rates = [lk.rate for lk in links.values() if lk.rate > 0]
    return median(rates) if rates else 0.0
