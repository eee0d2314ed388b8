"""Tracker state: what a standalone tracker keeps on ``--state-dir`` across a restart.

The folder holds one file per published manifest, ``MODEL_ID.manifest`` (its
canonical wire bytes), and ``bindings.json``: every URL's candidate manifests
(model id, the address that published it, operator's, confirmed by a reader)
and who opened each swarm.  Each file is written by rename from a temporary
name, fsynced, folder too.  On start every file is hostile: a manifest is
checked by the strict validator against the id its name gives, a binding by
type and cap; a file that fails (truncated, a symlink, another model's bytes,
too large) costs one log line and is skipped, never the tracker's start.
"""
from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import dataclass, field

from ...sources.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError
from ...storage.cache import fsync_dir, write_text_atomically
from ...wire.protocol import MAX_CANDIDATES, MAX_URL, is_model_id

log = logging.getLogger("p2pw")

BINDINGS = "bindings.json"
SUFFIX = ".manifest"
MAX_BINDINGS_BYTES = 16 << 20  # bindings.json read at most (256 swarms' URLs fit in far less)
VERSION = 1


@dataclass
class Kept:
    """What a state folder gave back: manifests by model id, each URL's candidates (dicts of ``Candidate``'s
    fields), each swarm's opener, and how many files or entries were skipped."""

    manifests: dict[str, Manifest] = field(default_factory=dict)
    urls: dict[str, list[dict]] = field(default_factory=dict)
    opened: dict[str, dict] = field(default_factory=dict)
    skipped: int = 0


class TrackerState:
    """The tracker's ``--state-dir``: ``load`` on start, ``save`` after each change (the loop's thread only)."""

    def __init__(self, path: str, max_swarms: int):
        self.path, self.max_swarms = os.path.abspath(path), max_swarms
        try:
            os.makedirs(self.path, exist_ok=True)
        except FileExistsError:
            raise NotADirectoryError(errno.ENOTDIR, "not a folder") from None
        self.written: set[str] = set()  # model ids whose manifest file is on disk

    # ----- reading: hostile ---------------------------------------------------

    def _read(self, name: str, limit: int) -> bytes:
        """The bytes of ``name`` in the folder: no link followed, a regular file, at most ``limit`` bytes."""
        fd = os.open(os.path.join(self.path, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not os.path.stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            if st.st_size > limit:
                raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} read")
            return f.read(limit + 1)[:limit]

    def load(self) -> Kept:
        """The manifests and bindings in the folder, each checked; a bad one logged once and skipped."""
        kept = Kept()
        names = sorted(os.listdir(self.path))
        for name in names:
            mid = name[:-len(SUFFIX)]
            if not name.endswith(SUFFIX) or not is_model_id(mid) or mid != mid.lower():
                continue
            if len(kept.manifests) >= self.max_swarms:
                log.warning("state %s: more than %d manifests: %s and the rest skipped", self.path,
                            self.max_swarms, name)
                kept.skipped += 1
                break
            try:
                kept.manifests[mid] = Manifest.from_wire(self._read(name, MAX_MANIFEST_BYTES), expect_id=mid)
            except (OSError, ManifestError) as e:
                kept.skipped += 1
                log.warning("state %s: %s skipped: %s", self.path, name, _why(e))
        self.written = set(kept.manifests)
        if BINDINGS in names:
            try:
                doc = json.loads(self._read(BINDINGS, MAX_BINDINGS_BYTES))
                if not isinstance(doc, dict) or doc.get("version") != VERSION:
                    raise ValueError(f"not a version {VERSION} bindings document")
            except (OSError, ValueError) as e:
                kept.skipped += 1
                log.warning("state %s: %s skipped (URLs bind to no model until published again): %s", self.path,
                            BINDINGS, _why(e))
            else:
                kept.skipped += _bindings(doc, kept)
        return kept

    # ----- writing: durable ----------------------------------------------------

    def save(self, manifests: dict[str, Manifest], urls: dict[str, list[dict]], opened: dict[str, dict]) -> None:
        """Manifests not yet on disk written, those of swarms gone removed, then the bindings (so a binding
        never names a manifest that is not there yet); each by rename, fsynced."""
        for mid in sorted(set(manifests) - self.written):
            write_text_atomically(os.path.join(self.path, mid + SUFFIX),
                                  manifests[mid].wire_bytes().decode(), durable=True)
            self.written.add(mid)
        doc = {"version": VERSION, "urls": urls, "opened": opened}
        write_text_atomically(os.path.join(self.path, BINDINGS), json.dumps(doc, indent=1, sort_keys=True),
                              durable=True)
        gone = self.written - set(manifests)
        for mid in sorted(gone):
            try:
                os.unlink(os.path.join(self.path, mid + SUFFIX))
            except FileNotFoundError:
                pass
        if gone:
            fsync_dir(self.path)
        self.written -= gone


def _bindings(doc: dict, kept: Kept) -> int:
    """Fill ``kept``'s URLs and openers from ``doc``, each entry checked; how many were skipped."""
    skipped = 0
    urls, opened = doc.get("urls"), doc.get("opened")
    for url, cands in (urls.items() if isinstance(urls, dict) else ()):
        good = [c for c in (cands if isinstance(cands, list) else []) if _candidate(c, kept.manifests)]
        ok = isinstance(url, str) and 0 < len(url) <= MAX_URL and url.isprintable() and not is_model_id(url)
        skipped += (len(cands) if isinstance(cands, list) else 1) - (len(good) if ok else 0)
        if ok and good:
            kept.urls[url] = good[:MAX_CANDIDATES]
    for mid, who in (opened.items() if isinstance(opened, dict) else ()):
        if isinstance(who, dict) and _candidate({**who, "model_id": mid, "confirmed": False}, kept.manifests):
            kept.opened[mid] = {"source": who["source"], "operator": who["operator"]}
    if skipped:
        log.warning("%d URL bindings in the state folder skipped (malformed, or their manifest is gone)", skipped)
    return skipped


def _candidate(c, manifests: dict) -> bool:
    """Whether ``c`` is a well-formed candidate naming a manifest that loaded."""
    return (isinstance(c, dict) and c.get("model_id") in manifests and isinstance(c.get("source"), str)
            and len(c["source"]) <= MAX_URL and type(c.get("operator")) is bool and type(c.get("confirmed")) is bool)


def _why(e: Exception) -> str:
    if isinstance(e, OSError) and e.errno == errno.ELOOP:
        return "a symlink (a state folder's files are never followed out of it)"
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)
