"""Fleet: an immutable snapshot of the tracker's members, for status and metrics.

The seeder's loop takes a snapshot (``snapshot``) every heartbeat and whenever
membership changed, and publishes it as one object; every other thread (the
CLI, ``/metrics``, ``p2pw status`` answers) reads only that object, never the
tracker's live member table.  Progress is what each peer last reported holding
(``have / n_chunks``); its rate is the sum of the rates it reported getting
from its partners while downloading, its mean rate once done.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

MAX_LISTED = 1000  # peers one STATUS_REPLY lists (the slowest first); the count covers them all
SILENT_AFTER = 5.0  # a member not heard from this long is shown as silent
STATES = ("waiting", "downloading", "silent", "done", "left")


@dataclass(frozen=True)
class PeerStatus:
    """One member as the tracker knew it when the snapshot was taken."""

    rank: int
    peer_id: str
    addr: str
    sources: tuple[int, ...]  # planned source (parent) in each stripe
    have: int
    progress: float  # 0.0-1.0
    rate: float  # bytes per second
    state: str  # one of STATES
    done: bool
    left: bool
    demoted: bool

    def to_doc(self) -> dict:
        return {"rank": self.rank, "peer_id": self.peer_id, "addr": self.addr, "sources": list(self.sources),
                "have": self.have, "progress": self.progress, "rate": self.rate, "state": self.state,
                "demoted": self.demoted}


@dataclass(frozen=True)
class Fleet:
    """Every member of one broadcast, slowest first (unfinished by progress, then rate; done; left)."""

    model_id: str
    n_chunks: int
    total_size: int
    taken_at: float  # wall clock (epoch seconds)
    peers: tuple[PeerStatus, ...]

    @property
    def done(self) -> int:
        """Peers that reported done (including those that left since)."""
        return sum(p.done for p in self.peers)

    @property
    def live(self) -> int:
        """Peers that have not left."""
        return sum(not p.left for p in self.peers)

    @property
    def all_left(self) -> bool:
        return all(p.left for p in self.peers)

    def to_doc(self, limit: int | None = None) -> dict:
        shown = self.peers if limit is None else self.peers[:limit]
        return {"model_id": self.model_id, "n_chunks": self.n_chunks, "total_size": self.total_size,
                "taken_at": self.taken_at, "count": len(self.peers), "peers": [p.to_doc() for p in shown]}

    def encode(self, limit: int = MAX_LISTED) -> bytes:
        """The STATUS_REPLY payload: the document of at most ``limit`` peers, as JSON."""
        return json.dumps(self.to_doc(limit), separators=(",", ":")).encode()


def _order(p: PeerStatus) -> tuple:
    return (p.left, p.done, p.state != "silent", p.progress, p.rate, p.rank)


def snapshot(tracker, manifest, now: float | None = None) -> Fleet:
    """The fleet as ``tracker`` knows it now.  Call on the thread that owns the tracker (the loop)."""
    now = tracker.clock() if now is None else now
    n, total = manifest.n_chunks, manifest.total_size
    peers = []
    for rank, m in tracker.members.items():
        have = min(max(int(m.have), 0), n)
        done = bool(m.done)
        if m.left:
            state = "left"
        elif done:
            state = "done"
        elif now - m.seen > SILENT_AFTER:
            state = "silent"
        else:
            state = "downloading" if have else "waiting"
        if done:
            rate = total / m.seconds if m.seconds else 0.0
        else:
            rate = float(sum(m.rates.values())) if not m.left else 0.0
        peers.append(PeerStatus(rank=rank, peer_id=m.peer_id, addr=m.listen, sources=tuple(m.parents),
                                have=n if done else have, progress=1.0 if done else (have / n if n else 1.0),
                                rate=round(rate, 1), state=state, done=bool(m.done), left=bool(m.left),
                                demoted=bool(m.demoted)))
    peers.sort(key=_order)
    return Fleet(manifest.model_id, n, total, time.time(), tuple(peers))
