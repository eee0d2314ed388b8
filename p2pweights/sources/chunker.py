"""Chunker: cut a checkpoint into chunks and hash each one, reading every byte once.

The step between a source and its manifest: the blob layout comes from
``formats``, the bytes from ``source``, and the result is a ``Manifest`` (which
itself never reads blob bytes).
"""
from __future__ import annotations

from . import formats
from .manifest import Manifest, chunk_hasher, chunk_size_for
from .source import BlobSource


def build(path, chunk_size: int | None = None, hash: str = "xxh3_64", into=None, on_chunk=None,
          exclude=(), origin: dict | None = None, etags: dict | None = None):
    """Read checkpoint ``path`` once: (Manifest, bytes read from storage, the ``into`` buffer or None).

    Each chunk is read from storage exactly once; when ``into`` is given it is
    called with the blob's size and returns a writable buffer where the bytes
    land, so a seeder keeps what it hashed.  ``chunk_size`` None: ``default_chunk_size``
    of the blob.  ``on_chunk(index)`` is called after each chunk is hashed.  ``exclude``: globs of entries left out (see ``formats.scan``).
    ``origin`` and ``etags`` (file name -> etag) describe a Hugging Face snapshot (``hfcache.snapshot_of``).
    """
    files, tensors, total = formats.layout(path, exclude)
    chunk_size = chunk_size_for(chunk_size, total)
    for f in files:
        if etags and f["name"] in etags:
            f["etag"] = etags[f["name"]]
    digest = chunk_hasher(hash)
    source = BlobSource(path, files)
    chunks = []
    buffer = into(total) if into is not None else None
    scratch = None if buffer is not None else bytearray(chunk_size)
    try:
        for index, lo in enumerate(range(0, total, chunk_size)):
            hi = min(lo + chunk_size, total)
            view = memoryview(buffer)[lo:hi] if buffer is not None else memoryview(scratch)[: hi - lo]
            source.read_into(lo, view)
            chunks.append(digest(view))
            if on_chunk:
                on_chunk(index)
    finally:
        source.close()
    m = Manifest(total_size=total, chunk_size=chunk_size, chunks=chunks, files=files, tensors=tensors, hash=hash,
                 origin=origin)
    return m, source.bytes_read, buffer
