"""Lanes: several connections from one partner, so the chunks it pulls ride several libzmq I/O threads.

libzmq carries every byte of a connection on one I/O thread, about 3.5-6.5
GB/s here: one partner's chunks over one connection cannot fill a faster NIC
however many I/O threads a host has.  A peer that pulls with L lanes keeps
its link (the connection that ATTACHed, which carries every request and
control message both ways) and, once ATTACHED says how many connections the
partner takes, opens up to L - 1 more, each saying LANE with the link's rank,
peer id and ticket.  The serving node binds a lane to the child attached with
that rank and peer id from the same address, and sends that child's chunks
round-robin over its link and lanes, passing one whose queue is full.  A lane
is a path for bytes, not a partner: requests, credit, parked requests, the
serve turn and heartbeats stay per child, and a lane that drops only takes
itself away (a chunk lost in it is asked again, as any stalled request).

``Lanes`` is the serving side's record (pure: the node asks, then acts).
"""
from __future__ import annotations

MAX_LANES = 8  # connections one child may pull over from a node: its link and up to 7 lanes


class Lanes:
    """The lanes of each child of a serving node, by ZeroMQ identity."""

    def __init__(self, max_lanes: int = MAX_LANES):
        self.max_lanes = max_lanes
        self.paths: dict[bytes, list[bytes]] = {}  # a child's link -> [its link, its lanes...]: where its chunks go
        self.child: dict[bytes, bytes] = {}  # a lane -> the link of the child it carries chunks for
        self.next: dict[bytes, int] = {}  # a child's link -> the path its next chunk tries first

    @staticmethod
    def child_of(children: dict, rank: int, peer_id: str) -> bytes | None:
        """The link (identity) of the child attached as ``rank`` with ``peer_id`` (the latest, if it attached
        twice), or None."""
        found = None
        for ident, child in children.items():
            if child.rank == rank and child.peer_id == peer_id:
                found = ident
        return found

    def refusal(self, link: bytes | None, lane: int, same_host: bool) -> str | None:
        """Why lane number ``lane`` for the child on ``link`` (None: nobody attached as that rank and peer id)
        is refused (``same_host``: it comes from that link's address), or None to take it."""
        if link is None:
            return "lane for a partner not attached here (ATTACH first, then open lanes)"
        if not same_host:
            return "lane from another address than its partner's link"
        if not 1 <= lane < self.max_lanes or self.count(link) >= self.max_lanes:
            return f"a partner pulls over at most {self.max_lanes} connections here (its link and its lanes)"
        return None

    def add(self, link: bytes, lane: bytes) -> None:
        """``lane`` carries chunks for the child on ``link`` from now on."""
        self.paths.setdefault(link, [link]).append(lane)
        self.child[lane] = link

    def order(self, link: bytes):
        """Where to try sending the child on ``link`` its next chunk: each of its paths once, starting after
        the one the last chunk took (``took``)."""
        paths = self.paths.get(link)
        if paths is None:
            return (link,)
        first = self.next.get(link, 0) % len(paths)
        return paths[first:] + paths[:first]

    def took(self, link: bytes, path: bytes) -> None:
        """The chunk for ``link`` went out on ``path``: the next one tries the path after it first."""
        paths = self.paths.get(link)
        if paths is not None:
            self.next[link] = paths.index(path) + 1

    def drop(self, ident: bytes) -> list[bytes]:
        """Connection ``ident`` is gone.  A lane: its child sends on the rest.  A child's link: the child and
        every lane of it are forgotten, and those lanes are returned (to forget their connections too)."""
        link = self.child.pop(ident, None)
        if link is not None:
            self.paths[link].remove(ident)
            if len(self.paths[link]) == 1:
                del self.paths[link]
                self.next.pop(link, None)
            return []
        lanes = self.paths.pop(ident, [ident])[1:]
        self.next.pop(ident, None)
        for lane in lanes:
            del self.child[lane]
        return lanes

    def is_lane(self, ident: bytes) -> bool:
        return ident in self.child

    def count(self, link: bytes) -> int:
        """Connections the child on ``link`` pulls over: its link and its lanes."""
        return len(self.paths.get(link, (link,)))
