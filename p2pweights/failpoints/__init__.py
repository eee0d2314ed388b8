"""Failpoints: opt-in fault injection, switched on through the environment by tests and chaos benchmarks; never active by default.

Set ``P2PW_FAULTS`` in a node's environment to a comma-separated list:

- ``corrupt=P``: flip a byte in a fraction P of the chunks this node sends (its store stays intact)
- ``drop=P``: silently skip a fraction P of the chunks this node would send
- ``delay_send=MS``: sleep MS milliseconds before each chunk this node sends
- ``delay_recv=MS``: sleep MS milliseconds after each chunk this node receives (a slow reader)
- ``hang_after=N``: stop for good on the N-th chunk this node receives, before storing it (a hung host:
  alive, silent)
- ``seed=N``: seed of the random choices, for repeatable runs

``P2PW_FAULT_FORGE=I[,J...]`` also makes the node send xxh3-preserving forgeries
of those chunks (``forgery.py``); both arrive through the same hook.

The node asks ``FAULTS`` (None when the variable is unset), so the hot path pays
one ``is None`` test when no fault is configured.
"""
from __future__ import annotations

import logging
import os
import random
import time

from ..errors import UserError

log = logging.getLogger("p2pw")


class Faults:
    """What to do wrong, and how often (``forger``: a forgery.Forger, from P2PW_FAULT_FORGE)."""

    def __init__(self, corrupt: float = 0.0, drop: float = 0.0, delay_send: float = 0.0, delay_recv: float = 0.0,
                 seed: int | None = None, forger=None, hang_after: int = 0):
        self.corrupt, self.drop, self.delay_send, self.delay_recv = corrupt, drop, delay_send, delay_recv
        self.hang_after, self.n_received = hang_after, 0
        self.seed, self.forger = seed, forger
        self.rng = random.Random(seed)

    def outgoing(self, index: int, data):
        """The bytes to send for chunk ``index`` (maybe forged or corrupted), or None to drop it."""
        if self.forger is not None:
            data = self.forger.outgoing(index, data)
        if self.delay_send:
            time.sleep(self.delay_send)
        if self.drop and self.rng.random() < self.drop:
            return None
        if self.corrupt and self.rng.random() < self.corrupt and len(data):
            bad = bytearray(data)
            bad[self.rng.randrange(len(bad))] ^= 0xFF
            return bad
        return data

    def received(self) -> None:
        self.n_received += 1
        if self.delay_recv:
            time.sleep(self.delay_recv)
        while self.hang_after and self.n_received >= self.hang_after:
            time.sleep(3600)


def parse(spec: str) -> Faults:
    """Parse a ``P2PW_FAULTS`` value; ValueError naming the bad item."""
    f = Faults()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition("=")
        try:
            if key in ("corrupt", "drop"):
                setattr(f, key, float(value))
            elif key in ("delay_send", "delay_recv"):
                setattr(f, key, float(value.removesuffix("ms")) / 1000)
            elif key == "seed":
                f.seed = int(value)
            elif key == "hang_after":
                f.hang_after = int(value)
            else:
                raise ValueError
        except ValueError:
            raise UserError(f"bad P2PW_FAULTS item {item!r}") from None
    f.rng = random.Random(f.seed)
    return f


def from_env() -> Faults | None:
    """The faults this node's environment asks for, or None (the normal case)."""
    from . import forgery

    spec = os.environ.get("P2PW_FAULTS")
    forger = forgery.from_env()
    if not spec and forger is None:
        return None
    faults = parse(spec or "")
    faults.forger = forger
    if spec:
        log.warning("fault injection is ON (P2PW_FAULTS=%s)", spec)
    return faults
