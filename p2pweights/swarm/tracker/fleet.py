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
from typing import NamedTuple

MAX_LISTED = 1000  # peers one STATUS_REPLY lists (the slowest first); the count covers them all
SILENT_AFTER = 5.0  # a member not heard from this long is shown as silent
STATES = ("waiting", "downloading", "silent", "done", "left")


class PeerStatus(NamedTuple):
    """One member as the tracker knew it when the snapshot was taken (a tuple: cheap to make, immutable)."""

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

    def to_doc(self, ids: bool = True) -> dict:
        """``ids``: with its peer id (a keyed fleet's STATUS, the seeder's own report)."""
        doc = {"rank": self.rank, "peer_id": self.peer_id, "addr": self.addr, "sources": list(self.sources),
               "have": self.have, "progress": self.progress, "rate": self.rate, "state": self.state,
               "demoted": self.demoted}
        if not ids:
            del doc["peer_id"]
        return doc


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

    def to_doc(self, limit: int | None = None, ids: bool = True) -> dict:
        shown = self.peers if limit is None else self.peers[:limit]
        return {"model_id": self.model_id, "n_chunks": self.n_chunks, "total_size": self.total_size,
                "taken_at": self.taken_at, "count": len(self.peers), "peers": [p.to_doc(ids) for p in shown]}

    def encode(self, limit: int = MAX_LISTED, ids: bool = True) -> bytes:
        """The STATUS_REPLY payload: the document of at most ``limit`` peers, as JSON (``ids``: with peer ids)."""
        return json.dumps(self.to_doc(limit, ids), separators=(",", ":")).encode()


def _order(p: PeerStatus) -> tuple:
    return (p.left, p.done, p.state != "silent", p.progress, p.rate, p.rank)


def snapshot(tracker, manifest, now: float | None = None) -> Fleet:
    """The fleet as ``tracker`` knows it now.  Call on the thread that owns the tracker (the loop)."""
    now = tracker.clock() if now is None else now
    n, total = manifest.n_chunks, manifest.total_size
    silent_since = now - SILENT_AFTER
    peers = []
    for rank, m in tracker.members.items():
        done, left = bool(m.done), bool(m.left)
        if done:
            have, progress, rate = n, 1.0, (total / m.seconds if m.seconds else 0.0)
            state = "left" if left else "done"
        else:
            have = min(max(int(m.have), 0), n)
            progress = have / n if n else 1.0
            rate = 0.0 if left else float(sum(m.rates.values()))
            state = "left" if left else "silent" if m.seen < silent_since else "downloading" if have else "waiting"
        peers.append(PeerStatus(rank, m.peer_id, m.listen, tuple(m.parents), have, progress, round(rate, 1),
                                state, done, left, bool(m.demoted)))
    peers.sort(key=_order)
    return Fleet(manifest.model_id, n, total, time.time(), tuple(peers))
