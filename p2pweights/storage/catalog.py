"""Catalog: manifests this host has already built, so a restarted seeder serves at once.

A manifest is filed under a key made of the checkpoint's path, chunk size,
hash and every file's (name, size, mtime).  A seeder that finds its key here
skips the hashing scan and reads each chunk from storage only when a peer
first asks for it, verifying it against the manifest: after a restart,
storage is read only for what peers still lack, and a file changed since
stays detectable (its chunks no longer match).  Lives in ``$P2PW_CACHE_DIR``
(default ``~/.cache/p2pweights``); losing it only costs a rescan.
"""
from __future__ import annotations

import json
import os

from .cache import write_text_atomically
from ..sources.formats import checkpoint_files
from ..sources.manifest import Manifest, ManifestError, sha256


def _dir() -> str:
    return os.path.join(os.environ.get("P2PW_CACHE_DIR") or os.path.expanduser("~/.cache/p2pweights"), "manifests")


def _key(path, chunk_size: int | None, hash: str, exclude=()) -> str:
    stats = [(name, size, os.stat(full).st_mtime_ns) for name, full, size in checkpoint_files(path, exclude)]
    doc = [os.path.abspath(os.fspath(path)), chunk_size, hash, stats]
    return sha256(json.dumps(doc).encode()).hexdigest()


def lookup(path, chunk_size: int | None, hash: str, exclude=()) -> Manifest | None:
    """The manifest built earlier for exactly these files, or None (``chunk_size`` None: the default's)."""
    try:
        with open(os.path.join(_dir(), _key(path, chunk_size, hash, exclude) + ".json")) as f:
            return Manifest.from_json(f.read())
    except (OSError, ManifestError):
        return None


def remember(path, manifest: Manifest, exclude=(), chunk_size: int | None = None) -> None:
    """File ``manifest`` for ``path``, found again by ``lookup`` with the same ``chunk_size`` (None:
    it was built with the default's) (best effort: a read-only home just means rescans)."""
    try:
        os.makedirs(_dir(), exist_ok=True)
        final = os.path.join(_dir(), _key(path, chunk_size, manifest.hash, exclude) + ".json")
        write_text_atomically(final, manifest.to_json())
    except OSError:
        pass
