"""Ring: the chunks a join verified last, in a few reused buffers, while its files are written around the page cache.

A join writing ``--out`` used to copy every chunk into the page cache of its
files and serve partners from there.  Filling new page-cache pages was the
largest single cost of a join on the bed (a VM whose host backs freed memory
lazily: 42 % of all the machine's CPU at N = 16).  With a ring, a chunk is
verified in its network buffer, copied into a free slot, written into its
files from there with ``O_DIRECT`` (``DiskCache.write_direct``; by a worker
thread, ``workers``) and served from the slot; a
partner asks for most chunks within a fraction of a second of hearing of
them.  A chunk whose slot was taken since is read back from the files into
a slot by explicit reads (``readback``) and served from there.  The slots
are the only memory the chunks pass through, faulted in once.

The ring grows with the rate chunks are held at, once partners ask for
chunks it no longer holds: enough slots for ``RING_SECONDS`` of them (at
least ``RING_BYTES``), up to ``most`` slots (a share of the memory budget,
``ring_budget``).  The whole span is mapped at
the start; a slot's pages are allocated only once it is used.

A slot is reused only once no send still reads it: ZeroMQ sends straight
from the slot, and each send's tracker (``zmq.MessageTracker``) is pinned
to it until ZeroMQ lets go.  With every slot pinned, ``take`` returns None
and the chunk goes the old way (network buffer, then ``pwrite``).  A slot
taken and not yet held (a worker still verifies and writes the chunk in it,
``workers``) is never taken again: ``hold`` or ``release`` ends that.  No
I/O here: ``take``, ``hold``, ``release``, ``view``, ``pin``.
"""
from __future__ import annotations

import math
import mmap
import time

from .store import align_page, memory_budget

RING_BYTES = 16 << 20  # the slots together (32 of the default 512 KiB chunks: 0.3 s of a 400 Mbit/s uplink)
MIN_SLOTS = 4
RING_SECONDS = 0.5  # the ring grows to hold this long of the chunks held, at the rate measured
RING_BUDGET_SHARE = 8  # it grows to at most this fraction (1/N) of the memory budget (``ring_budget``)
RATE_WINDOW = 0.25  # seconds over which the rate of chunks held is measured
TAKEN = -2  # ``chunk_in`` of a slot taken and not yet held or released


