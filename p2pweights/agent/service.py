"""The node agent as one object: its models (``keeper``), its local socket (``server``), its pre-warm list, and the
loop that ticks them; ``p2pw agent`` (``cli/agent.py``) runs one.

Its probes (``rules.alive``): alive while the loop ticked within ``WEDGED`` seconds and the socket answers a
``status`` within ``ANSWER`` seconds (a tracker away or a model failing is neither); ready while alive: local
clients can be served.  A pre-warm model's completeness is its own probe (``/readyz/MODEL``)."""
from __future__ import annotations

import logging
import os
import threading
import time

from . import rules

log = logging.getLogger("p2pw")

TICK = 0.5  # seconds between looks at the pre-warm file and the models' nodes
WEDGED = 60.0  # seconds without a tick after which the agent is not alive
ANSWER = 5.0  # seconds the socket has to answer a probe's status


class Agent:
    """A running agent: its ``keeper`` (models), its socket ``server``, its ``prewarm`` list (or None)."""

    def __init__(self, tracker: str, cache_dir: str, *, key=None, prewarm: str | None = None,
                 cache_size: int | None = None, socket_group: str | None = None, host: str = "0.0.0.0",
                 advertise: str | None = None, no_origin: bool = False, connect_timeout: float = 30.0,
                 local_roots=()):
        from ..storage.modelcache import ModelCache
        from .keeper import Keeper
        from .prewarm import Prewarm
        from .server import LocalServer

        root = os.path.abspath(cache_dir)
        os.makedirs(root, exist_ok=True)
        cache = ModelCache(root=root, size=cache_size)
        self.keeper = Keeper(tracker, cache, key=key, host=host, advertise=advertise, no_origin=no_origin,
                             connect_timeout=connect_timeout, local_roots=local_roots)
        self.prewarm = Prewarm(prewarm, self.keeper) if prewarm else None
        self.server = LocalServer(root, self.keeper, socket_group, status=self.status)
        self.stopped = threading.Event()
        self.ticked = time.monotonic()
        self.resumed = self.keeper.resume()
        self.thread = threading.Thread(target=self._run, name="p2pw-agent", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(TICK):
            self.ticked = time.monotonic()
            try:
                self.keeper.check()
                if self.prewarm is not None:
                    self.prewarm.tick()
            except Exception:  # noqa: BLE001 (a bad tick is logged; the agent goes on)
                log.exception("agent: tick failed")

    def alive(self) -> bool:
        """The loop and the socket's thread run (what ``p2pw agent`` exits on): not a probe, see ``probe``."""
        return self.thread.is_alive() and self.server.thread.is_alive()

    def probe(self) -> tuple[bool, str]:
        """``(alive, why not)`` for ``/healthz`` and ``/readyz``: ``rules.alive`` of the loop's last tick and a
        ``status`` asked of the socket as a client would."""
        from ..wire import local

        answered = None
        if self.alive():
            try:
                local.ask(self.server.root, {"op": "status"}, timeout=ANSWER)
                answered = True
            except local.AgentAway:
                answered = False
            except local.AgentError as e:  # busy, or answering slowly: a line, not a wedge unless it timed out
                answered = "did not answer" not in str(e)
        return rules.alive(self.alive(), time.monotonic() - self.ticked, answered, WEDGED)

    def ready(self) -> tuple[bool, dict]:
        """Whether every pre-warm model is complete here (and those that are not): ``/readyz/MODEL``'s, per model."""
        return self.prewarm.ready() if self.prewarm is not None else (True, {})

    def status(self) -> dict:
        ready, waiting = self.ready()
        return {"ready": ready, "waiting": waiting, "prewarm": self.prewarm.lines if self.prewarm else [],
                "refused": self.server.refused}

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.server.close()
        self.keeper.close()
