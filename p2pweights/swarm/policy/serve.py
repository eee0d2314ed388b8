"""Upload scheduler: which asked-for chunk this node sends to whom next (sans-IO).

Each attached partner has a queue of the chunks it asked for and this node
holds, and a set of parked requests (asked for, not held yet): a parked chunk
joins its queue the moment it is verified.  ``next`` serves the queues
round-robin, one chunk per link per turn, so every link gets its fair share
of the uplink whatever the others ask; a seeder (``fresh_first``) picks, among
the links' queued chunks, the one it has sent least often, so chunks nobody
holds yet go out before duplicates.  Nothing is sent that was not asked for; a
CANCEL withdraws a request not yet sent.  Per link at most ``max_parked``
requests wait, so no partner can grow this node's memory.

``Announcer`` decides when a partner hears (HAVE) of the chunks this node
verified: at once for a stripe it pulls from us now, else in a batch every
``HAVE_DEFER`` seconds.
"""
from __future__ import annotations

import time
from collections import deque

from ...wire.protocol import ProtocolError

MAX_PARKED = 64  # requests one link may have waiting at this node (queued or parked)
PULLING = 0.5  # seconds since its last request during which a partner counts as pulling from us
HAVE_DEFER = 0.1  # seconds a partner not pulling from us may hear late of what we verified


class UploadScheduler:
    """Requests of every attached partner, and the order they are served in."""

    def __init__(self, n_chunks: int, holds, fresh_first: bool = False, max_parked: int = MAX_PARKED,
                 clock=time.monotonic, stripes=lambda: 1):
        self.n, self.clock, self.stripes = n_chunks, clock, stripes  # stripes(): the plan's (chunk i: stripe i mod it)
        self.holds = holds  # index -> bool: whether this node holds a verified copy
        self.fresh_first = fresh_first
        self.max_parked = max_parked
        self.queues: dict[bytes, deque] = {}
        self.parked: dict[int, list[bytes]] = {}
        self.waiting: dict[bytes, set[int]] = {}  # per link: every chunk asked and not yet sent
        self.asked: dict[bytes, dict[int, float]] = {}  # per link: stripe -> when it last asked for a chunk of it
        self.turn: deque = deque()  # round-robin order of links
        self.sent_count = [0] * n_chunks
        self.held_until = 0.0  # ``hold``

    def attach(self, link: bytes) -> None:
        if link not in self.queues:
            self.queues[link] = deque()
            self.waiting[link] = set()
            self.asked[link] = {}
            self.turn.append(link)

    def detach(self, link: bytes) -> None:
        """Forget ``link`` and everything it asked for."""
        if self.queues.pop(link, None) is None:
            return
        del self.asked[link]
        for i in self.waiting.pop(link):
            waiters = self.parked.get(i)
            if waiters and link in waiters:
                waiters.remove(link)
                if not waiters:
                    del self.parked[i]
        self.turn.remove(link)

    def attached(self, link: bytes) -> bool:
        return link in self.queues

    def request(self, link: bytes, indices: list[int]) -> list[int]:
        """``link`` asks for ``indices``; returns those not held yet (to read from storage, say).

        ProtocolError for a link that never attached, a chunk out of range or
        named twice, or more than ``max_parked`` requests waiting."""
        if link not in self.queues:
            raise ProtocolError("REQUEST from a connection that is not attached")
        if len(set(indices)) != len(indices):
            raise ProtocolError("REQUEST names a chunk twice")
        waiting, asked, now, k = self.waiting[link], self.asked[link], self.clock(), self.stripes()
        absent = []
        for i in indices:
            if not 0 <= i < self.n:
                raise ProtocolError(f"requested chunk {i}, but the blob has {self.n}")
            asked[i % k] = now
            if i in waiting:
                continue  # asked again (a stall re-request): already waiting
            if len(waiting) >= self.max_parked:
                raise ProtocolError(f"more than {self.max_parked} requests waiting")
            waiting.add(i)
            if self.holds(i):
                self.queues[link].append(i)
            else:
                self.parked.setdefault(i, []).append(link)
                absent.append(i)
        return absent

    def cancel(self, link: bytes, indices: list[int]) -> None:
        """``link`` no longer wants ``indices`` (not yet sent ones are dropped)."""
        waiting = self.waiting.get(link)
        if waiting is None:
            return
        for i in indices:
            if i not in waiting:
                continue
            waiting.discard(i)
            if i in self.queues[link]:
                self.queues[link].remove(i)
            elif link in self.parked.get(i, ()):
                self.parked[i].remove(link)
                if not self.parked[i]:
                    del self.parked[i]

    def verified(self, index: int) -> None:
        """This node now holds ``index``: every link parked on it may be sent it."""
        for link in self.parked.pop(index, ()):
            self.queues[link].append(index)

    def pulling(self, link: bytes) -> set[int]:
        """The stripes ``link`` pulls from us now: it asked for a chunk of them within ``PULLING`` seconds, or
        did at all and has requests waiting here."""
        asked = self.asked.get(link)
        if not asked:
            return set()
        if self.waiting[link]:
            return set(asked)
        now = self.clock()
        return {s for s, at in asked.items() if now - at < PULLING}

    def hold(self, until: float) -> None:
        """Send nothing before ``until`` (the clock's time; requests still queue): a joiner's uplink
        probe has the uplink to itself (``member.Membership.probe``)."""
        self.held_until = until

    def _held(self) -> bool:
        """Whether a ``hold`` is on; one that has run out is forgotten (no clock read per chunk after)."""
        if self.held_until and self.clock() >= self.held_until:
            self.held_until = 0.0
        return self.held_until != 0.0

    def pending(self) -> bool:
        """Whether a chunk is due out now."""
        return any(self.queues.values()) and not self._held()

    def next(self, skip=()) -> tuple[bytes, int] | None:
        """The next ``(link, chunk)`` to send, round-robin over links not in ``skip``; it is
        taken out of the queue (``blocked`` puts it back).  None while held."""
        if self.held_until and self._held():
            return None
        for _ in range(len(self.turn)):
            link = self.turn[0]
            self.turn.rotate(-1)
            q = self.queues[link]
            if not q or link in skip:
                continue
            if self.fresh_first:
                return self._freshest(skip)
            index = q.popleft()
            self.waiting[link].discard(index)
            return link, index
        return None

    def _freshest(self, skip) -> tuple[bytes, int]:
        """Among every link's queued chunks, the least-sent one (links in round-robin order)."""
        best = None
        for link in self.turn:  # already rotated: this order is the round-robin tiebreak
            if link in skip:
                continue
            for i in self.queues[link]:
                if best is None or self.sent_count[i] < best[0]:
                    best = (self.sent_count[i], link, i)
        _, link, index = best
        self.queues[link].remove(index)
        self.waiting[link].discard(index)
        return link, index

    def sent(self, index: int) -> None:
        self.sent_count[index] += 1

    def blocked(self, link: bytes, index: int) -> None:
        """Sending ``index`` to ``link`` would block: keep it first in line for later."""
        if link in self.queues:
            self.queues[link].appendleft(index)
            self.waiting[link].add(index)


