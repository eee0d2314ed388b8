"""Simulate: predict broadcast time of the chunked, credit-windowed tree protocol.

A discrete-event model at chunk granularity of exactly what the nodes do; no
sockets, no wall clock.  Theory of operation:

* The blob (``size`` bytes) is cut into chunks of ``chunk`` bytes; chunk i goes
  down stripe tree ``i % stripes`` of the topology (``p2pweights.swarm.tracker.topology``).
* Each peer has one connection per stripe (to its parent in that stripe, as
  the node opens one DEALER per stripe) and keeps at most ``window`` chunk
  requests outstanding on it, asking for the stripe's chunks in index order.  A request reaches the parent ``latency`` seconds later; the parent
  queues the chunk on that connection if it holds it, else parks the request
  until the chunk is verified (fully received) and then queues it.
* A connection sends its queue in FIFO order.  Every host's uplink,
  ``uplink * efficiency`` bytes/s, is shared equally among its connections
  that have something queued (processor sharing, which is max-min fair when
  uplinks are the only caps; TCP through an htb qdisc behaves about so).
  ``efficiency`` = 0.956 is what TCP gets of an htb rate on the testbed
  (frame overhead, LIMITS.md).  Downlinks are not capped.
* A chunk reaches the child ``latency`` seconds after its last byte left the
  parent; the child holds it then (verification is free), asks for its next
  chunk and serves parked requests of its own children.

Cost: a few events per chunk per peer.  When ``nodes * chunks`` exceeds
``budget`` the model is run twice with coarser chunks (g and 2g chunks glued
into one, the window kept in bytes) and extrapolated linearly to the real chunk
size: with no latency, broadcast time is a + b*chunk (bulk term plus a
pipeline-fill term proportional to the chunk size), which is exact for the
closed forms (star, chain) and within a few percent elsewhere.

``python -m p2pweights.swarm.simulate --nodes 16 --size 256MiB --uplink 400Mbit
--chunk 4MiB --topology striped:2`` prints a one-screen report.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import re
import sys
import time as _time
from dataclasses import dataclass, field

import numpy as np

from .tracker import topology as _topo
from .tracker.endpoint import YOUNG_REVIEW_INTERVAL
from .tracker.tracker import PROBE_BYTES, PROBE_MIN_TIME, PROBE_SLOW, SLOW_EVIDENCE, SLOW_FRACTION, probe_reference

DEFAULT_BUDGET = 200_000  # simulated chunk deliveries before coarsening


@dataclass
class Result:
    """Predicted outcome of one broadcast."""

    time_last: float            # seconds until the last peer holds every chunk
    time_per_peer: np.ndarray   # seconds until peer rank r (index r-1) is complete
    seeder_tx_bytes: float      # bytes the seeder's uplink sent
    floor: float                # size / uplink (configured rate), the best possible
    ratio: float                # time_last / floor
    topology: str = ""
    nodes: int = 0
    size: int = 0
    chunk: int = 0
    stripes: int = 1
    depth: int = 0              # deepest stripe tree, hops from the seeder
    coarsened: int = 1          # chunks glued per simulated chunk (1 = exact run)
    cpu_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def summary(self) -> dict:
        """The peers' finish times (a failed peer, NaN in ``time_per_peer``, has none)."""
        t = self.time_per_peer[~np.isnan(self.time_per_peer)]
        if not t.size:
            return {"min": 0.0, "median": 0.0, "max": 0.0}
        return {"min": float(t.min()), "median": float(np.median(t)), "max": float(t.max())}

    def report(self) -> str:
        s = self.summary
        lines = [
            f"topology   {self.topology}  ({self.stripes} stripe{'s' if self.stripes > 1 else ''}, depth {self.depth})",
            f"peers      {self.nodes}",
            f"model      {_fmt_bytes(self.size)} in {math.ceil(self.size / self.chunk)} chunks of {_fmt_bytes(self.chunk)}",
            f"time       {self.time_last:.3f} s   (peers done: min {s['min']:.3f}  median {s['median']:.3f}  max {s['max']:.3f})"
            + (f", joining {self.extra['startup']:.3f} s after the launch" if self.extra.get("startup") else ""),
            f"floor      {self.floor:.3f} s   (size / uplink)",
            f"ratio      {self.ratio:.3f}",
            f"seeder tx  {_fmt_bytes(self.seeder_tx_bytes)} = {self.seeder_tx_bytes / self.size:.2f} x size",
        ]
        if self.coarsened > 1:
            lines.append(f"model run  {self.coarsened} chunks per simulated chunk, extrapolated")
        lines.append(f"cpu        {self.cpu_s:.2f} s")
        return "\n".join(lines)


