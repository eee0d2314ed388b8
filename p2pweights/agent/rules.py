"""The agent's decisions, pure: the pre-warm list, what may be evicted, how ready a model is, whether the agent
is alive."""
from __future__ import annotations

import os

from ..storage.modelcache import Entry, EvictionPolicy

STATES = ("starting", "fetching", "ready", "failed")


def prewarm_lines(text: str) -> list[str]:
    """The models a pre-warm file lists: one URL or model id a line, blank lines and ``#`` comments skipped,
    each once in the order first listed."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and line not in out:
            out.append(line)
    return out


def origin_of(url: str, local_roots: list[str], home=os.path.expanduser) -> tuple[str | None, str]:
    """How the agent reads the origin named ``url``: ``(kind, what)``, ``kind`` one of ``s3``, ``hub`` (a repo id
    ``ORG/NAME[@REVISION]`` in the Hugging Face cache), ``path`` (``what``: the folder, resolved) or None (not here:
    ``what`` says why).  Rules: an ``s3://`` URL is read from the object store; an absolute path (``/``, ``~``) is
    read only where it resolves (links followed) to a ``local_roots`` folder or below, and with none given never;
    a relative name (``tmp/x``, ``./x``) is never a path: it is a repo id or nothing."""
    from ..sources.objstore import is_s3
    from ..storage.hfcache import parse_repo_ref

    if is_s3(url):
        return "s3", url
    if url.startswith(("/", "~")):
        real = os.path.realpath(home(url))
        for root in local_roots:
            r = os.path.realpath(root)
            if real == r or real.startswith(r.rstrip("/") + "/"):
                return "path", real
        return None, (f"{url} is under no --local-root" if local_roots else
                      "a local path, and the agent was given no --local-root")
    if parse_repo_ref(url) is not None:
        return "hub", url
    return None, f"{url} is neither s3://, an absolute path nor a repo id ORG/NAME"


def changes(old: list[str], new: list[str]) -> tuple[list[str], list[str]]:
    """``(added, removed)`` between two pre-warm lists."""
    return [x for x in new if x not in old], [x for x in old if x not in new]


class PrewarmFile:
    """A pre-warm file watched by its mtime and size (a ConfigMap mounted as a file is replaced by a rename);
    ``poll`` returns the new list when it changed, else None.  A file that vanished lists nothing."""

    def __init__(self, path: str):
        self.path, self.seen, self.lines = path, None, []

    def poll(self) -> list[str] | None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self.seen:
            return None
        self.seen = stamp
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                lines = prewarm_lines(f.read())
        except OSError:
            lines = []
        if lines == self.lines:
            return None
        self.lines = lines
        return lines


def victims(entries: list[Entry], kept: set[str], closable: set[str], incoming: int, budget: int,
            policy: EvictionPolicy) -> list[Entry] | None:
    """The cache entries to evict so ``incoming`` bytes fit under ``budget`` (None: it cannot be done).

    The agent itself holds every model it serves, so the cache sees each as in use: a model the agent serves
    (``closable``) counts as unused unless it is ``kept`` (on the pre-warm list, or still being fetched);
    copies another process holds stay in use.  Among the rest, the cache's own policy chooses."""
    seen = []
    for e in entries:
        free = e.model_id in closable and e.model_id not in kept
        seen.append(Entry(e.model_id, e.bytes, e.uses, e.fetch_seconds, e.complete,
                          in_use=(e.in_use and not free) or e.model_id in kept, owned=e.owned, path=e.path,
                          name=e.name, layout=e.layout))
    return policy.victims(seen, incoming, budget)


def alive(running: bool, since_tick: float, answered: bool | None, wedged: float) -> tuple[bool, str]:
    """``(alive, why not)`` of an agent: its threads ``running``, its loop ticked ``since_tick`` seconds ago (within
    ``wedged``), and its socket ``answered`` a status.  Its tracker, its models and its pre-warm list are not asked:
    a restart mends none of them."""
    if not running:
        return False, "the agent's loop or socket thread stopped"
    if since_tick > wedged:
        return False, f"the agent's loop has not ticked for {since_tick:.0f} s"
    if not answered:
        return False, "the agent's socket does not answer"
    return True, ""


def readiness(lines: dict[str, str]) -> tuple[bool, dict]:
    """``(ready, waiting)`` of the agent as a whole, from the state of each pre-warm line's model: ready once
    every one is; ``waiting`` maps each line that is not to its state."""
    waiting = {line: state for line, state in lines.items() if state != "ready"}
    return not waiting, waiting
