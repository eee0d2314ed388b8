"""The models a node agent keeps: one join per model, fetched once, served for as long as the agent runs.

Each model is a ``Held``: its copy under the cache's ``models/MODEL_ID/``, and the
``Download`` that writes it and, once complete, keeps serving it to the swarm
(never closed while the agent runs, so a late arrival finds it there).  Local
clients attach to the copy through ``storage.localcopy``: the agent publishes
each verified chunk beside the files.  A model is asked for by URL (its manifest
published at the tracker) or by id (a copy the cache knows, or a swarm the
tracker has); the agent publishes each manifest under its URL again before
joining, so a restarted tracker, or one that never heard of a cached model,
knows the swarm.  The URL of each model is kept in ``CACHE/agent/urls.json``.

A complete copy's files are sealed, mode 0444: a client's hard link to one (``p2pw get
--agent --out``) shares the inode and its mode, so it cannot write into the copy unless
it is root.  Each tick the agent stats every file of each complete copy against its
marker (size and mtime: no byte read); a copy that changed under it is no longer served
and is mended (``repair``): joined again, every chunk on disk verified, each bad one
fetched again, before a peer or a local client is handed it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from ..errors import P2PError, UserError
from ..storage.cache import PARTIAL, copy_paths, marker_matches, write_atomically
from ..storage.localcopy import complete_copy
from ..storage.modelcache import ModelCache, ModelCacheError
from ..wire.local import MODEL_ID, AgentError
from . import rules

log = logging.getLogger("p2pw")

START_WAIT = 600.0  # seconds a client's get waits for the agent to start writing the copy
LEAVE_WAIT = 5.0  # seconds the agent waits on close for peers that depend on it
SEALED, WRITABLE = 0o444, 0o644  # a complete copy's files, and a copy's files while written


class Held:
    """One model the agent keeps: ``state`` is starting, fetching, ready or failed (``error``)."""

    def __init__(self, model_id: str, url: str | None, path: str):
        self.model_id, self.url, self.path = model_id, url, path
        self.dl = self.origin = self.error = None
        self.state = "starting"
        self.repairs = 0  # times its copy changed under the agent and was mended
        self.started = threading.Event()  # set once the copy is written or held (dl), or the start failed

    def info(self) -> dict:
        doc = {"model_id": self.model_id, "url": self.url, "path": self.path, "state": self.state,
               "repairs": self.repairs}
        if self.error:
            doc["error"] = self.error
        dl = self.dl
        if dl is not None:
            st = dl.node.stats
            doc.update(bytes=dl.store.bytes, total=dl.manifest.total_size, chunks=dl.store.count,
                       n_chunks=dl.manifest.n_chunks, received_bytes=st.bytes_received, sent_bytes=st.bytes_sent,
                       received_chunks=st.chunks_received, resumed=st.resumed,
                       origin_bytes_read=self.origin.bytes_read if self.origin is not None else 0)
        return doc


class Keeper:
    """The agent's models (``held``, by id), the swarm they are served to (``tracker``), and the cache."""

    def __init__(self, tracker: str, cache: ModelCache, key=None, host: str = "0.0.0.0", advertise: str | None = None,
                 no_origin: bool = False, connect_timeout: float = 30.0, local_roots=()):
        self.tracker, self.cache, self.key = tracker, cache, key
        self.host, self.advertise, self.no_origin, self.connect_timeout = host, advertise, no_origin, connect_timeout
        self.local_roots = list(local_roots)  # the only folders a local-path origin may be read from
        self.lock = threading.Lock()
        self.held: dict[str, Held] = {}
        self.kept: set[str] = set()  # ids the pre-warm list names: never evicted
        self.urls_path = os.path.join(cache.root, "agent", "urls.json")
        self.urls: dict[str, str] = self._load_urls()
        self.closed = False

    def _load_urls(self) -> dict[str, str]:
        try:
            with open(self.urls_path) as f:
                doc = json.load(f)
            return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}
        except (OSError, ValueError, AttributeError):
            return {}

    def _remember_url(self, model_id: str, url: str) -> None:
        with self.lock:
            if self.urls.get(model_id) == url:
                return
            self.urls[model_id] = url
            doc = dict(self.urls)
        os.makedirs(os.path.dirname(self.urls_path), exist_ok=True)
        write_atomically(self.urls_path, doc, durable=False)

    # ----- asking for a model -------------------------------------------------------------------

    def resolve(self, model: str):
        """``(model_id, url or None, found)`` of a model named by URL or id; ``found``: None, or the manifest
        this agent can trust for the URL and its reader of the origin (``origin.trusted``)."""
        from ..origin import trusted

        text = model.strip()
        if MODEL_ID.fullmatch(text.lower()):
            text = text.lower()
            with self.lock:
                mine = [m for m in self.held if m.startswith(text)]
            known = mine or [m for m in self.cache.model_ids() if m.startswith(text)]
            if len(set(known)) == 1:
                return known[0], self.urls.get(known[0]), None  # the cache's manifest, verified when it was kept
            if len(text) == 64:  # a swarm the tracker may know by id alone
                return text, self.urls.get(text), None
            raise AgentError(f"{'more than one' if known else 'no'} model here matches {text!r}: give the whole id "
                             "or the URL")
        with self.lock:
            known = [m for m, u in self.urls.items() if u == text and m in self.held]
        if known and self.held[known[0]].state != "failed":
            return known[0], text, None
        m, source = trusted(self.tracker, text, self.key, wait=self.connect_timeout, read_origin=not self.no_origin,
                            opener=lambda m, strict: self._origin_source(text, m, strict))
        return m.model_id, text, (m, source)

    def get(self, model: str, wait: float = START_WAIT) -> Held:
        """The model, its copy being written or held (started here once, however many ask at once)."""
        model_id, url, found = self.resolve(model)
        with self.lock:
            if self.closed:
                raise AgentError("the agent is stopping")
            h = self.held.get(model_id)
            fresh = h is None or h.state == "failed"
            if fresh:
                h = self.held[model_id] = Held(model_id, url or self.urls.get(model_id),
                                               self.cache.copy_dir(model_id))
        if fresh and complete_copy(h.path, model_id) is not None:  # its swarm joined beside, a tracker away or not
            threading.Thread(target=self.start, args=(h, found), name="p2pw-agent-start", daemon=True).start()
        elif fresh:
            self.start(h, found)
        if not h.started.is_set() and complete_copy(h.path, model_id) is not None:
            return h  # complete on disk: local clients read it while the agent still joins its swarm
        if not h.started.wait(wait):
            raise AgentError(f"model {model_id[:16]} not started after {wait:g} s")
        if h.state == "failed":
            raise AgentError(f"model {model_id[:16]}: {h.error}")
        return h

    def start(self, h: Held, found=None) -> None:
        """Join the model's swarm with its copy (fetching what is missing); a thread waits for it to complete."""
        try:
            h.dl, h.origin = self._join(h, found)
            h.state = "ready" if h.dl.store.complete and h.dl.cache.complete else "fetching"
            if h.state == "ready":
                seal(h.dl.manifest, h.path, SEALED)
            threading.Thread(target=self._finish, args=(h,), name="p2pw-agent-model", daemon=True).start()
        except (UserError, OSError) as e:
            h.state, h.error = "failed", str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("model %s: %s", h.model_id[:16], h.error)
        finally:
            h.started.set()

    def _join(self, h: Held, found):
        from .. import api
        from ..origin import Origin, lookup, publish

        url = h.url or f"p2pw:{h.model_id}"  # a model known by id only: its swarm, under a name of the agent's
        manifest, source = found or (self.cache.manifest(h.model_id), None)
        if manifest is None and h.url:
            manifest = lookup(self.tracker, url, self.key, timeout=self.connect_timeout, model_id=h.model_id)
        origin = None
        if manifest is not None:
            wait = self.connect_timeout  # a tracker restarting: each ask waits for it this long
            if lookup(self.tracker, url, self.key, timeout=wait, model_id=manifest.model_id) is None:  # its own
                publish(self.tracker, url, manifest, self.key, timeout=wait)
            self._remember_url(h.model_id, url)
            self.make_room(manifest)
            seal(manifest, h.path, WRITABLE)  # a resume writes into the files it mends
            if found is None and not self.no_origin and h.url is not None:  # pinned by its id: read unchecked
                source = self._origin_source(url, manifest)
            origin = Origin(url, manifest, source)
        dl = api.join(self.tracker, out=h.path, model_id=h.model_id, cache=self.cache, key=self.key,
                      host=self.host, advertise=self.advertise, origin=origin, connect_timeout=self.connect_timeout)
        if getattr(dl, "attached", False):
            dl.close()
            raise P2PError(f"another process on this host writes {h.path}: the agent serves it once that one ends")
        if manifest is None:  # known by id only: its size is known now
            try:
                self.make_room(dl.manifest)
            except UserError:
                dl.close()
                raise
        return dl, origin

    def _origin_source(self, url: str, manifest, strict: bool = False):
        """A reader of ``url``'s origin where ``rules.origin_of`` lets this agent read it, else None (said why)."""
        from ..origin import open_source
        from ..storage import hfcache

        kind, what = rules.origin_of(url, self.local_roots)
        if kind == "hub":
            try:
                what, _ = hfcache.resolve(url)
            except hfcache.HFCacheError as e:
                kind, what = None, str(e).splitlines()[0]
        if kind is None:
            log.warning("not reading the origin %s here (%s): taking every chunk from peers", url, what[:300])
            return None
        return open_source(what, manifest, strict=strict)

    def _finish(self, h: Held) -> None:
        try:
            h.dl.wait()
            h.dl.cache.finished.wait()
            seal(h.dl.manifest, h.path, SEALED)
            h.state = "ready"
            log.info("model %s ready in %s (%d bytes received, %d chunks resumed)", h.model_id[:16], h.path,
                     h.dl.node.stats.bytes_received, h.dl.node.stats.resumed)
        except Exception as e:  # noqa: BLE001 (a failed model is retried; the agent goes on)
            self.fail(h, str(e) or type(e).__name__)

    def fail(self, h: Held, error: str) -> None:
        if h.state == "failed":
            return
        h.state, h.error = "failed", error.splitlines()[0]
        log.warning("model %s failed: %s", h.model_id[:16], h.error)
        dl, h.dl = h.dl, None
        if dl is not None:
            dl.close()

    def check(self) -> None:
        """A model whose node stopped (its loop ended with an error) is failed, to be started again; a complete
        copy whose files changed under the agent (their size or mtime is not its marker's) is mended."""
        for h in list(self.held.values()):
            dl = h.dl
            if dl is not None and h.state in ("fetching", "ready") and dl.node.fatal:
                self.fail(h, dl.node.fatal)
            elif dl is not None and h.state == "ready" and not marker_matches(dl.manifest, h.path):
                self.repair(h)

    def repair(self, h: Held) -> None:
        """Stop serving a copy that changed under the agent and join again with it: every chunk on disk is
        verified, each bad one fetched again."""
        with self.lock:
            if self.closed or h.dl is None:
                return
            dl, h.dl, h.state = h.dl, None, "fetching"
            h.repairs += 1
        log.warning("model %s: its copy in %s changed under the agent (a file's size or mtime): no longer serving "
                    "it, verifying every chunk again and fetching the bad ones", h.model_id[:16], h.path)
        dl.close()
        threading.Thread(target=self.start, args=(h, None), name="p2pw-agent-repair", daemon=True).start()

    # ----- what the cache holds -----------------------------------------------------------------

    def resume(self) -> list[str]:
        """Serve every complete copy the cache owns and resume every partial one no other process holds."""
        started = []
        for e in self.cache.entries():
            if not e.owned or not os.path.isdir(e.path) or (e.in_use and not e.complete):
                continue
            with self.lock:
                if e.model_id in self.held:
                    continue
                h = self.held[e.model_id] = Held(e.model_id, self.urls.get(e.model_id), e.path)
            threading.Thread(target=self.start, args=(h, None), name="p2pw-agent-resume", daemon=True).start()
            started.append(e.model_id)
        return started

    def make_room(self, manifest) -> None:
        """Evict what the cache's policy chooses so ``manifest``'s model fits (never a kept or fetching one)."""
        if self.cache.size is None:
            return
        with self.lock:
            closable = {m for m, h in self.held.items() if h.state in ("ready", "failed")}
            kept = self.kept | {m for m, h in self.held.items() if h.state in ("starting", "fetching")}
        entries = [e for e in self.cache.entries() if e.model_id != manifest.model_id]
        incoming = sum(f["size"] for f in manifest.files)
        chosen = rules.victims(entries, kept | {manifest.model_id}, closable, incoming, self.cache.size,
                               self.cache.eviction)
        if chosen is None:
            raise ModelCacheError(f"cannot make room for model {manifest.model_id[:16]} ({incoming} bytes) under the "
                                  f"cache size {self.cache.size} bytes: the rest is pre-warmed, fetching or in use")
        for e in chosen:
            self.evict(e.model_id)

    def evict(self, model_id: str) -> bool:
        """Stop serving ``model_id`` and delete its copy (it stays where another local process still reads it)."""
        with self.lock:
            h = self.held.pop(model_id, None)
        if h is not None and h.dl is not None:
            h.dl.close()
        try:
            self.cache.remove(model_id)
        except ModelCacheError as e:
            log.warning("model %s not evicted: %s", model_id[:16], e)
            return False
        log.warning("evicted model %s from the cache to make room", model_id[:16])
        return True

    def models(self) -> list[dict]:
        with self.lock:
            held = list(self.held.values())
        return [dict(h.info(), kept=h.model_id in self.kept) for h in held]

    def close(self) -> None:
        """Leave every swarm (waiting briefly for peers that depend on this node)."""
        with self.lock:
            self.closed = True
            held = list(self.held.values())
        deadline = time.monotonic() + LEAVE_WAIT
        for h in held:
            dl, h.dl = h.dl, None
            if dl is not None:
                dl.close(linger=True, timeout=max(deadline - time.monotonic(), 0.1))


def seal(manifest, copy: str, mode: int) -> None:
    """Set the mode of every file of ``manifest``'s copy under ``copy`` (final or partial) that exists."""
    for path in copy_paths(manifest, copy):
        for p in (path, path + PARTIAL):
            try:
                os.chmod(p, mode, follow_symlinks=False)
            except (FileNotFoundError, NotImplementedError):
                pass
