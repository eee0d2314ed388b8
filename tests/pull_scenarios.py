"""Seeded pull scenarios: partners that gain chunks and deliver what is asked at their own pace,
driven through the pull scheduler's verbs, every decision it returns written down.

``tests/data/pull_decisions.json`` holds the decisions of ``SCENARIOS`` scenarios;
``tests/test_pull_decisions.py`` asserts the scheduler still decides exactly the same.  Write it
again only for a change of policy that is meant: ``python tests/pull_scenarios.py``.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from test_pull import CHUNK, Clock

from p2pweights.swarm.policy.pull import PullScheduler

FIXTURE = Path(__file__).resolve().parent / "data" / "pull_decisions.json"
SCENARIOS = 160
STEPS = 140

def _fmt(pairs) -> str:
    """``[(rank, [chunk, ...]), ...]`` as ``'1:0,1 2:5'``."""
    return " ".join(f"{r}:{','.join(map(str, c))}" for r, c in pairs)


def run(seed: int) -> list[str]:
    """The decisions of scenario ``seed``, one line each: its verb, then what it returned."""
    w = random.Random(seed)  # the world's choices; the scheduler draws from its own generator
    n, stripes, window = w.choice((8, 16, 32, 64, 96)), w.choice((1, 1, 2, 3, 4)), w.choice((2, 4, 8))
    ranks = list(range(w.randint(2, 6)))  # rank 0 is the seeder: it holds every chunk
    holds = {0: set(range(n))}
    for r in ranks[1:]:
        cut = w.randint(0, n)
        holds[r] = {i for i in range(n) if i < cut or w.random() < 0.2}
    pace = {r: w.choice((0.002, 0.01, 0.03, 0.1, 0.5, 4.0, 1e9)) for r in ranks}  # seconds per chunk it sends
    have = [w.random() < 0.15 for _ in range(n)]
    clock = Clock()
    s = PullScheduler(n, CHUNK, have=have, stripes=stripes, window=window, clock=clock,
                      rng=random.Random(seed * 7919 + 1))
    s.set_plan([w.choice(ranks + [None]) for _ in range(stripes)])
    attaching: dict[int, float] = {}  # rank -> when it attaches
    for r in ranks:
        if w.random() < 0.8:
            s.add(r)
            attaching[r] = w.choice((0.0, 0.0, 0.3, 2.0, 1e9))
    log: list[str] = []
    for step in range(STEPS):
        clock.t += w.choice((0.001, 0.005, 0.02, 0.05, 0.2, 1.0, 3.0))
        for r, at in sorted(attaching.items()):
            if clock.t >= at and r in s.links:
                s.ready(r, [i in holds[r] for i in range(n)])
                del attaching[r]
        for r in sorted(s.links):  # deliveries: at its pace, what it holds, oldest asked first
            lk = s.links[r]
            queue = sorted((t, i) for i, t in lk.outstanding.items() if i in holds[r])
            for k, (t, i) in enumerate(queue):
                if clock.t - t >= pace[r] * (k + 1) and s.expects(r, i) and r in s.links:
                    s.arrived(r, i, ok=w.random() > 0.03)
        for r in ranks[1:]:  # partners gain chunks and say so
            if w.random() < 0.5:
                new = [i for i in range(n) if i not in holds[r] and w.random() < 0.15]
                holds[r].update(new)
                if new:
                    s.has(r, new)
        roll = w.random()
        if roll < 0.04:
            r = w.choice(ranks)
            log.append(f"{step} drop {r}: {','.join(map(str, s.drop(r)))}")
        elif roll < 0.09:
            r = w.choice(ranks)
            if r not in s.links:
                s.add(r)
                attaching[r] = clock.t + w.choice((0.0, 0.5, 2.0))
        elif roll < 0.13:
            s.set_plan([w.choice(ranks + [None]) for _ in range(s.stripes)])
        elif roll < 0.18:
            s.set_downstream({r: w.randint(0, 5) for r in ranks[1:] if w.random() < 0.7},
                             slow={r for r in ranks[1:] if w.random() < 0.25}, lent=w.random() < 0.3)
        elif roll < 0.21:
            lo = w.randrange(n)
            s.prioritize(range(lo, min(n, lo + w.randint(1, 6))))
        elif roll < 0.23:
            i = w.randrange(n)
            if not s.got(i):
                s.verified(i)
        elif roll < 0.24:
            r = w.choice(ranks)
            if r in s.links and s.links[r].ready:  # a bitfield again
                s.ready(r, [i in holds[r] for i in range(n)])
        elif roll < 0.25:
            log.append(f"{step} waiting_for {','.join(map(str, s.waiting_for()))}")
        elif roll < 0.27:
            for lk in s.links.values():  # a rate read elsewhere (as tests set one)
                if w.random() < 0.3:
                    lk.rate = w.choice((1e6, 5e6, 20e6, 80e6))
        for verb, decide in (("stalled", s.stalled if w.random() < 0.3 else list), ("requests", s.requests),
                             ("cancels", s.take_cancels)):
            said = decide()
            if said:
                log.append(f"{step} {verb} {_fmt(said)}")
        if s.complete:
            break
    return log


def record() -> dict[str, list[str]]:
    return {str(seed): run(seed) for seed in range(SCENARIOS)}


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
