"""The agent's pre-warm list: a file of model URLs or ids, watched; each line is pulled and kept.

A new line is pulled (``Keeper.get``) and its model kept out of eviction; a removed line's
model stays served but becomes evictable.  A line whose pull failed is tried again after
``RETRY`` seconds, doubling up to ``RETRY_MAX``.
"""
from __future__ import annotations

import logging
import threading
import time

from .rules import PrewarmFile, changes, readiness

log = logging.getLogger("p2pw")

RETRY = 10.0
RETRY_MAX = 300.0


class Prewarm:
    """The lines of ``path`` and the model each one resolved to, applied to ``keeper``."""

    def __init__(self, path: str, keeper, clock=time.monotonic):
        self.file, self.keeper, self.clock = PrewarmFile(path), keeper, clock
        self.lines: list[str] = []
        self.ids: dict[str, str] = {}  # line -> model id, once resolved
        self.failed: dict[str, tuple[float, float]] = {}  # line -> (retry at, backoff)
        self.busy: set[str] = set()
        self.lock = threading.Lock()

    def tick(self) -> None:
        """Look at the file; pull what was added, let go of what was removed, retry what failed."""
        new = self.file.poll()
        if new is not None:
            added, removed = changes(self.lines, new)
            self.lines = new
            for line in removed:
                log.warning("pre-warm: %s removed from the list: its model may be evicted", line)
                self.ids.pop(line, None)
                self.failed.pop(line, None)
            self._kept()
            for line in added:
                self._pull(line)
        now = self.clock()
        for line, (at, _) in list(self.failed.items()):
            if now >= at and line in self.lines:
                self._pull(line)
        for line, model_id in list(self.ids.items()):
            h = self.keeper.held.get(model_id)
            if (h is None or h.state == "failed") and line not in self.failed and line not in self.busy:
                self._pull(line)  # evicted by hand, or its node failed: fetch it again

    def _kept(self) -> None:
        self.keeper.kept = {self.ids[line] for line in self.lines if line in self.ids}

    def _pull(self, line: str) -> None:
        with self.lock:
            if line in self.busy:
                return
            self.busy.add(line)
        threading.Thread(target=self._get, args=(line,), name="p2pw-prewarm", daemon=True).start()

    def _get(self, line: str) -> None:
        try:
            h = self.keeper.get(line)
            if line in self.lines:
                self.ids[line] = h.model_id
                self._kept()
            self.failed.pop(line, None)
            log.info("pre-warm: %s is model %s (%s)", line, h.model_id[:16], h.state)
        except Exception as e:  # noqa: BLE001 (told, retried later)
            backoff = min(self.failed.get(line, (0.0, RETRY / 2))[1] * 2, RETRY_MAX)
            self.failed[line] = (self.clock() + backoff, backoff)
            log.warning("pre-warm: %s: %s (trying again in %.0f s)", line, str(e).splitlines()[0] if str(e) else
                        type(e).__name__, backoff)
        finally:
            with self.lock:
                self.busy.discard(line)

    def states(self) -> dict[str, str]:
        """Each listed line's state: its model's, or starting / failed before it resolved."""
        out = {}
        for line in self.lines:
            h = self.keeper.held.get(self.ids.get(line, ""))
            out[line] = h.state if h is not None else "failed" if line in self.failed else "starting"
        return out

    def ready(self) -> tuple[bool, dict]:
        return readiness(self.states())