class Announcer:
    """When each attached partner hears of the chunks this node verified (sans-IO, clock injected).

    A partner pulling a stripe from us (``UploadScheduler.pulling``) hears of
    that stripe's chunks at once: a planned child asks only ``PARK_AHEAD``
    chunks ahead of what we hold, so its next requests wait on our HAVEs.
    Everything else is told in batches every ``HAVE_DEFER`` seconds: partners
    read those HAVEs to judge whether their planned source lags, to find help
    and to pick the rarest, none of which a tenth of a second changes, while
    every message costs CPU at both ends (HAVEs were about 70 % of a join's
    messages at N = 16, one per chunk per partner)."""

    def __init__(self, serve: UploadScheduler, clock):
        self.serve, self.clock = serve, clock
        self.pending: dict[bytes, list[int]] = {}  # partner -> chunks it has not heard of yet
        self.due_at: float | None = None

    def tell(self, link: bytes, news, everything: bool = False):
        """What to tell ``link`` now of ``news`` (chunks it has not heard of): if one of them is of a stripe
        it pulls from us, all of them and what waited for it (one message either way); else nothing now,
        ``due`` hands them over later.  ``everything``: we hold every chunk and ``news`` names them all:
        told now, in place of what waited."""
        if everything:
            self.pending.pop(link, None)
            return news
        stripes = self.serve.pulling(link)
        if stripes:
            k = self.serve.stripes()
            if len(stripes) >= k or any(i % k in stripes for i in news):
                waited = self.pending.pop(link, None)
                return waited + news if waited else news
        if news:
            self.pending.setdefault(link, []).extend(news)
            if self.due_at is None:
                self.due_at = self.clock() + HAVE_DEFER
        return []

    def fresh(self, children: dict, links: dict, fresh: list[int], everything=None) -> list[tuple[bytes, list]]:
        """What each partner in ``children`` (ident -> ``Child``) hears now of ``fresh`` chunks we verified:
        ``tell`` each, leaving out, for a partner we pull from too (``links``: rank -> ``pull`` link), what
        it holds already (about a third of all HAVEs: it sent us those).  ``everything`` (every chunk, once
        we hold them all): a partner we pull from hears of all, so it counts us complete."""
        out = []
        for ident, child in list(children.items()):
            holds = getattr(links.get(child.rank), "holds", None)  # a partner we pull from too
            if holds is None:
                out.append((ident, self.tell(ident, fresh)))
            elif everything is not None:
                out.append((ident, self.tell(ident, everything, everything=True)))
            else:
                out.append((ident, self.tell(ident, [i for i in fresh if not holds >> i & 1])))
        return out

    def due(self) -> list[tuple[bytes, list[int]]]:
        """The batches whose time has come, for the partners still attached: ``[(link, chunks), ...]``."""
        if self.due_at is None or self.clock() < self.due_at:
            return []
        self.due_at = None
        batches, self.pending = self.pending, {}
        return [(link, chunks) for link, chunks in batches.items() if self.serve.attached(link)]
