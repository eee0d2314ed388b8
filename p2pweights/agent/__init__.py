"""The node agent (``p2pw agent``): one long-lived process per node that keeps the node's models.

- ``keeper``: the models it holds (a join per model, kept open: it serves every copy to the
  swarm for as long as it runs), fetched once however many local processes ask, resumed
  after a restart, evicted by the model cache's policy.
- ``server``: the local API, JSON lines on ``CACHE/agent.sock`` (``wire.local``).
- ``rules``: its decisions, pure: the pre-warm list, what may be evicted, readiness.
- ``httpops``: ``--http`` with per-model readiness and metrics.
- ``command``: ``p2pw agent`` and ``p2pw get --agent``.
"""