def resolve_topology(topology, nodes: int = 16, chunks: int = 64):
    """A topology object from a name (``auto`` decides from ``nodes``) or an object."""
    if isinstance(topology, str):
        if topology.strip().lower() == "auto":
            return _topo.auto(nodes, chunks=chunks)
        return _topo.make(topology)
    return topology


def simulate(nodes: int, size: int, uplink: float, chunk: int, topology="forest:2",
             latency: float = 0.0, window: int = 8, efficiency: float = 0.956,
             budget: int = DEFAULT_BUDGET, uplinks=None, failures=(), startup: float = 0.0) -> Result:
    """Predict the broadcast of ``size`` bytes to ``nodes`` peers.

    ``uplink`` is the seeder's configured uplink in bytes/s (and every peer's
    unless ``uplinks`` gives peer r's as ``uplinks[r - 1]``), ``chunk`` the
    chunk size in bytes, ``topology`` a name (``forest:K``, ``binomial``,
    ``chain``, ``star``, ``kary:K``, ``striped:K``, ``auto``) or a topology
    object, ``latency`` the one-way delay of a hop in seconds, ``window`` the
    credit window in chunks.

    ``forest:K`` is the swarm's plan as the tracker settles it: a host whose
    uplink is below ``SLOW_FRACTION`` of the fleet's median is a leaf (the
    tracker demotes it from its partners' reports), the others forward.
    ``failures``: ``(rank, fraction)`` pairs, a peer killed once that fraction
    of the model has gone out; the tracker re-places its dependents and the
    rest of the model flows over the new plan (its in-flight requests are
    re-asked at once: a dropped connection).  ``startup``: seconds from the
    launch until the peers join (the time a process takes to start and reach
    the tracker: interpreter and imports, a container's start), added to every
    peer's.
    """
    if startup < 0:
        raise ValueError("startup must be >= 0")
    res = _predict(nodes, size, uplink, chunk, topology, latency, window, efficiency, budget, uplinks, failures)
    if not startup:
        return res
    t_last = res.time_last + startup
    return dataclasses.replace(res, time_last=t_last, time_per_peer=res.time_per_peer + startup,
                               ratio=t_last / res.floor, extra={**res.extra, "startup": startup})


MAX_NODES = 1_000_000  # time and memory grow with the peers: 100,000 took 23 s and 185 MB here, 10^8 would take hours


