"""Tracker: fleet membership, kept by the seeder; it never moves chunk bytes.

It gives each joining peer a rank in join order and its parent in every stripe
tree by the topology's rule, skipping parents that have left (the orphan goes
to the nearest live ancestor).  It records who is done and lets a peer leave
only once no unfinished peer depends on it, so a relay never strands its
subtree.  Pure state: the node feeds it events and sends what it returns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .topology import live_parent

ROOT = 0


@dataclass
class Member:
    """One peer as the tracker knows it."""

    rank: int
    peer_id: str
    listen: str
    parents: list[int]
    joined: float = field(default_factory=time.monotonic)
    done: bool = False
    left: bool = False
    seconds: float | None = None
    seen: float = field(default_factory=time.monotonic)


class TrackerError(ValueError):
    """A membership request the tracker refuses."""


class Tracker:
    """Membership and tree placement for one broadcast."""

    def __init__(self, topology, root_listen: str, max_peers: int = 10_000):
        self.topology = topology
        self.root_listen = root_listen
        self.max_peers = max_peers
        self.members: dict[int, Member] = {}
        self.by_peer_id: dict[str, int] = {}

    def alive(self) -> set[int]:
        return {r for r, m in self.members.items() if not m.left}

    def listen_of(self, rank: int) -> str:
        return self.root_listen if rank == ROOT else self.members[rank].listen

    def join(self, peer_id: str, listen: str, rank: int | None = None) -> Member:
        """Place a joining peer.  The same peer_id re-joining keeps its rank; so does a peer that
        re-introduces itself with its old ``rank`` to a restarted tracker, if nobody else holds it."""
        known = self.by_peer_id.get(peer_id)
        if known is not None:
            m = self.members[known]
            m.listen, m.left = listen, False
            m.parents = self._place(known)
            return m
        if len(self.alive()) >= self.max_peers:
            raise TrackerError(f"tracker is full ({self.max_peers} peers)")
        if rank is None or rank < 1 or rank in self.members:
            rank = max(self.members, default=0) + 1
        m = Member(rank, peer_id, listen, [])
        self.members[rank] = m
        self.by_peer_id[peer_id] = rank
        m.parents = self._place(rank)
        return m

    def adoptions(self, member: Member) -> list[Member]:
        """Move peers under the newcomer ``member`` where the topology says so (``adopts``).

        Updates their parents here and returns them; each must be sent a
        REPARENT with its new parent list.  Done or departed peers stay put.
        """
        adopts = getattr(self.topology, "adopts", None)
        if adopts is None or member.left:
            return []
        moved = []
        for child, stripe in adopts(member.rank):
            m = self.members.get(child)
            if m is None or m.left or m.done or m.parents[stripe] == member.rank:
                continue
            m.parents[stripe] = member.rank
            if m not in moved:
                moved.append(m)
        return moved

    def _place(self, rank: int) -> list[int]:
        alive = self.alive()
        return [live_parent(self.topology, rank, s, alive) for s in range(self.topology.stripes)]

    def parent_addrs(self, member: Member) -> list[dict]:
        return [{"rank": p, "addr": self.listen_of(p), "stripe": s} for s, p in enumerate(member.parents)]

    def done(self, rank: int, seconds: float | None = None) -> None:
        m = self._member(rank)
        m.done, m.seconds = True, seconds

    def dependents(self, rank: int) -> list[int]:
        """Unfinished peers that pull from ``rank`` in some stripe."""
        return [m.rank for m in self.members.values() if not m.left and not m.done and rank in m.parents]

    def leave(self, rank: int) -> list[int]:
        """Let ``rank`` leave if nobody depends on it; returns who it must still wait for."""
        waiting = self.dependents(rank)
        if not waiting:
            self._member(rank).left = True
        return waiting

    def gone(self, rank: int) -> list[tuple[int, int]]:
        """``rank`` left without asking (closed, or found dead): place nobody under it.

        Re-attaches its direct dependents to their nearest live ancestor (their own
        subtrees stay under them) and returns them as (rank, stripe) pairs to notify."""
        self._member(rank).left = True
        moved = []
        for m in self.members.values():
            if m.left:
                continue
            for stripe, parent in enumerate(m.parents):
                if parent == rank:
                    m.parents[stripe] = self._ancestor(rank, stripe)
                    moved.append((m.rank, stripe))
        return moved

    def _ancestor(self, rank: int, stripe: int) -> int:
        """The nearest live ancestor of ``rank`` in tree ``stripe``."""
        alive = self.alive()
        parent = rank
        while parent != ROOT:
            parent = self.topology.parents(parent)[stripe]
            if parent == ROOT or parent in alive:
                return parent
        return ROOT

    def reparent(self, rank: int, stripe: int, parent: int, dead: bool) -> int:
        """``rank`` lost ``parent`` in ``stripe`` (dead, or sending bad chunks): its new parent there."""
        m = self._member(rank)
        if dead and parent != ROOT and parent in self.members:
            self.gone(parent)
        if m.parents[stripe] == parent:
            m.parents[stripe] = self._ancestor(parent, stripe) if parent != ROOT else ROOT
        return m.parents[stripe]

    def touch(self, rank: int) -> None:
        if rank in self.members:
            self.members[rank].seen = time.monotonic()

    def _member(self, rank: int) -> Member:
        try:
            return self.members[rank]
        except KeyError:
            raise TrackerError(f"no peer has rank {rank}") from None

    def tree(self) -> dict[int, list[int]]:
        """Rank -> parent ranks, for every peer that joined."""
        return {r: list(m.parents) for r, m in self.members.items()}
