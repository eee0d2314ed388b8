"""``p2pw agent --http``: the agent's probes and metrics, per model.

- ``/healthz``: 200 while the agent's loop ticks and its socket answers (``Agent.probe``); 503 when wedged,
  never because its tracker is away or a model failed.
- ``/readyz``: 200 while the agent serves local clients (the same probe); the body names the pre-warm models
  not complete here yet (``prewarm_waiting``): adding a line never takes the agent out of service.
- ``/readyz/MODEL``: 200 once that model (an id or a prefix of 4+ hex digits) is complete here, 503 before.
- ``/models``: every model the agent holds, as ``p2pw agent``'s socket ``status`` gives them.
- ``/metrics``: ``p2pw_agent_models{state}``, and per model ``p2pw_model_ready``, ``p2pw_model_bytes``,
  ``p2pw_received_bytes_total``, ``p2pw_sent_bytes_total``, ``p2pw_origin_read_bytes_total``.
"""
from __future__ import annotations

import json

from ..ops.http import OpsServer
from ..ops.metrics import _version


class AgentReadiness:
    """What ``OpsServer``'s probes ask of a node, answered for the agent."""

    def __init__(self, agent):
        self.agent = agent

    def alive(self) -> bool:
        return self.agent.probe()[0]

    def stage(self) -> dict:
        ok, why = self.agent.probe()
        complete, waiting = self.agent.ready()
        return {"stage": "ready" if ok else "wedged", **({"why": why} if why else {}), "prewarm_complete": complete,
                **({"prewarm_waiting": waiting} if waiting else {})}

    def ready(self) -> bool:
        return self.agent.probe()[0]


class AgentCollector:
    """Metrics of the agent's models, read at scrape time."""

    def __init__(self, agent):
        self.agent = agent

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        info = GaugeMetricFamily("p2pw_build_info", "p2pweights version", labels=["version", "model_id"])
        info.add_metric([_version(), ""], 1)
        yield info
        yield GaugeMetricFamily("p2pw_ready", "1 once every pre-warm model is complete here",
                                value=int(self.agent.ready()[0]))
        models = self.agent.keeper.models()
        counts = GaugeMetricFamily("p2pw_agent_models", "models the agent holds, by state", labels=["state"])
        for state in ("starting", "fetching", "ready", "failed"):
            counts.add_metric([state], sum(m["state"] == state for m in models))
        yield counts
        families = {
            "ready": GaugeMetricFamily("p2pw_model_ready", "1 once the model's copy is complete", labels=["model_id"]),
            "bytes": GaugeMetricFamily("p2pw_model_bytes", "verified bytes of the model's copy", labels=["model_id"]),
            "received_bytes": CounterMetricFamily("p2pw_received_bytes", "chunk bytes received from partners",
                                                  labels=["model_id"]),
            "sent_bytes": CounterMetricFamily("p2pw_sent_bytes", "chunk bytes sent to partners", labels=["model_id"]),
            "origin_bytes_read": CounterMetricFamily("p2pw_origin_read_bytes", "bytes read from the origin",
                                                     labels=["model_id"]),
        }
        for m in models:
            families["ready"].add_metric([m["model_id"]], int(m["state"] == "ready"))
            for name in ("bytes", "received_bytes", "sent_bytes", "origin_bytes_read"):
                families[name].add_metric([m["model_id"]], m.get(name, 0))
        yield from families.values()


class AgentOps(OpsServer):
    """``OpsServer`` reading the agent: its readiness, per-model readiness, ``/models`` and metrics."""

    def __init__(self, addr: str, agent):
        super().__init__(addr)
        from prometheus_client import CollectorRegistry

        self.agent = agent
        self.readiness = AgentReadiness(agent)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(agent))

    def answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/models":
            return 200, "application/json", json.dumps({"models": self.agent.keeper.models()}).encode()
        if path.startswith("/readyz/"):
            wanted = path[len("/readyz/"):].lower()
            found = [m for m in self.agent.keeper.models() if len(wanted) >= 4 and m["model_id"].startswith(wanted)]
            if len(found) != 1:
                return 404, "application/json", json.dumps({"stage": "unknown", "model": wanted}).encode()
            m = found[0]
            body = {"stage": "ready"} if m["state"] == "ready" else {"stage": m["state"], **(
                {"pct": round(100.0 * m["bytes"] / m["total"], 1)} if m.get("total") else {})}
            return (200 if m["state"] == "ready" else 503), "application/json", json.dumps(body).encode()
        return super().answer(path)
