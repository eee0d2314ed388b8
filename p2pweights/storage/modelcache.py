"""Model cache: the models this host keeps, by model id; what to evict; which joins not to retry yet.

Under ``$P2PW_CACHE_DIR`` (default ``~/.cache/p2pweights``)::

    models/<model_id>/            a copy the cache owns (a join without --out writes it; eviction may remove it)
    index/<model_id>.json         where copies of the model are (owned, or an --out / --hf-cache DIR it was told
                                  of), its size, how long its fetch took, when it was used
    index/<model_id>.manifest.json  its manifest, so a complete copy is recognised without asking anyone
    failures/<key>.json           a join that failed for a cause that repeats, and until when not to retry it
                                  (tied to a destination, the tracker that answered, the sources that failed)
    manifests/                    the seeder's manifest catalog (catalog.py)

A copy is complete when its ``.p2pw/complete.json`` marker matches (``cache.marker_matches``).
A running join or seed holds a shared ``fcntl.flock`` on ``<copy>/.p2pw/lock``; eviction takes it
exclusively without waiting, so a model in use is never removed.  The policies are pure objects with
an injected clock: ``EvictionPolicy`` (which complete models to remove, by a cost-aware score, not
LRU) and ``FailurePolicy`` (doubling, capped backoff).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import time

from .cache import copy_paths, marker_matches, remove_tree, write_atomically, write_text_atomically
from .paths import PathError, StateDir
from .sizes import parse_size
from ..errors import UserError
from ..sources.manifest import Manifest, ManifestError, sha256

log = logging.getLogger("p2pw")

MAX_USES = 64  # use times kept per model (older ones weigh next to nothing anyway)
CAUSES = {"disk": "not enough disk", "checksums": "every source failed its checksums",
          "refused": "the model id was refused"}
LOCK = "lock"


class ModelCacheError(UserError, OSError):
    """The cache cannot do what was asked (no room under its size, unknown model, model in use)."""


class CacheTooSmall(ModelCacheError):
    """The model is larger than the whole cache size: a cause that repeats ("not enough disk")."""


def default_root() -> str:
    return os.environ.get("P2PW_CACHE_DIR") or os.path.expanduser("~/.cache/p2pweights")


# ----- pure policies ------------------------------------------------------------------------------


class Entry:
    """One copy of a model, as the eviction policy sees it: ``uses``, the wall-clock times it was
    fetched, joined or seeded; ``fetch_seconds``, how long fetching it took, when measured; ``owned``:
    under models/ (only those count towards the size and may be evicted); ``layout``: "files", or
    "hf" (a hub cache repo folder, --hf-cache)."""

    def __init__(self, model_id: str, bytes: int, uses: list[float] | None = None, fetch_seconds: float | None = None,
                 complete: bool = True, in_use: bool = False, owned: bool = True, path: str = "", name: str = "",
                 layout: str = "files"):
        self.model_id, self.bytes = model_id, bytes
        self.uses = [] if uses is None else uses
        self.fetch_seconds, self.complete, self.in_use, self.owned = fetch_seconds, complete, in_use, owned
        self.path, self.name, self.layout = path, name, layout


class EvictionPolicy:
    """Which complete, unused models to evict to make room: the lowest expected refetch cost per byte first.

    ``score = reuse x refetch_cost / bytes``: ``reuse`` is the model's uses, each weighing
    ``0.5 ** (age / half_life)`` (a model used often and lately is likely used again); ``refetch_cost`` is
    what getting it back would cost, in seconds: the fetch's measured time, at least ``bytes / rate``.
    Dividing by size makes it the value given up per byte freed (GreedyDual-Size-Frequency), so a
    small model fetched slowly from far away outlives a large local one used as often, and a model used
    ten times yesterday outlives one used once an hour ago: unlike LRU.
    """

    def __init__(self, clock=time.time, half_life: float = 24 * 3600.0, rate: float = 100e6):
        self.clock, self.half_life, self.rate = clock, half_life, rate

    def reuse(self, e: Entry) -> float:
        now = self.clock()
        return sum(0.5 ** (max(now - t, 0.0) / self.half_life) for t in e.uses)

    def refetch_cost(self, e: Entry) -> float:
        return max(e.fetch_seconds or 0.0, e.bytes / self.rate)

    def score(self, e: Entry) -> float:
        return self.reuse(e) * self.refetch_cost(e) / max(e.bytes, 1)

    def victims(self, entries: list[Entry], incoming: int, budget: int) -> list[Entry] | None:
        """The entries to evict so that ``incoming`` more bytes fit in ``budget``; None if that cannot be done.

        Every owned copy counts towards the budget; only complete ones not in use may go.
        """
        used = sum(e.bytes for e in entries if e.owned)
        need = used + incoming - budget
        if need <= 0:
            return []
        chosen, freed = [], 0
        for e in sorted((e for e in entries if e.owned and e.complete and not e.in_use),
                        key=lambda e: (self.score(e), e.model_id)):
            if freed >= need:
                break
            chosen.append(e)
            freed += e.bytes
        return chosen if freed >= need else None


class FailurePolicy:
    """How long a model whose join failed for a repeating cause is not tried again: ``base`` doubling, ``cap``."""

    def __init__(self, clock=time.time, base: float = 60.0, cap: float = 3600.0):
        self.clock, self.base, self.cap = clock, base, cap

    def backoff(self, count: int) -> float:
        return min(self.base * 2 ** max(count - 1, 0), self.cap)

    def failed(self, previous: dict | None, cause: str, reason: str) -> dict:
        """The record after one more failure (``previous`` is the last record, or None)."""
        count = (previous or {}).get("count", 0) + 1
        now = self.clock()
        return {"cause": cause, "reason": reason, "count": count, "at": now, "until": now + self.backoff(count)}

    def until(self, record: dict) -> float:
        """When a retry is allowed: the failure's time plus this policy's backoff for its count."""
        return record.get("at", 0) + self.backoff(record.get("count", 1))

    def blocks(self, record: dict | None) -> bool:
        return bool(record) and self.clock() < self.until(record)


# ----- the cache on disk -------------------------------------------------------------------------


class CopyLock:
    """A flock on ``<copy>/.p2pw/lock``, held while a join or seed uses the copy.

    Readers (a seed, a join of a complete copy) hold it shared.  A join that may write holds it exclusively
    until the copy is complete (``share()``), so two joins of one model on a host never write the same files
    at once: the second waits, then finds the copy complete.  Eviction only takes it exclusively without
    waiting, so any holder keeps the copy.
    """

    def __init__(self, copy: str, write: bool = False, complete=lambda: False):
        while True:
            os.makedirs(copy, exist_ok=True)
            with StateDir(copy) as d:  # no link followed: a planted .p2pw is one PathError
                fd = d.open(LOCK, os.O_RDWR | os.O_CREAT)
            if not write:
                fcntl.flock(fd, fcntl.LOCK_SH)
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if complete():  # held by readers of a complete copy: read it too
                        fcntl.flock(fd, fcntl.LOCK_SH)
                    else:
                        log.warning("another join is writing %s: waiting for it", copy)
                        fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                with StateDir(copy, create=False) as d:
                    if d.inode(LOCK) == os.fstat(fd).st_ino:  # not evicted while we waited
                        break
            except FileNotFoundError:
                pass
            os.close(fd)
        self.fd: int | None = fd

    def share(self) -> None:
        """The copy is complete: let other readers in."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def try_exclusive(copy: str) -> int | None:
    """An fd holding ``<copy>/.p2pw/lock`` exclusively, or None while a join or seed holds it."""
    try:
        with StateDir(copy) as d:
            fd = d.open(LOCK, os.O_RDWR | os.O_CREAT)
    except PathError:  # a planted link in .p2pw/: held, so never evicted (nor deleted) through it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise


