"""Context: the ZeroMQ context of a node, and how many libzmq I/O threads carry its bytes.

libzmq moves every byte of a connection on one of its context's I/O threads
(each connection is given to the least busy one when it opens).  One thread
carries about 3.5-6.5 GB/s of chunks on loopback (0.15-0.28 CPU-s per GB),
so a host with a fast NIC and many cores needs several; on a small host a
second thread only takes a core from the loop and the workers.
"""
from __future__ import annotations

import os

import zmq

MAX_IO_THREADS = 8  # the default's ceiling (``default_io_threads``): a 100 Gbit/s NIC at about 0.25 CPU-s per GB
CORES_PER_IO_THREAD = 4  # the default gives libzmq one I/O thread per this many cores


def _env_count(name: str) -> int | None:
    """The whole number in environment variable ``name``, at least 1; None where it is unset or not a count."""
    env = os.environ.get(name, "")
    return max(1, int(env)) if env.strip().isdigit() else None


def default_io_threads(cores: int | None = None) -> int:
    """libzmq I/O threads for a host with ``cores`` usable cores (this process's): ``P2PW_IO_THREADS`` if set (at
    least 1), else ``cores // CORES_PER_IO_THREAD`` between 1 and ``MAX_IO_THREADS`` (1 up to 7 cores, 4 on 16)."""
    if (env := _env_count("P2PW_IO_THREADS")) is not None:
        return env
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, min(MAX_IO_THREADS, cores // CORES_PER_IO_THREAD))


def node_context(io_threads: int | None = None) -> zmq.Context:
    """A fresh context with ``io_threads`` I/O threads (default ``default_io_threads()``)."""
    return zmq.Context(io_threads=default_io_threads() if io_threads is None else max(1, io_threads))


def default_lanes(io_threads: int) -> int:
    """Connections a peer pulls over from each partner (``swarm.node.lanes``): ``P2PW_LANES`` if set (at least 1), else
    one per I/O thread (``io_threads``), so one partner's bytes can ride each of them."""
    env = _env_count("P2PW_LANES")
    return env if env is not None else max(1, io_threads)