class ChunkRing:
    """``slots`` buffers of ``chunk_size`` bytes (page-aligned), each empty or holding one verified chunk."""

    def __init__(self, chunk_size: int, slots: int | None = None, busy: int = 0, most: int | None = None,
                 clock=time.monotonic):
        """``busy``: slots that may be taken and not yet held at once (chunks in the workers), on top of the
        ``slots`` (default: RING_BYTES of them, at least MIN_SLOTS, at most ``most``) that hold verified
        chunks; those grow with the rate up to ``most`` slots (default: ``slots``, fixed)."""
        self.chunk_size, self.clock = chunk_size, clock
        self.stride = align_page(chunk_size)
        first = min(slots or max(MIN_SLOTS, RING_BYTES // self.stride), most or slots or 1 << 62)
        self.busy, self.most = busy, max(first, most or first)
        self.slots = first + busy  # slots in use now; ``grow`` adds more
        span = (self.most + busy) * self.stride
        self.buffer = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
        self.memory = memoryview(self.buffer)
        self.slot_of: dict[int, int] = {}  # chunk -> slot holding it
        self.chunk_in = [-1] * (self.most + busy)  # slot -> chunk it holds, or -1, or TAKEN
        self.pins: list[list] = [[] for _ in range(self.most + busy)]  # slot -> trackers of sends reading it
        self.next = 0  # slots are taken round-robin from here: the oldest chunk goes first
        self.held = self.full = 0  # chunks held in a slot; chunks received the old way, every slot pinned
        self.hits = self.misses = 0  # sends from a slot; sends of a chunk no slot held any more (read back)
        self.read_back = 0  # chunks read back from the files into a slot to be sent
        self.window_at, self.window_chunks = clock(), 0  # the rate's window: its start, chunks held in it
        self.window_misses = 0  # ``misses`` when the window began: the ring grows only if partners missed

    def grow(self, now: float) -> None:
        """Once a window is over in which a chunk was asked for after its slot was reused: enough slots for
        RING_SECONDS of the chunks held at its rate, up to ``most`` (a join nobody pulls from keeps its first
        slots: new memory costs a fault per page)."""
        took = now - self.window_at
        if took < RATE_WINDOW:
            return
        if self.misses > self.window_misses:
            want = math.ceil(self.window_chunks / took * RING_SECONDS) + self.busy
            self.slots = max(self.slots, min(want, self.most + self.busy))
        self.window_at, self.window_chunks, self.window_misses = now, 0, self.misses

    def take(self, size: int, received: bool = True):
        """``(slot, view of size bytes)`` to receive a chunk into (else to read one back into), dropping what
        the slot held; ``(None, None)`` if every slot is still being sent from or taken.  The slot is taken until
        ``hold`` or ``release``."""
        for k in range(self.slots):
            slot = (self.next + k) % self.slots
            old = self.chunk_in[slot]
            if old == TAKEN or self._unpin_done(slot):
                continue
            if old >= 0:
                del self.slot_of[old]
            self.chunk_in[slot] = TAKEN
            self.next = (slot + 1) % self.slots
            return slot, self._slot(slot, size)
        self.full += received
        return None, None

    def hold(self, slot: int, index: int, received: bool = True) -> None:
        """Chunk ``index``, verified and on disk, is what ``slot`` holds now (``received``, else read back: the
        rate counts only what arrives); another slot that held it holds nothing from now on (one slot per chunk:
        ``take`` forgets a slot's chunk by it)."""
        other = self.slot_of.get(index)
        if other is not None and other != slot:
            self.chunk_in[other] = -1
        self.slot_of[index] = slot
        self.chunk_in[slot] = index
        if not received:
            self.read_back += 1
            return
        self.held += 1
        self.window_chunks += 1
        self.grow(self.clock())

    def release(self, slot: int) -> None:
        """``slot`` was taken for a chunk that failed verification (or was not written): free it, holding nothing."""
        self.chunk_in[slot] = -1

    def view(self, index: int, size: int):
        """``(slot, view)`` of chunk ``index`` if a slot holds it, else ``(None, None)``."""
        slot = self.slot_of.get(index)
        if slot is None:
            self.misses += 1
            return None, None
        self.hits += 1
        return slot, self._slot(slot, size)

    def slot_view(self, slot: int, size: int) -> memoryview:
        """The first ``size`` bytes of ``slot`` (one taken by ``take``, or held)."""
        return self._slot(slot, size)

    def pin(self, slot: int, tracker) -> None:
        """A send from ``slot`` is under way; ``tracker.done`` says when ZeroMQ no longer reads it."""
        if len(self.pins[slot]) >= 16:  # a slot served over and over (the join is complete): keep only live sends
            self._unpin_done(slot)
        self.pins[slot].append(tracker)

    def _unpin_done(self, slot: int) -> int:
        """Drop the pins of ``slot``'s finished sends; how many are still under way."""
        pins = self.pins[slot]
        if pins:
            pins[:] = [t for t in pins if not t.done]
        return len(pins)

    def _slot(self, slot: int, size: int) -> memoryview:
        return self.memory[slot * self.stride: slot * self.stride + size]

    def report(self) -> dict:
        """What the ring did, for ``--report``: ``slots`` now (it only grows), ``most_slots`` it may grow to
        (its budget), chunks ``held``, takes that found every slot ``full``, chunks sent from slots or from the
        files, chunks ``read_back`` into slots."""
        return {"slots": self.slots, "most_slots": self.most + self.busy, "held": self.held, "full": self.full,
                "sent_from_slots": self.hits, "sent_from_files": self.misses, "read_back": self.read_back}

    def close(self) -> None:
        try:
            self.memory.release()
            self.buffer.close()
        except (BufferError, ValueError):  # a send still holds a view: freed with the last one
            pass


def ring_budget(chunk_size: int, budget: int | None = None) -> int:
    """The most slots a join's ring may hold: 1/RING_BUDGET_SHARE of ``budget`` bytes (default: the memory
    budget, ``store.memory_budget()``), at least MIN_SLOTS."""
    budget = memory_budget() if budget is None else budget
    return max(MIN_SLOTS, budget // RING_BUDGET_SHARE // align_page(chunk_size))