def _predict(nodes: int, size: int, uplink: float, chunk: int, topology, latency: float, window: int,
             efficiency: float, budget: int, uplinks, failures) -> Result:
    """``simulate`` from the peers' join."""
    nodes, size, chunk, window = int(nodes), int(size), int(chunk), int(window)
    if nodes < 1 or size < 1 or chunk < 1 or window < 1:
        raise ValueError("nodes, size, chunk and window must be >= 1")
    if nodes > MAX_NODES:
        raise ValueError(f"--nodes {nodes}: the model runs up to {MAX_NODES:,} peers (its time grows with "
                         "them: 100,000 take about 25 s)")
    if uplink <= 0 or not 0 < efficiency <= 1 or latency < 0:
        raise ValueError("uplink must be > 0, efficiency in (0, 1], latency >= 0")
    t0 = _time.process_time()
    n_chunks = math.ceil(size / chunk)
    topo = resolve_topology(topology, nodes, n_chunks)
    ups = np.full(nodes + 1, float(uplink))
    if uplinks is not None:
        ups[1:] = np.broadcast_to(np.asarray(uplinks, dtype=float), (nodes,))
    if (ups <= 0).any():
        raise ValueError("every uplink must be > 0")
    rate = ups * efficiency
    for rank, fraction in failures:
        if not (1 <= rank <= nodes and 0 <= fraction <= 1):
            raise ValueError(f"--kill {rank}@{fraction}: RANK must be a peer (1-{nodes}), FRACTION in [0, 1]")
    dead = sorted(failures, key=lambda f: f[1])
    if dead:
        return _with_failures(nodes, size, uplink, chunk, topo, rate, latency, window, budget, dead, t0)
    if isinstance(topo, _topo.Forest) and nodes > 1 and np.ptp(ups[1:]) > 0:
        return _swarm(nodes, size, uplink, chunk, topo, rate, latency, window, efficiency, budget, t0)
    table = plan_table(topo, nodes, ups)

    g = 1
    if nodes * n_chunks > budget:
        # at least 2 simulated chunks per stripe even at 2g, so the fill term is visible;
        # a power of two, so that 64-chunk style models glue without a ragged last chunk
        g = 1 << max(0, math.ceil(math.log2(nodes * n_chunks / budget)))
        while g > 1 and n_chunks // g < 4 * topo.stripes:
            g //= 2
    if g == 1:
        times, seeder_tx = _run(table, topo.stripes, nodes, size, chunk, rate, latency, window)
    else:
        t1, tx1 = _run(table, topo.stripes, nodes, size, chunk * g, rate, latency, max(1, round(window / g)))
        t2, tx2 = _run(table, topo.stripes, nodes, size, chunk * 2 * g, rate, latency,
                       max(1, round(window / (2 * g))))
        times = np.maximum(t1 - (t2 - t1) * (g - 1) / g, size / rate.max())
        seeder_tx = tx1
    floor = size / uplink
    t_last = float(times.max())
    depth = max(max(_depths(col)) for col in table) if nodes else 0
    return Result(time_last=t_last, time_per_peer=times, seeder_tx_bytes=float(seeder_tx),
                  floor=floor, ratio=t_last / floor, topology=topo.name, nodes=nodes, size=size,
                  chunk=chunk, stripes=topo.stripes, depth=depth, coarsened=g,
                  cpu_s=_time.process_time() - t0)


def plan_table(topo, nodes: int, uplinks) -> list[list[int]]:
    """``table[s][r]``: peer r's source in stripe s, as the tracker settles the plan."""
    if isinstance(topo, _topo.Forest):
        median = float(np.median(uplinks[1:])) if nodes else 1.0
        slots = [1] + [0 if u < SLOW_FRACTION * median else topo.k for u in uplinks[1:]]
        return _topo.settled_forest(topo.k, nodes, slots)
    return _topo.parent_table(topo, nodes, settled=True)  # the tracker's adoptions happen as peers join


