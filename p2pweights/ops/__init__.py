"""Ops: what operators and machines see of a running node; it never changes node state.  One module each:
``http`` (the server and its caps), ``metrics`` (readiness and Prometheus), ``progress``, ``logs``.

- ``OpsServer``: ``/healthz``, ``/readyz`` and ``/metrics`` over HTTP (stdlib
  ``http.server`` in a daemon thread), listening from process start, before
  the node exists; ``bind`` hands it the seeder or download once there is one.
  ``--http :PORT`` listens on loopback only (name ``0.0.0.0`` or ``[::]`` for
  every interface); ``ConnectionLimit`` caps the connections served at once,
  and those from one address, and closes each one its deadline after it was
  accepted; a connection over a cap goes to the ``ProbeLane``, where a probe
  (``/healthz``, ``/readyz``) is still answered and anything else gets 503,
  so clients holding every slot never fail a liveness probe.
- ``Readiness``: the stage of a node (connecting, loading, ready) read from
  its store, disk writer and device sink.
- ``NodeCollector``: Prometheus metrics read from the node's own counters at
  scrape time (no second bookkeeping in the hot path).
- ``Progress``: a bar on a terminal, else a progress line every 10 s;
  ``FleetProgress``: the seeder's line about its fleet every 10 s.
- ``JsonFormatter``: one JSON object per log line (``--log-format json``).
"""
from __future__ import annotations

from .http import (BUSY, DEFAULT_HTTP_PORT, LOOPBACK, MAX_CONNECTIONS, MAX_PER_ADDRESS, PROBE_LANE,  # noqa: F401
                   REQUEST_TIMEOUT, ConnectionLimit, OpsServer, ProbeLane, is_probe, parse_http_addr)
from .logs import LogContext, configure_logging  # noqa: F401
from .metrics import NodeCollector, OpsError, Readiness, _version, metrics_registry  # noqa: F401
from .progress import FleetProgress, Progress, human  # noqa: F401
