"""What the probes and ``/metrics`` read: ``Readiness``, the stage of a node (connecting, loading, ready) from its
store, disk writer and device sink; ``NodeCollector``, Prometheus metrics read from the node's own counters at
scrape time (no second bookkeeping in the hot path)."""
from __future__ import annotations

from ..errors import UserError


class OpsError(UserError, ValueError):
    """A bad --http address, a port already taken, or prometheus_client missing."""


def _version() -> str:
    from .. import __version__

    return __version__


class Readiness:
    """The stage of this process's node: what ``/readyz`` and ``p2pw_ready`` say."""

    def __init__(self):
        self.handle = None  # a Seeder or a Download, once it exists
        self.starting = "connecting"  # the stage before there is a handle ("loading" on a seeder: hashing)

    def bind(self, handle) -> None:
        self.handle = handle

    def alive(self) -> bool:
        """The node's loop runs (or, before it exists, the process is still starting it)."""
        h = self.handle
        if h is None:
            return True
        thread = h.node.thread
        return thread is not None and thread.is_alive()

    def stage(self) -> dict:
        """{"stage": "connecting" | "loading", "pct": ...} until the copy is complete, then {"stage": "ready"}."""
        h = self.handle
        if h is None:
            return {"stage": self.starting, "pct": 0.0}
        if getattr(h, "store", None) is None:  # a standalone tracker: ready while its loop serves
            return {"stage": "failed", "pct": 0.0, "error": h.node.fatal} if h.node.fatal else {"stage": "ready"}
        store = h.store
        pct = round(100.0 * store.bytes / h.manifest.total_size, 1) if h.manifest.total_size else 100.0
        if h.node.fatal:
            return {"stage": "failed", "pct": pct, "error": h.node.fatal}
        if getattr(h, "source", None) is not None:  # a seeder reading chunks from storage as peers ask
            return {"stage": "ready"}
        if not store.complete:
            return {"stage": "loading", "pct": pct}
        cache = getattr(h, "cache", None)
        if cache is not None and not cache.finished.is_set():
            return {"stage": "loading", "pct": pct, "waiting_for": "disk"}
        loader = getattr(h, "loader", None)
        if loader is not None:
            landed = loader.sink.landed_at
            on_device = int(len(landed) - _count_nan(landed))
            if on_device < len(landed):
                return {"stage": "loading", "pct": round(100.0 * on_device / len(landed), 1),
                        "waiting_for": "device"}
        return {"stage": "ready"}

    def ready(self) -> bool:
        return self.stage()["stage"] == "ready"


def _count_nan(a) -> int:
    import numpy as np

    return int(np.isnan(a).sum())


class NodeCollector:
    """Prometheus metrics of one node, read from its counters when scraped."""

    def __init__(self, readiness: Readiness):
        self.readiness = readiness

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h = self.readiness.handle
        model_id = h.model_id if h is not None else ""
        info = GaugeMetricFamily("p2pw_build_info", "p2pweights version and the model this node carries",
                                 labels=["version", "model_id"])
        info.add_metric([_version(), model_id], 1)
        yield info
        yield GaugeMetricFamily("p2pw_ready", "1 once the copy is complete and verified (on disk, on the device "
                                              "where asked), else 0", value=int(self.readiness.ready()))
        if h is None:
            return
        if getattr(h, "store", None) is None:  # a standalone tracker: its swarms' members
            yield GaugeMetricFamily("p2pw_peers", "peers in the fleet that have not left",
                                    value=sum(w.live for w in list(h.registry.swarms.values())))
            yield GaugeMetricFamily("p2pw_swarms", "models a standalone tracker serves", value=len(h.registry.swarms))
            yield CounterMetricFamily("p2pw_tracker_joins", "HELLOs a standalone tracker welcomed (joins and "
                                                            "re-introductions)", value=h.registry.joins)
            yield CounterMetricFamily("p2pw_tracker_strays", "member reports dropped: their connection is no member "
                                                             "here (sent before a restart)", value=h.node.strays)
            return
        st = h.node.stats
        yield CounterMetricFamily("p2pw_received_bytes", "chunk bytes received from partners",
                                  value=st.bytes_received)
        yield CounterMetricFamily("p2pw_sent_bytes", "chunk bytes sent to partners", value=st.bytes_sent)
        yield CounterMetricFamily("p2pw_chunks_verified", "chunks verified and held (hashed on arrival, on "
                                                          "resume, or by the seeder's scan)", value=h.store.count)
        rejected = CounterMetricFamily("p2pw_chunks_rejected", "chunks received and dropped", labels=["reason"])
        rejected.add_metric(["hash"], st.bad_chunks)
        rejected.add_metric(["duplicate"], st.duplicates)
        yield rejected
        yield CounterMetricFamily("p2pw_source_switches", "chunks taken from a partner other than the planned "
                                                          "source", value=st.switches)
        fleet = h.node.fleet
        if fleet is not None:  # the seeder: storage and the tracker
            yield CounterMetricFamily("p2pw_storage_read_bytes", "bytes read from storage", value=h.bytes_read)
            yield GaugeMetricFamily("p2pw_peers", "peers in the fleet that have not left", value=fleet.live)
        else:
            yield GaugeMetricFamily("p2pw_download_seconds", "seconds from join to the last verified chunk "
                                                             "(so far, while downloading)", value=h.seconds)


def metrics_registry(readiness: Readiness):
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise OpsError("--http needs prometheus_client: pip install 'p2pweights[ops]' "
                       "(or pip install prometheus_client)") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(readiness))
    return registry