def _swarm(nodes, size, uplink, chunk, topo, rate, latency, window, efficiency, budget, t0) -> Result:
    """Heterogeneous uplinks under the swarm: the plan sets the pipeline fill, the slots the bulk.

    The fill is what the forest of this fleet costs over S / B with equal
    uplinks (the discrete-event model above).  The bulk is the longest of
    three: the seeder sending each chunk once (S / r_seeder); every uplink
    working at once (fluid: (N - 1) S over the peers' uplinks); and the
    busiest forwarder.  The tracker demotes hosts below ``SLOW_FRACTION`` of
    the median to leaves, which takes their slots away: with F forwarders of
    k slots each and the seeder's one per stripe, k (N - 1 - F) (peer, stripe)
    pairs have no planned source.  Each demoted host serves one of them at its
    own rate (``Forest.spare``: a quarter-rate uplink carries half a stripe),
    and the partners share the rest, so each forwarder carries its own copy
    and 1/F of what the spare slots leave.  (On the bed, with the spare slots
    taken out of the plan, two slow hosts took 1.495 x against 1.318: the
    fleet gains what this credits.)  On top, each slow host forwards until it
    is demoted (``_detection``); the uplink the fleet missed meanwhile is made
    up by the forwarders."""
    median = float(np.median(rate[1:]))
    even = simulate(nodes, size, median / efficiency, chunk, topo.name, latency, window, efficiency, budget)
    fill = even.time_per_peer - size / median
    slow = rate[1:] < SLOW_FRACTION * median
    fast = rate[1:][~slow]
    k, n_fast = topo.stripes, int(fast.size)
    unplaced = k * max(0, nodes - 1 - n_fast)
    spares = np.sort(rate[1:][slow])[::-1][:unplaced]  # each demoted host serves one unplaced pair
    busiest = _busiest(size, k, unplaced, spares, float(np.median(fast)), n_fast) if n_fast else 0.0
    bulk = max(size / rate[0], (nodes - 1) * size / float(rate[1:].sum()), busiest)
    bar = PROBE_SLOW * float(probe_reference(np.sort(rate[1:])))  # what a probe at join demotes
    detect = [_detection(k, chunk, r, bar) for r in rate[1:][slow]]
    missed = sum(d * (median - r) for d, r in zip(detect, rate[1:][slow]))
    delay = missed / float(fast.sum()) if n_fast else 0.0
    times = fill + bulk + delay
    t_last = float(times.max())
    return Result(time_last=t_last, time_per_peer=times, seeder_tx_bytes=float(size), floor=size / uplink,
                  ratio=t_last / (size / uplink), topology=topo.name, nodes=nodes, size=size, chunk=chunk,
                  stripes=topo.stripes, depth=even.depth, coarsened=even.coarsened,
                  cpu_s=_time.process_time() - t0,
                  extra={"fill": float(fill.max()), "bulk": float(bulk), "unplaced": unplaced, "detection": float(delay)})


def _busiest(size: int, k: int, unplaced: int, spares, r_fast: float, n_fast: int) -> float:
    """Seconds the busiest forwarder (uplink ``r_fast``) takes: its own copy, and its 1/``n_fast``
    share of the ``unplaced`` pairs' stripes (``size / k`` each) less what the demoted hosts'
    spare slots (``spares``: their rates) deliver meanwhile, at most a stripe each."""
    t = (size + unplaced * size / k / n_fast) / r_fast
    for _ in range(50):  # a fixed point: the spares deliver for as long as the forwarder works
        served = float(np.minimum(spares * t, size / k).sum())
        t, before = (size + max(0.0, unplaced * size / k - served) / n_fast) / r_fast, t
        if abs(t - before) < 1e-9 * before:
            break
    return t


def _detection(k: int, chunk: int, r: float, bar: float) -> float:
    """Seconds a slow host of uplink ``r`` (bytes/s) forwards before the tracker demotes it: its
    probe at join (``PROBE_BYTES``) where that takes ``PROBE_MIN_TIME`` or more and ``r`` is below
    the probe's ``bar``, else its first chunk to its k children at its own rate, then
    ``SLOW_EVIDENCE`` reviews."""
    if r < bar and PROBE_BYTES / r >= PROBE_MIN_TIME:
        return PROBE_BYTES / r
    return k * chunk / r + SLOW_EVIDENCE * YOUNG_REVIEW_INTERVAL  # a joiner is reviewed as often as it reports


def _with_failures(nodes, size, uplink, chunk, topo, rate, latency, window, budget, dead, t0) -> Result:
    """Each failure splits the broadcast: up to it on one plan, the rest on the re-placed plan."""
    alive = list(range(1, nodes + 1))
    times = np.zeros(nodes)
    t_start, sent, tx = 0.0, 0.0, 0.0
    for rank, fraction in [*dead, (None, 1.0)]:
        part = max(1, int(size * (fraction - sent)))
        res = simulate(len(alive), part, uplink, chunk, topo.name, latency, window, 1.0, budget,
                       uplinks=rate[alive] if alive else None)
        for i, r in enumerate(alive):
            times[r - 1] = t_start + res.time_per_peer[i]
        t_start += res.time_last if rank is None else res.time_last * 1.0
        tx += res.seeder_tx_bytes
        sent = fraction
        if rank is not None and rank in alive:
            alive.remove(rank)
            times[rank - 1] = np.nan
    survivors = times[~np.isnan(times)]
    t_last = float(survivors.max()) if survivors.size else 0.0
    return Result(time_last=t_last, time_per_peer=times, seeder_tx_bytes=tx, floor=size / uplink,
                  ratio=t_last / (size / uplink), topology=topo.name, nodes=nodes, size=size, chunk=chunk,
                  stripes=topo.stripes, cpu_s=_time.process_time() - t0, extra={"failures": dead})


