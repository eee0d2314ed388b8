"""Progress: a bar on a terminal, else a progress line every 10 s (``Progress``); the seeder's line about its fleet
every 10 s (``FleetProgress``)."""
from __future__ import annotations

import logging
import sys
import threading
import time

progress_log = logging.getLogger("p2pw.progress")  # INFO even when the rest logs only warnings
PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f}"


class Progress:
    """A one-line bar redrawn on a terminal; elsewhere (a pod's log) a progress line every ``every`` s."""

    def __init__(self, download, stream=None, every: float = PROGRESS_EVERY):
        self.download = download
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.every = 0.2 if self.tty else every
        self.last = (time.monotonic(), download.progress["bytes"])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="p2pw-progress", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(self.every):
            self.draw() if self.tty else self.line()

    def _rate(self, p: dict) -> float:
        """Bytes/s since the last line (the mean rate on a terminal's fast redraws)."""
        now = time.monotonic()
        t0, b0 = self.last
        self.last = (now, p["bytes"])
        return (p["bytes"] - b0) / (now - t0) if now > t0 and not self.tty else p["rate"]

    def draw(self):
        p = self.download.progress
        frac = p["bytes"] / p["total"] if p["total"] else 1.0
        eta = (p["total"] - p["bytes"]) / p["rate"] if p["rate"] > 0 else float("inf")
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        self.stream.write(f"\r[{bar}] {human(p['bytes'])}/{human(p['total'])} "
                          f"{p['rate'] / 1e6:7.1f} MB/s ETA {eta:5.1f}s ")
        self.stream.flush()

    def line(self, final: bool = False):
        """One progress line through the log (text or JSON): bytes, percent, rate, ETA, sources."""
        dl = self.download
        p = dl.progress
        rate = self._rate(p) if not final else p["rate"]
        left = p["total"] - p["bytes"]
        eta = left / rate if rate > 0 else None
        pct = round(100.0 * p["bytes"] / p["total"], 1) if p["total"] else 100.0
        sources = [x["rank"] for x in dl.parents]
        progress_log.info("%s %s/%s (%.1f%%) %.1f MB/s ETA %s sources %s", "progress",
                          human(p["bytes"]), human(p["total"]), pct, rate / 1e6,
                          f"{eta:.0f}s" if eta is not None else "-",
                          ", ".join(f"rank {r}" for r in sources) or "none",
                          extra={"event": "progress", "bytes": p["bytes"], "total": p["total"], "pct": pct,
                                 "rate": round(rate, 1), "eta_s": round(eta, 1) if eta is not None else None,
                                 "sources": sources})

    def close(self):
        """Stop; the bar's last state, or (off a terminal) a last line with the mean rate."""
        self.stop.set()
        self.thread.join()
        if self.tty:
            self.draw()
            self.stream.write("\n")
        else:
            self.line(final=True)


class FleetProgress:
    """The seeder's line every ``every`` s while some live peer is not done: peers, done, the slowest."""

    def __init__(self, seeder, every: float = PROGRESS_EVERY):
        self.seeder, self.every = seeder, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="p2pw-fleet-progress", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(self.every):
            self.line()

    def line(self) -> None:
        f = self.seeder.fleet  # the loop's published snapshot, never the live member table
        busy = [p for p in f.peers if not p.left and not p.done]
        if not busy:
            return
        slow = busy[0]
        progress_log.info("fleet: %d peers, %d done; slowest rank %d (%s) at %.1f%%, %.1f MB/s, %s",
                          f.live, f.done, slow.rank, slow.addr, 100 * slow.progress, slow.rate / 1e6, slow.state,
                          extra={"event": "fleet", "peers": f.live, "done": f.done, "slowest": slow.rank,
                                 "slowest_progress": slow.progress, "slowest_rate": slow.rate})

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
