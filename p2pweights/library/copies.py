"""Copies: where a join's copy lives (``--out``, the model cache, a Hugging Face cache), opening it for writing
or resuming, what the cache remembers of failures, and a complete local copy opened without a swarm."""
from __future__ import annotations

import logging
import os

from ..errors import P2PError
from ..sources.manifest import check_model_id, ManifestError
from ..storage import hfcache
from ..storage.cache import copy_paths, DiskCache, marker_matches, remove_tree, STATE_DIR
from ..storage.modelcache import CacheTooSmall, describe_failure, ModelCache
from ..storage.ring import ChunkRing, ring_budget
from ..storage.store import blob_backing, SpaceError, Store
from ..storage.workers import in_flight_limit

log = logging.getLogger("p2pw")


def _destination(out, cache, hf_cache) -> str:
    """Where a join writes, as failures tied to a place (not enough disk) remember it."""
    if hf_cache is not None:
        return "hf:" + os.path.abspath(hf_cache)
    if out is not None:
        return os.path.abspath(out)
    return cache.models if cache is not None else "memory"


def _refuse_remembered(cache: ModelCache, wanted: str, where: str, tracker: str | None = None,
                       sources=None) -> None:
    """P2PError with the remembered reason if a join of ``wanted`` into ``where`` (through ``tracker``, pulling
    from ``sources``) failed lately for a repeating cause."""
    rec = cache.failed.blocking(wanted, where, tracker, sources)
    if rec is not None:
        raise P2PError(describe_failure(rec, cache.failures))


def _open_copy(manifest, out, cache, hf_cache, verify, memory_budget, where, ring: bool, held=None, workers=0):
    """The copy this join writes: ``(DiskCache or None, Store, CopyLock or None, directory, layout)``.

    ``held``: the ``localcopy.CopyClaim`` on ``out``, which becomes the copy's lock and publishes each verified
    chunk to local readers.

    ``ring``: files on disk are received, written and served through a ``ring.ChunkRing`` where they can be
    written around the page cache (not for a device sink, which reads the store later, on its own thread), with
    a slot more for each chunk ``workers`` threads may still verify and write; it grows with the rate to an eighth
    of ``memory_budget`` (``ring.ring_budget``).

    In the model cache's own folder, room is made first (eviction); the copy is locked for writing and
    the cache told of it.  Nothing is left behind on failure; not enough disk is remembered."""
    target, names, layout = _place(manifest, out, cache, hf_cache)
    fresh = target is not None and not os.path.exists(target)
    disk, lock = None, held
    try:
        if target is not None and cache is not None:
            if layout == "files" and out is None:  # the cache's own folder: make room under its size first
                for e in cache.make_room(sum(f["size"] for f in manifest.files), manifest.model_id):
                    log.warning("evicted model %s (%s, %d bytes) from the cache to make room",
                                e.model_id[:16], e.name or e.path, e.bytes)
            lock = held or cache.hold(target, write=True, complete=lambda: marker_matches(
                manifest, target, copy_paths(manifest, target, names)))
            cache.remember(manifest, target, layout)
        # with out, the destination files are the store (mapped); else memory, or a temp file over the budget
        disk = DiskCache(manifest, target, verify=verify, names=names, direct=ring) if target is not None else None
        slots = (ChunkRing(manifest.chunk_size, busy=in_flight_limit(workers),
                           most=ring_budget(manifest.chunk_size, memory_budget)) if disk and disk.direct else None)
        store = (Store(manifest, disk.filemap.buffer, files=disk, ring=slots) if disk is not None
                 else Store(manifest, blob_backing(manifest.total_size, memory_budget)))
        if held is not None:
            store.sinks.append(held.publish(manifest))
    except Exception as e:
        disk and disk.close()
        lock and lock.release()
        if disk is None and fresh and os.path.isdir(target) and os.listdir(target) == [STATE_DIR]:
            remove_tree(target)  # made for this join, holds nothing
        if cache is not None and isinstance(e, (SpaceError, CacheTooSmall)):
            cache.failed.remember(manifest.model_id, "disk", str(e), where=where)
        raise
    return disk, store, lock, target, layout


def _place(manifest, out, cache, hf_cache):
    """(directory of the copy or None for memory, file names there or None, layout) for this join."""
    if hf_cache is not None:
        return hfcache.repo_dir(manifest, hf_cache), hfcache.blob_names(manifest), "hf"
    if out is not None:
        return os.path.abspath(out), None, "files"
    if cache is None:
        return None, None, "memory"
    known = cache.find_complete(manifest.model_id)
    return (known[1] if known else cache.copy_dir(manifest.model_id)), None, "files"


def local_copy(model_id: str, cache: ModelCache, out: str | None = None, hf_cache: str | None = None):
    """The directory of a complete copy of ``model_id`` (an id or a prefix) that the cache knows, for a join
    that need not ask anyone: in ``out``, in the hub cache ``hf_cache`` (its snapshot directory, symlinks and
    ref written again if missing), or anywhere, and its manifest; None if there is none.  Costs the marker
    check."""
    try:
        wanted = check_model_id(model_id)
    except ManifestError as e:
        raise P2PError(str(e)) from None
    if hf_cache is not None:
        found = cache.find_complete(wanted, hf_cache, "hf")
    else:
        found = cache.find_complete(wanted, out, "files")
    if found is None:
        return None
    manifest, path, layout = found
    cache.used(manifest.model_id)
    cache.failed.clear(manifest.model_id)
    return (hfcache.publish(manifest, path) if layout == "hf" else path), manifest
