"""Topology: pure rules that place peer ranks in the distribution tree(s).

Rank 0 is the seeder (the root of every tree); peers get ranks 1, 2, 3, ... in
join order.  A topology has ``stripes`` trees; chunk ``i`` travels down tree
``i % stripes``.  ``parents(rank)`` gives one parent rank per stripe and must
never change when later ranks join.  ``live_parent`` re-attaches a peer whose
parent is gone by walking up to the nearest live ancestor.
"""
from __future__ import annotations


class Binomial:
    """Binomial tree: a rank's parent is the rank with its highest set bit cleared."""

    name = "binomial"
    stripes = 1

    def parents(self, rank: int) -> list[int]:
        if rank < 1:
            raise ValueError("rank 0 is the root and has no parent")
        return [rank & ~(1 << (rank.bit_length() - 1))]


TOPOLOGIES = {"binomial": Binomial}


def make(name: str):
    """The topology called ``name``; ValueError naming the known ones otherwise."""
    try:
        return TOPOLOGIES[name]()
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(sorted(TOPOLOGIES))}") from None


def live_parent(topology, rank: int, stripe: int, alive) -> int:
    """Nearest ancestor of ``rank`` in tree ``stripe`` that is in ``alive`` (rank 0 always is)."""
    parent = topology.parents(rank)[stripe]
    while parent != 0 and parent not in alive:
        parent = topology.parents(parent)[stripe]
    return parent