def well_formed(doc) -> bool:
    """Whether an index record has the shape ``ModelCache`` reads; a torn or hand-edited one is ignored like a
    missing one (the next join of its model writes it anew)."""
    try:
        return (isinstance(doc, dict) and isinstance(doc.get("bytes", 0), int)
                and all(isinstance(c, dict) and isinstance(c["path"], str) for c in doc.get("copies", []))
                and all(isinstance(t, (int, float)) for t in doc.get("uses", []))
                and isinstance(doc.get("fetch_seconds") or 0, (int, float)))
    except (KeyError, TypeError):
        return False


def failure_policy(clock=time.time) -> FailurePolicy:
    """The failure policy, with ``P2PW_FAILURE_BACKOFF`` (seconds of the first backoff, default 60) if set."""
    base = os.environ.get("P2PW_FAILURE_BACKOFF")
    if not base:
        return FailurePolicy(clock)
    try:
        return FailurePolicy(clock, base=float(base))
    except ValueError:
        raise ModelCacheError(f"P2PW_FAILURE_BACKOFF={base!r}: give seconds, e.g. 60") from None


class ModelCache:
    """The models kept on this host (see the module docstring for the layout)."""

    def __init__(self, root: str | None = None, size: int | None = None, clock=time.time,
                 eviction: EvictionPolicy | None = None, failures: FailurePolicy | None = None):
        self.root = os.path.abspath(root or default_root())
        env = os.environ.get("P2PW_CACHE_SIZE")
        self.size = size if size is not None else (parse_size(env) if env else None)  # None: no limit
        self.clock = clock
        self.eviction = eviction or EvictionPolicy(clock)
        self.failures = failures if failures is not None else failure_policy(clock)
        self.models = os.path.join(self.root, "models")
        self.index = os.path.join(self.root, "index")
        self.failed = FailureMemory(os.path.join(self.root, "failures"), self.failures)

    # ----- the index ---------------------------------------------------------------------------

    def _index_lock(self):
        os.makedirs(self.index, exist_ok=True)
        fd = os.open(os.path.join(self.index, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _record_path(self, model_id: str) -> str:
        return os.path.join(self.index, f"{model_id}.json")

    def record(self, model_id: str) -> dict | None:
        try:
            with open(self._record_path(model_id)) as f:
                doc = json.load(f)
            return doc if well_formed(doc) else None
        except (OSError, ValueError):
            return None

    def _update(self, model_id: str, change) -> dict | None:
        fd = self._index_lock()
        try:
            doc = self.record(model_id)
            doc = change(doc)
            if doc is None:
                for p in (self._record_path(model_id), self._manifest_path(model_id)):
                    if os.path.exists(p):
                        os.remove(p)
            else:
                write_atomically(self._record_path(model_id), doc, durable=False)
            return doc
        finally:
            os.close(fd)

    def _manifest_path(self, model_id: str) -> str:
        return os.path.join(self.index, f"{model_id}.manifest.json")

    def manifest(self, model_id: str) -> Manifest | None:
        try:
            with open(self._manifest_path(model_id)) as f:
                return Manifest.from_json(f.read(), expect_id=model_id)
        except (OSError, ManifestError):
            return None

    def model_ids(self) -> list[str]:
        try:
            return sorted(n[:-5] for n in os.listdir(self.index) if n.endswith(".json") and ".manifest" not in n)
        except FileNotFoundError:
            return []

    def resolve(self, text: str) -> str:
        """The model id that ``text`` (an id, a prefix, or a repo id the model came from) names in the cache."""
        ids = self.model_ids()
        hits = [m for m in ids if m.startswith(text.lower())] if len(text) >= 4 else []
        hits = hits or [m for m in ids if (self.record(m) or {}).get("name") == text]
        if len(hits) != 1:
            raise ModelCacheError(f"{'no' if not hits else 'more than one'} model in the cache {self.root} "
                                  f"matches {text!r}" + ("" if hits else " (see p2pw cache ls)"))
        return hits[0]

    # ----- copies ------------------------------------------------------------------------------

    def copy_dir(self, model_id: str) -> str:
        return os.path.join(self.models, model_id)

    def names(self, manifest, layout: str):
        if layout == "hf":
            from .hfcache import blob_names
            return blob_names(manifest)
        return None

    def remember(self, manifest, path: str, layout: str = "files") -> None:
        """File ``manifest`` and its copy at ``path`` (owned if under models/) before a join writes it."""
        os.makedirs(self.index, exist_ok=True)
        mp = self._manifest_path(manifest.model_id)
        if not os.path.exists(mp):
            write_text_atomically(mp, manifest.to_json())
        path = os.path.abspath(path)
        owned = self.owns(path)

        def change(doc):
            doc = doc or {"model_id": manifest.model_id, "uses": [], "fetch_seconds": None,
                          "name": (manifest.origin or {}).get("repo", ""), "created": self.clock()}
            doc["bytes"] = sum(f["size"] for f in manifest.files)
            # copies whose folder is gone are forgotten here, not only by ``gc``: every join reads and rewrites
            # this record twice under the index lock, and --out folders made and deleted by the thousand (2,359
            # on a bench host, 285 KB of JSON) cost each time 10-14 ms of CPU, eight joins on one host in turn
            copies = [c for c in doc.get("copies", []) if c.get("path") != path and os.path.isdir(c.get("path", ""))]
            doc["copies"] = copies + [{"path": path, "owned": owned, "layout": layout}]
            return doc

        self._update(manifest.model_id, change)

    def used(self, model_id: str, fetch_seconds: float | None = None) -> None:
        """The model was fetched (taking ``fetch_seconds``), joined from a complete copy, or seeded: now."""
        def change(doc):
            if doc is None:
                return None
            doc["uses"] = (doc.get("uses", []) + [self.clock()])[-MAX_USES:]
            if fetch_seconds is not None:
                doc["fetch_seconds"] = fetch_seconds
            return doc

        self._update(model_id, change)

    def copy_complete(self, manifest, copy: dict) -> bool:
        try:
            return marker_matches(manifest, copy["path"],
                                  copy_paths(manifest, copy["path"], self.names(manifest, copy.get("layout"))))
        except (OSError, ValueError):
            return False

    def find_complete(self, wanted: str, place: str | None = None, layout: str = "files"):
        """``(manifest, copy path, layout)`` of a complete copy of the model ``wanted`` (an id or a prefix of one),
        or None.  With ``place``: only the copy in that --out DIR (``layout='files'``) or in that hub cache
        (``'hf'``); without: any copy in ``layout`` the cache knows of, its own first.  Costs a stat per file
        (the marker)."""
        place = os.path.abspath(place) if place else None
        for model_id in self.model_ids():
            if not model_id.startswith(wanted.lower()):
                continue
            m = self.manifest(model_id)
            copies = (self.record(model_id) or {}).get("copies", [])
            for c in sorted(copies, key=lambda c: not self.owns(c["path"])):
                lay = c.get("layout", "files")
                if lay != layout or place is not None and place != (
                        os.path.dirname(c["path"]) if lay == "hf" else c["path"]):
                    continue
                if m is not None and self.copy_complete(m, c):
                    return m, c["path"], lay
        return None

    def owns(self, path: str) -> bool:
        """Whether the copy at ``path`` is the cache's own (a folder of models/), which it may delete; told by
        the path, never by a record (a torn or hand-edited one could name any folder)."""
        return os.path.dirname(path) == self.models

    def entries(self) -> list[Entry]:
        """Every copy the cache knows of, with whether it is complete and in use now."""
        out = []
        for model_id in self.model_ids():
            doc = self.record(model_id) or {}
            m = self.manifest(model_id)
            for c in doc.get("copies", []):
                in_use = False
                if os.path.isdir(c["path"]):
                    fd = try_exclusive(c["path"])
                    in_use = fd is None
                    if fd is not None:
                        os.close(fd)
                out.append(Entry(model_id=model_id, bytes=doc.get("bytes", 0), uses=list(doc.get("uses", [])),
                                 fetch_seconds=doc.get("fetch_seconds"), owned=self.owns(c["path"]),
                                 complete=m is not None and self.copy_complete(m, c), in_use=in_use,
                                 path=c["path"], name=doc.get("name", ""), layout=c.get("layout", "files")))
        return out

    def hold(self, path: str, write: bool = False, complete=lambda: False) -> CopyLock:
        return CopyLock(path, write, complete)

    def hold_if_known(self, path) -> CopyLock | None:
        """A lock on the copy at ``path`` if the cache knows it (a seeder serving a cached model), else None."""
        real = os.path.realpath(os.fspath(path))
        for model_id in self.model_ids():
            for c in (self.record(model_id) or {}).get("copies", []):
                if os.path.realpath(c["path"]) == real and os.path.isdir(real):
                    self.used(model_id)
                    return CopyLock(real)
        return None

    # ----- eviction and removal ----------------------------------------------------------------

    def make_room(self, incoming: int, model_id: str) -> list[Entry]:
        """Evict complete, unused owned models (by ``EvictionPolicy``) so ``incoming`` bytes of ``model_id`` fit
        under the cache size; ModelCacheError if they cannot.  Returns what was evicted."""
        if self.size is None:
            return []
        entries = [e for e in self.entries() if e.model_id != model_id]
        if incoming > self.size:
            raise CacheTooSmall(f"not enough disk: model {model_id[:16]} needs {incoming} bytes, more than the "
                                  f"cache size {self.size} bytes (--cache-size / P2PW_CACHE_SIZE)")
        victims = self.eviction.victims(entries, incoming, self.size)
        if victims is None:
            held = sum(e.bytes for e in entries if e.owned and (e.in_use or not e.complete))
            raise ModelCacheError(f"cannot make room for model {model_id[:16]} ({incoming} bytes) under the cache "
                                  f"size {self.size} bytes: {held} bytes are in use or still being fetched")
        evicted = []
        for e in victims:
            if self._remove_copy(e.model_id, e.path, delete=True):
                evicted.append(e)
        return evicted

    def _remove_copy(self, model_id: str, path: str, delete: bool) -> bool:
        """Remove (``delete``) or forget one copy, if no join or seed holds it; whether it went."""
        fd = try_exclusive(path) if os.path.isdir(path) else None
        if fd is None and os.path.isdir(path):
            return False
        try:
            if delete:
                remove_tree(path)
        finally:
            if fd is not None:
                os.close(fd)

        def change(doc):
            if doc is None:
                return None
            doc["copies"] = [c for c in doc.get("copies", []) if c["path"] != path]
            return doc if doc["copies"] else None

        self._update(model_id, change)
        return True

    def remove(self, text: str) -> list[str]:
        """``p2pw cache rm MODEL``: delete the cache's own copy, forget --out copies (their files stay)."""
        model_id = self.resolve(text)
        record = self.record(model_id)
        if record is None:  # unreadable (torn or hand-edited): the cache's own folder of it, if any, is the copy
            own = self.copy_dir(model_id)
            record = {"copies": [{"path": own}] if os.path.isdir(own) else []}
        done = []
        for c in record.get("copies", []):
            if not self._remove_copy(model_id, c["path"], delete=self.owns(c["path"])):
                raise ModelCacheError(f"model {model_id[:16]} at {c['path']} is in use (a join or seed holds it)")
            done.append(c["path"])
        self._update(model_id, lambda doc: doc if doc and doc.get("copies") else None)  # one of no copy goes too
        self.failed.clear(model_id)
        return done

    def gc(self) -> dict:
        """Forget copies that are gone and unreadable records, delete unused incomplete owned copies and stray
        folders, drop expired failures, and evict down to the cache size.  Returns what it did."""
        report = {"forgotten": [], "unreadable": [], "incomplete": [], "evicted": [], "failures": 0}
        for model_id in self.model_ids():  # torn or hand-edited records: dropped (a valid one is written back)
            if self.record(model_id) is None and self._update(model_id, lambda doc: doc) is None:
                report["unreadable"].append(self._record_path(model_id))
        known = set()
        for e in self.entries():
            known.add(e.path)
            if not os.path.isdir(e.path):
                self._remove_copy(e.model_id, e.path, delete=False)
                report["forgotten"].append(e.path)
            elif e.owned and not e.complete and not e.in_use:
                if self._remove_copy(e.model_id, e.path, delete=True):
                    report["incomplete"].append(e.path)
        if os.path.isdir(self.models):
            for name in os.listdir(self.models):
                path = os.path.join(self.models, name)
                if path not in known:
                    fd = try_exclusive(path) if os.path.isdir(path) else None
                    if fd is not None:
                        remove_tree(path)
                        os.close(fd)
                        report["incomplete"].append(path)
        for key, rec in self.failed.records():
            if not self.failures.blocks(rec):
                self.failed.clear(key)
                report["failures"] += 1
        if self.size is not None:
            entries = self.entries()
            victims = self.eviction.victims(entries, 0, self.size) or []
            for e in victims:
                if self._remove_copy(e.model_id, e.path, delete=True):
                    report["evicted"].append(e)
        return report

class FailureMemory:
    """Joins that failed for a cause that repeats, one JSON file each in ``dir``, judged by ``policy``."""

    def __init__(self, dir: str, policy: FailurePolicy):
        self.dir, self.policy = dir, policy

    def _failure_path(self, key: str, where: str | None, tracker: str | None = None) -> str:
        name = sha256((f"{key}\0{where or ''}" + (f"\0{tracker}" if tracker else "")).encode()).hexdigest()[:32]
        return os.path.join(self.dir, name + ".json")

    def records(self):
        """``(key, record)`` of every remembered failure."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return
        for n in names:
            try:
                with open(os.path.join(self.dir, n)) as f:
                    rec = json.load(f)
                if not (isinstance(rec["key"], str) and isinstance(rec["reason"], str)
                        and all(isinstance(rec.get(k, 1), (int, float)) for k in ("at", "count"))):
                    continue  # torn or hand-edited: not a failure this code can judge
                yield rec["key"], rec
            except (OSError, ValueError, KeyError, TypeError):
                continue

    def blocking(self, wanted: str, where: str | None = None, tracker: str | None = None,
                 sources=None) -> dict | None:
        """The remembered failure, still within its backoff, of a model ``wanted`` names (an id or a prefix; a
        record made for a prefix matches ids extending it), or None.  A failure tied to a destination (not
        enough disk there) only blocks joins into that destination; one tied to a tracker (its refusal) only
        joins through that tracker; one tied to sources (their chunks failed their checksums) only a join
        through that tracker whose ``sources`` (the addresses its plan names) all failed so before."""
        wanted = wanted.lower()
        for key, rec in self.records():
            if ((key.startswith(wanted) or wanted.startswith(key)) and rec.get("where") in (None, where)
                    and rec.get("tracker") in (None, tracker) and same_sources(rec, sources)
                    and self.policy.blocks(rec)):
                return rec
        return None

    def remember(self, key: str, cause: str, reason: str, where: str | None = None,
                 tracker: str | None = None, sources=None) -> dict:
        """Remember that a join of ``key`` (a model id, or the id a join pinned) failed for ``cause``
        (``where``: the destination it is tied to, ``tracker``: the node whose answer it was, if any;
        ``sources``: the addresses whose chunks failed, added to those remembered through ``tracker``)."""
        if cause not in CAUSES:
            raise KeyError(f"unknown failure cause {cause!r}")
        os.makedirs(self.dir, exist_ok=True)
        path = self._failure_path(key.lower(), where, tracker)
        try:
            with open(path) as f:
                previous = json.load(f)
        except (OSError, ValueError):
            previous = None
        rec = dict(self.policy.failed(previous, cause, reason), key=key.lower(), where=where,
                   **({"tracker": tracker} if tracker else {}))
        if sources is not None:
            old = previous.get("sources") if isinstance(previous, dict) else None
            rec["sources"] = sorted(set(sources) | set(old if isinstance(old, list) else ()))
        write_atomically(path, rec, durable=False)
        return rec

    def bad_sources(self, key: str, reason: str, tracker: str | None, sources) -> dict:
        """Remember that every source failed its checksums in a join of ``key`` through ``tracker``,
        ``sources`` being the addresses whose chunks failed.  Anyone may join a fleet without a key and serve
        garbage, so the failure speaks for those sources only: a join through another tracker, or one whose
        plan names a source not among them, is not refused."""
        return self.remember(key, "checksums", reason, tracker=tracker, sources=sorted(sources))

    def refused(self, key: str, reason: str, tracker: str, keyed: bool) -> dict:
        """Remember that ``tracker`` refused the pinned ``key`` ("model id mismatch").  Without a fleet key
        anyone can answer so, so the refusal speaks for that tracker only (a stranger's blocks only joins
        through the stranger); a keyed fleet's answer is authenticated and blocks every join of ``key``."""
        return self.remember(key, "refused", reason, tracker=None if keyed else tracker)

    def clear(self, key: str) -> None:
        """Forget every failure remembered for ``key`` (a join of it succeeded, or it was removed)."""
        key = key.lower()
        for k, rec in list(self.records()):
            if k.startswith(key) or key.startswith(k):
                try:
                    os.remove(self._failure_path(k, rec.get("where"), rec.get("tracker")))
                except FileNotFoundError:
                    pass


def same_sources(rec: dict, sources) -> bool:
    """Whether a failure ``rec`` applies to a join with ``sources``: one tied to no sources always does; one
    tied to sources only when the join names some, each among them (nothing new to try)."""
    bad = rec.get("sources")
    if bad is None:
        return True
    return isinstance(bad, list) and bool(sources) and set(sources) <= set(bad)


def describe_failure(rec: dict, policy: FailurePolicy) -> str:
    """One line: the remembered reason, and when a retry is allowed."""
    left = max(policy.until(rec) - policy.clock(), 0)
    return (f"{rec['reason']} (remembered: failed {rec.get('count', 1)} time{'s' if rec.get('count', 1) != 1 else ''}"
            f" for this cause, not retried for {math.ceil(left)} s more; --retry-now tries at once)")