def _depths(parent_col):
    d = [0] * len(parent_col)
    for r in range(1, len(parent_col)):
        d[r] = d[parent_col[r]] + 1
    return d


def _run(table, stripes, nodes, size, chunk, rate, latency, window):
    """One discrete-event run; returns (completion time per peer, seeder bytes sent)."""
    return _ChunkModel(table, stripes, nodes, size, chunk, rate, latency, window).run()


class _ChunkModel:
    """The discrete-event model of one broadcast: one connection per (child, stripe), as the node
    opens one link per planned source; per-host processor sharing of the uplink."""

    def __init__(self, table, stripes, nodes, size, chunk, rate, latency, window):
        self.n_chunks = n_chunks = math.ceil(size / chunk)
        self.chunk, self.last_size = chunk, size - (n_chunks - 1) * chunk
        self.nodes, self.latency, self.window = nodes, latency, window
        self.conn_parent, self.conn_child, self.conn_want = [], [], []
        for c in range(1, nodes + 1):
            for s in range(min(stripes, n_chunks)):
                self.conn_parent.append(table[s][c])
                self.conn_child.append(c)
                self.conn_want.append(range(s, n_chunks, stripes))
        n_conn = len(self.conn_parent)
        self.next_req = [0] * n_conn          # index into conn_want of the next chunk to ask for
        self.queue = [[] for _ in range(n_conn)]   # FIFO of chunks to send (list used with a head index)
        self.qhead = [0] * n_conn
        hosts = nodes + 1
        self.held = [bytearray(n_chunks) for _ in range(hosts)]
        self.held[0] = bytearray(b"\x01" * n_chunks)
        self.count = [0] * hosts
        self.done = np.zeros(nodes, dtype=float)
        self.parked = [dict() for _ in range(hosts)]   # host -> {chunk: [conn, ...]}
        # per-host processor sharing: virtual clock V (bytes each active conn got), heap of heads
        self.V = [0.0] * hosts
        self.vt = [0.0] * hosts        # time V was last advanced
        self.active = [0] * hosts
        self.ps = [[] for _ in range(hosts)]   # (finish_virtual, conn, chunk)
        self.ver = [0] * hosts
        self.sent0 = 0.0
        self.events = []               # (time, seq, kind, a, b)  kind 0: host completion, 1: request, 2: delivery
        self.seq = 0
        self.rates = np.broadcast_to(np.asarray(rate, dtype=float), (hosts,)).tolist()

    def csize(self, i: int) -> int:
        return self.last_size if i == self.n_chunks - 1 else self.chunk

    def push(self, t, kind, a, b=0):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def advance(self, h, t):
        if self.active[h]:
            self.V[h] += (t - self.vt[h]) * self.rates[h] / self.active[h]
        self.vt[h] = t

    def reschedule(self, h, t):
        self.ver[h] += 1
        if self.ps[h]:
            self.push(t + (self.ps[h][0][0] - self.V[h]) * self.active[h] / self.rates[h], 0, h, self.ver[h])

    def enqueue(self, ci, i, t):
        q = self.queue[ci]
        q.append(i)
        if len(q) - self.qhead[ci] == 1:       # connection was idle: it joins the sharing
            h = self.conn_parent[ci]
            self.advance(h, t)
            heapq.heappush(self.ps[h], (self.V[h] + self.csize(i), ci, i))
            self.active[h] += 1
            self.reschedule(h, t)

    def request(self, ci, t):
        """Child of ``ci`` asks for its next chunk; arrives at the parent after ``latency``."""
        k = self.next_req[ci]
        want = self.conn_want[ci]
        if k >= len(want):
            return
        self.next_req[ci] = k + 1
        if self.latency:
            self.push(t + self.latency, 1, ci, want[k])
        else:
            self.arrive_request(ci, want[k], t)

    def arrive_request(self, ci, i, t):
        p = self.conn_parent[ci]
        if self.held[p][i]:
            self.enqueue(ci, i, t)
        else:
            self.parked[p].setdefault(i, []).append(ci)

    def deliver(self, ci, i, t):
        c = self.conn_child[ci]
        self.held[c][i] = 1
        self.count[c] += 1
        if self.count[c] == self.n_chunks:
            self.done[c - 1] = t
        self.request(ci, t)
        for cj in self.parked[c].pop(i, ()):
            self.enqueue(cj, i, t)

    def sent(self, h, t):
        """Host ``h`` finished sending the chunk at the head of its sharing."""
        self.advance(h, t)
        fv, ci, i = heapq.heappop(self.ps[h])
        self.V[h] = fv
        if h == 0:
            self.sent0 += self.csize(i)
        self.qhead[ci] += 1
        q = self.queue[ci]
        if self.qhead[ci] < len(q):
            j = q[self.qhead[ci]]
            heapq.heappush(self.ps[h], (self.V[h] + self.csize(j), ci, j))
        else:
            self.active[h] -= 1
            self.queue[ci] = []
            self.qhead[ci] = 0
        self.reschedule(h, t)
        if self.latency:
            self.push(t + self.latency, 2, ci, i)
        else:
            self.deliver(ci, i, t)

    def run(self):
        for ci in range(len(self.conn_parent)):
            for _ in range(self.window):
                self.request(ci, 0.0)
        while self.events:
            t, _, kind, a, b = heapq.heappop(self.events)
            if kind == 0:
                if b == self.ver[a]:
                    self.sent(a, t)
            elif kind == 1:
                self.arrive_request(a, b, t)
            else:
                self.deliver(a, b, t)
        if self.count[1:] and min(self.count[1:]) < self.n_chunks:   # a rule that leaves someone unfed
            raise RuntimeError("simulation stalled: some peer never got every chunk")
        return self.done, self.sent0


