"""Rootless tracker: one model's swarm at a standalone tracker, where no seeder is rank 0 (pure).

Placement, partners, demotion, leaving and repair are the ``Tracker``'s.  Rank 0
(the root of every stripe tree) is nobody here: a peer under it in a stripe
(that stripe's root) has no planned source there, and pulls the stripe from
its partners (``pull``: an orphaned stripe is shared by its holders).  The
origin readers (``shares``) are where new chunks appear: each is made a
partner of every stripe's root and of the other readers, up to
``MAX_FEEDERS`` of them, listed as feeding nobody downstream (help asks the
cheapest partners first, and a reader's share is what everyone lacks).  The
seeder's uplink, lent at the end in a seeded swarm, does not exist.

A member's word about others is a hint: one reported dead (ORPHAN) that is
heard from again on its own connection is placed again (``touch``).  The last
member holding every chunk stays for members still missing some, but at most
its linger (``--linger``, else ``LAST_HOLDER_LINGER``): a member that never
finishes keeps nobody for ever.
"""
from __future__ import annotations

from .tracker import ROOT, Member, Tracker, complete_holders  # noqa: F401 (complete_holders: this module's API)

MAX_FEEDERS = 8  # origin readers one peer is made a partner of
LAST_HOLDER_LINGER = 120.0  # seconds the last complete member stays for unfinished ones when its LEAVE names no linger


class RootlessTracker(Tracker):
    """Membership and placement of a swarm with no seeder; ``readers``: the members reading the origin."""

    def __init__(self, topology, root_listen: str = "", **kw):
        super().__init__(topology, root_listen, **kw)
        self.loan.open = False  # no seeder to lend
        self.readers: set[int] = set()
        self.sources: set[int] = set()  # members that pull nothing (a seeder among peers): leaves nobody waits for
        self.dropped: set[int] = set()  # members dropped without asking (found dead, reported dead): not left

    def _live_readers(self) -> list[int]:
        return sorted(r for r in self.readers if r in self.members and not self.members[r].left)

    def _fed(self) -> list[int]:
        """Live members that take a stripe from nobody (each stripe's root), and the readers."""
        roots = [r for r in self.roster.live if ROOT in self.members[r].parents]
        return sorted({*roots, *self._live_readers()})

    def add_reader(self, rank: int) -> None:
        """Member ``rank`` reads the origin: the stripes' roots and the other readers are told of it."""
        if rank not in self.readers:
            self.readers.add(rank)
            self.moved.extend(r for r in self._fed() if r != rank)

    def drop_reader(self, rank: int) -> None:
        self.readers.discard(rank)

    def pulls_nothing(self, rank: int) -> None:
        """Member ``rank`` serves what it reads and pulls nothing: a leaf everywhere (its stripe is forwarded by
        peers that take it whole), and no peer waits for it to leave."""
        if rank not in self.sources and rank in self.members:
            self.sources.add(rank)
            self._note(self.topology.demote(rank))

    def leave(self, rank: int, linger: float | None = None) -> list[int]:
        """As ``Tracker.leave``; and with no seeder to fall back on, the last member holding every chunk stays
        while a member that pulls still lacks some (a chunk read by one reader may be nowhere else), for at
        most its ``linger`` (``LAST_HOLDER_LINGER`` where it names none) after it was done: then it goes,
        whoever depends on it."""
        m = self._member(rank)
        self.dropped.discard(rank)  # it asked: gone on its word from here, not revived by a late heartbeat
        if linger is not None:
            m.linger = linger
        if not m.left and m.done and self.clock() - m.done_at >= (LAST_HOLDER_LINGER if m.linger is None
                                                                  else m.linger):
            self.roster.depart(m)
            if self.placed:
                self._note(self.topology.remove(rank))
            return []
        if not m.left and m.done:
            others = [self.members[r] for r in self.roster.live if r != rank and r not in self.sources]
            unfinished = [x.rank for x in others if not x.done]
            if unfinished and not any(x.done for x in others):
                return unfinished[:MAX_FEEDERS]
        return super().leave(rank, linger)

    def join(self, peer_id: str, listen: str, rank: int | None = None, secret: str | None = None) -> Member:
        m = super().join(peer_id, listen, rank, secret)
        self.dropped.discard(m.rank)
        return m

    def gone(self, rank: int) -> list[tuple[int, int]]:
        self.dropped.add(rank)
        return super().gone(rank)

    def touch(self, rank: int, have: int | None = None, rates: dict | None = None,
              delivered: dict | None = None) -> None:
        """As ``Tracker.touch``; a member dropped without asking (another reported it dead) that speaks again on
        its own connection is live again, placed anew, and told its plan."""
        m = self.members.get(rank)
        if m is not None and m.left and rank in self.dropped and not m.done:
            self.dropped.discard(rank)
            self.roster.arrive(m)
            moves = self.topology.place(rank) if self.placed else []
            self.pullers.assign(m, self._place(rank))
            self._note(moves)
            if self.placed:
                self.moved.extend(self.roster.partner(m, self.partners_first(m)))
            self.moved.append(rank)
        super().touch(rank, have, rates, delivered)

    def dependents(self, rank: int) -> list[int]:
        return [r for r in super().dependents(rank) if r not in self.sources]

    def _unfinished_partners(self, m: Member) -> list[int]:
        return [r for r in super()._unfinished_partners(m) if r not in self.sources]

    def parent_addrs(self, member: Member) -> list[dict]:
        """Planned sources, none under rank 0: that stripe is taken from partners."""
        return [p for p in super().parent_addrs(member) if p["rank"] != ROOT]

    def partner_addrs(self, member: Member) -> list[dict]:
        """Partners, and for a stripe's root or a reader, the origin readers besides (``MAX_FEEDERS``); a reader's
        entry says ``reader``: while the tracker is away, readers split what nobody holds among them."""
        out = [dict(p, reader=True) if p["rank"] in self.readers else p for p in super().partner_addrs(member)]
        if member.rank not in self.readers and ROOT not in member.parents:
            return out
        listed = {p["rank"] for p in out} | {member.rank}
        for r in self._live_readers()[:MAX_FEEDERS]:
            if r not in listed:
                out.append({"rank": r, "addr": self.listen_of(r), "ticket": self.seal.ticket(r, member.rank),
                            "downstream": 0, "reader": True})
        return out
