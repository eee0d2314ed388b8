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

    def join(self, peer_id: str, listen: str) -> Member:
        """Place a joining peer (the same peer_id re-joining keeps its rank)."""
        rank = self.by_peer_id.get(peer_id)
        if rank is not None:
            m = self.members[rank]
            m.listen, m.left = listen, False
            m.parents = self._place(rank)
            return m
        if len(self.alive()) >= self.max_peers:
            raise TrackerError(f"tracker is full ({self.max_peers} peers)")
        rank = len(self.members) + 1
        m = Member(rank, peer_id, listen, [])
        self.members[rank] = m
        self.by_peer_id[peer_id] = rank
        m.parents = self._place(rank)
        return m

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

    def gone(self, rank: int) -> None:
        """``rank`` left without asking (closed, or found dead): place nobody under it."""
        self._member(rank).left = True

    def _member(self, rank: int) -> Member:
        try:
            return self.members[rank]
        except KeyError:
            raise TrackerError(f"no peer has rank {rank}") from None

    def tree(self) -> dict[int, list[int]]:
        """Rank -> parent ranks, for every peer that joined."""
        return {r: list(m.parents) for r, m in self.members.items()}