# ----- command line ----------------------------------------------------------

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}
_QTY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z/]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from ``256MiB``, ``140GB``, ``4M`` (decimal M), ``1048576``."""
    num, unit = _split(text, "size")
    u = unit.lower()
    if u.endswith("b"):
        if unit[-1] == "b" and u not in ("b",):
            raise ValueError(f"size {text!r}: use B for bytes (b means bits)")
        u = u[:-1]
    if u not in _PREFIX:
        raise ValueError(f"size {text!r}: unknown unit {unit!r} (try 256MiB, 140GB)")
    return int(round(num * _PREFIX[u]))


def parse_rate(text: str) -> float:
    """Bytes/s from ``400Mbit``, ``400Mbps``, ``1Gbit/s``, ``50MB/s``, ``50MiB/s``."""
    num, unit = _split(text, "rate")
    u = unit
    for suffix in ("/s", "ps"):
        if u.lower().endswith(suffix) and len(u) > len(suffix):
            u = u[: -len(suffix)]
            break
    low = u.lower()
    if low.endswith("bit"):
        bits, p = True, low[:-3]
    elif u.endswith("b") and low != "":
        bits, p = True, low[:-1]
    elif u.endswith("B"):
        bits, p = False, low[:-1]
    elif low == "":
        bits, p = False, ""
    else:
        raise ValueError(f"rate {text!r}: unknown unit {unit!r} (try 400Mbit, 50MB/s)")
    if p not in _PREFIX:
        raise ValueError(f"rate {text!r}: unknown unit {unit!r} (try 400Mbit, 50MB/s)")
    return num * _PREFIX[p] / (8 if bits else 1)


def parse_duration(text: str) -> float:
    """Seconds from ``1ms``, ``200us``, ``0.5s``, ``0.001``."""
    num, unit = _split(text, "duration")
    scale = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}.get(unit.lower())
    if scale is None:
        raise ValueError(f"duration {text!r}: unknown unit {unit!r} (try 1ms)")
    return num * scale


def _split(text, what):
    m = _QTY.match(str(text))
    if not m:
        raise ValueError(f"{what} {text!r}: expected a number and a unit")
    return float(m.group(1)), m.group(2)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def slow_uplinks(nodes: int, uplink: float, fraction: float, share: float) -> np.ndarray:
    """Peer uplinks with ``fraction`` of the peers, spread evenly over the ranks, at ``share`` of ``uplink``."""
    ups = np.full(nodes, float(uplink))
    k = int(round(fraction * nodes))
    if k:
        ups[np.linspace(0, nodes - 1, k).round().astype(int)] = uplink * share
    return ups


def _uplinks(args, uplink: float):
    if args.uplinks:
        ups = [parse_rate(x) for x in args.uplinks.split(",") if x.strip()]
        if len(ups) != args.nodes:
            raise ValueError(f"--uplinks names {len(ups)} rates for {args.nodes} peers")
        return ups
    if args.slow:
        fraction, _, share = args.slow.partition(":")
        try:
            fraction, share = float(fraction), float(share or 0.25)
        except ValueError:
            raise ValueError(f"--slow {args.slow!r}: expected FRACTION:SHARE, e.g. 0.1:0.25") from None
        if not 0 <= fraction <= 1:
            raise ValueError(f"--slow {args.slow!r}: FRACTION (of the peers) must be in [0, 1]")
        return slow_uplinks(args.nodes, uplink, fraction, share)
    return None


def _kill(text: str) -> tuple[int, float]:
    rank, _, fraction = text.partition("@")
    try:
        return int(rank), float(fraction)
    except ValueError:
        raise ValueError(f"--kill {text!r}: expected RANK@FRACTION, e.g. 1@0.33") from None


def main(argv=None) -> int:
    """``p2pw simulate``: print the predicted broadcast time; 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="p2pw simulate", description="Predict broadcast time of a model to N peers.")
    ap.add_argument("--nodes", type=int, required=True, help="number of peers (the seeder is extra)")
    ap.add_argument("--size", required=True, help="model size, e.g. 256MiB, 140GB")
    ap.add_argument("--uplink", required=True, help="every host's uplink, e.g. 400Mbit, 50MB/s")
    ap.add_argument("--chunk", default="4MiB", help="chunk size (default 4MiB)")
    ap.add_argument("--topology", default="forest:2",
                    help="forest:K (the swarm's plan, default forest:2) | binomial | chain | star | kary:K | "
                         "striped:K | auto")
    ap.add_argument("--slow", default="", metavar="FRACTION:SHARE",
                    help="heterogeneous uplinks: FRACTION of the peers (spread evenly) at SHARE of --uplink, "
                         "e.g. 0.1:0.25")
    ap.add_argument("--uplinks", default="", metavar="LIST",
                    help="every peer's uplink, comma-separated (rank 1 first), e.g. 400Mbit,100Mbit,...")
    ap.add_argument("--kill", default="", metavar="RANK@FRACTION",
                    help="peers killed once FRACTION of the model went out, e.g. 1@0.33 (comma-separated)")
    ap.add_argument("--latency", default="0", help="one-way hop latency, e.g. 1ms (default 0)")
    ap.add_argument("--startup", default="0",
                    help="time from launch until the peers join (process or container start), e.g. 0.4s "
                         "(default 0)")
    ap.add_argument("--window", type=int, default=8, help="credit window in chunks (default 8)")
    ap.add_argument("--efficiency", type=float, default=0.956,
                    help="fraction of the uplink TCP gets (default 0.956, the testbed's htb)")
    args = ap.parse_args(argv)
    try:
        up = parse_rate(args.uplink)
        res = simulate(args.nodes, parse_size(args.size), up, parse_size(args.chunk),
                       args.topology, latency=parse_duration(args.latency), window=args.window,
                       efficiency=args.efficiency, uplinks=_uplinks(args, up),
                       failures=[_kill(k) for k in args.kill.split(",") if k.strip()],
                       startup=parse_duration(args.startup))
    except ValueError as e:
        print(f"p2pw simulate: error: {e}", file=sys.stderr)
        return 2
    print(res.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
