"""The node agent as one object: its models (``keeper``), its local socket (``server``), its pre-warm list, and the
loop that ticks them; ``p2pw agent`` (``cli/agent.py``) runs one."""
from __future__ import annotations

import logging
import os
import threading


log = logging.getLogger("p2pw")

TICK = 0.5  # seconds between looks at the pre-warm file and the models' nodes


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
        self.resumed = self.keeper.resume()
        self.thread = threading.Thread(target=self._run, name="p2pw-agent", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(TICK):
            try:
                self.keeper.check()
                if self.prewarm is not None:
                    self.prewarm.tick()
            except Exception:  # noqa: BLE001 (a bad tick is logged; the agent goes on)
                log.exception("agent: tick failed")

    def alive(self) -> bool:
        return self.thread.is_alive() and self.server.thread.is_alive()

    def ready(self) -> tuple[bool, dict]:
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
