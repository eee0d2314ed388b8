"""Manifest: what a checkpoint is, in a few KB of JSON.

The manifest names the blob (total size, chunk size, one hash per chunk), how
the blob maps back to files (file table) and to tensors (tensor index).  Its
model id is the SHA-256 of its canonical JSON (sorted keys, no whitespace,
``model_id`` left out), so a joiner can pin exactly one checkpoint and a
manifest that was altered in flight fails its own hash.  Optional fields
that a plain local checkpoint never has, so its model id does not change: a
file entry's ``etag`` (the object's ETag when the blob came from an object
store, s3://, so a seeder can refuse an object that changed since; its blob's
name in a Hugging Face cache), and ``origin`` (``{repo, commit, revision}``:
the Hugging Face snapshot it was seeded from).
"""
from __future__ import annotations

import json

import xxhash

from ..errors import P2PError
from . import validate
from .formats import ALIGN
from .validate import ManifestError

try:  # CPython's own SHA-256 for the model id: importing hashlib loads OpenSSL, 2 ms of every join's start
    from _sha2 import sha256  # 3.12+
except ImportError:
    try:
        from _sha256 import sha256  # 3.10, 3.11
    except ImportError:  # a Python built without it
        from hashlib import sha256

VERSION = 1
DEFAULT_CHUNK_SIZE = 4 << 20  # measured: see README "Choosing the chunk size"
SMALLEST_DEFAULT_CHUNK = 512 << 10
MIN_CHUNKS = 512  # a default chunk is halved (down to 512 KiB) until the blob has this many
HASHES = {"xxh3_64": lambda b: xxhash.xxh3_64_hexdigest(b)}
STRONG_HASHES = ("sha256", "blake2b", "blake3")  # collision-resistant: stop a peer that forges chunks on purpose
HASH_NAMES = ("xxh3_64", *STRONG_HASHES)
MAX_CHUNK_SIZE = 256 << 20  # a joiner refuses larger chunks (one chunk is one message and one buffer)
MAX_MANIFEST_BYTES = 64 << 20  # largest manifest accepted: a 1 TB model's is 31 MiB (xxh3, 4 MiB chunks, 150,000
#                                tensors) to 57 MiB (blake2b); see docs/security.md
MAX_OBJECTS = 1 << 20  # JSON objects in one manifest (files and tensors): a parse stops at the next one
MIN_MODEL_ID = 16  # hex digits of a pinned model id (64 bits); fewer pins next to nothing


def default_chunk_size(total: int) -> int:
    """The chunk size a seeder uses unless told: ``DEFAULT_CHUNK_SIZE``, halved down to
    ``SMALLEST_DEFAULT_CHUNK`` while the blob of ``total`` bytes has fewer than ``MIN_CHUNKS``.

    A tree pays about its depth in chunk-times to fill and to drain, so a small
    checkpoint is cut finer; anything of 2 GiB or more keeps 4 MiB."""
    size = DEFAULT_CHUNK_SIZE
    while size > SMALLEST_DEFAULT_CHUNK and -(-total // size) < MIN_CHUNKS:
        size //= 2
    return size


def chunk_size_for(asked: int | None, total: int) -> int:
    """The chunk size to cut a blob of ``total`` bytes with: ``asked`` (a positive multiple of
    ``formats.ALIGN``, else ManifestError), or the default for its size when None."""
    if asked is None:
        return default_chunk_size(total)
    if asked <= 0 or asked % ALIGN or asked > MAX_CHUNK_SIZE:
        raise ManifestError(f"chunk size must be a positive multiple of {ALIGN} up to {MAX_CHUNK_SIZE >> 20} MiB "
                            f"(joiners refuse larger chunks), got {asked}")
    return asked


def chunk_hasher(name: str):
    """The function ``bytes-like -> hex digest`` for hash algorithm ``name``."""
    if name in HASHES:
        return HASHES[name]
    if name in ("sha256", "blake2b"):
        import hashlib

        return lambda b: hashlib.new(name, b).hexdigest()
    if name == "blake3":
        try:
            from blake3 import blake3
        except ImportError:
            raise ManifestError("chunk hash blake3 needs the blake3 package (pip install blake3)") from None
        return lambda b: blake3(b, max_threads=blake3.AUTO).hexdigest()
    raise ManifestError(f"unknown chunk hash {name!r} (known: {', '.join(HASH_NAMES)})")


def check_model_id(text: str) -> str:
    """A pinned model id (the full id or a prefix of at least MIN_MODEL_ID hex digits), lower-cased."""
    text = text.strip().lower()
    if len(text) < MIN_MODEL_ID or len(text) > 64 or any(c not in "0123456789abcdef" for c in text):
        raise ManifestError(f"bad model id {text[:80]!r}: give the id p2pw seed printed "
                            f"(64 hex digits, or at least its first {MIN_MODEL_ID})")
    return text


class Manifest:
    """One checkpoint as a blob of fixed-size chunks; ``origin``: {repo, commit, revision} of a Hugging
    Face snapshot, None for plain files."""

    def __init__(self, total_size: int, chunk_size: int, chunks: list[str], files: list[dict] | None = None,
                 tensors: list[dict] | None = None, hash: str = "xxh3_64", version: int = VERSION,
                 origin: dict | None = None):
        self.total_size, self.chunk_size, self.chunks = total_size, chunk_size, chunks
        self.files = [] if files is None else files
        self.tensors = [] if tensors is None else tensors
        self.hash, self.version, self.origin = hash, version, origin

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Byte range [lo, hi) of chunk ``index`` in the blob."""
        lo = index * self.chunk_size
        return lo, min(lo + self.chunk_size, self.total_size)

    def chunks_covering(self, lo: int, hi: int) -> range:
        """Indices of the chunks that hold bytes [lo, hi) of the blob."""
        if lo < 0 or hi > self.total_size or lo > hi:
            raise ValueError(f"range [{lo}, {hi}) is outside the blob of {self.total_size} bytes")
        if lo == hi:
            return range(0)
        return range(lo // self.chunk_size, (hi - 1) // self.chunk_size + 1)

    def body(self) -> dict:
        doc = {
            "version": self.version,
            "total_size": self.total_size,
            "chunk_size": self.chunk_size,
            "hash": self.hash,
            "chunks": self.chunks,
            "files": self.files,
            "tensors": self.tensors,
        }
        if self.origin is not None:  # absent, not null, so plain checkpoints keep their model id
            doc["origin"] = self.origin
        return doc

    @property
    def model_id(self) -> str:
        return sha256(canonical(self.body())).hexdigest()

    def to_json(self, indent: int | None = None) -> str:
        doc = dict(self.body(), model_id=self.model_id)
        return json.dumps(doc, indent=indent, sort_keys=True)

    def wire_bytes(self) -> bytes:
        """The manifest as it travels: its canonical body, whose SHA-256 is the model id (``from_wire``)."""
        return canonical(self.body())

    @classmethod
    def from_wire(cls, payload: bytes, expect_id: str | None = None) -> "Manifest":
        """A manifest a node sent (``wire_bytes``): pinned to ``expect_id``, its bytes are hashed and compared
        before they are parsed, so a stranger's manifest costs one hash, not a parse; then checked as
        ``from_json`` checks it, and its content must be those very bytes."""
        digest = None
        if expect_id is not None:
            if len(payload) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest of {len(payload)} bytes exceeds the {MAX_MANIFEST_BYTES >> 20} MiB limit")
            digest = sha256(payload).hexdigest()
            if not digest.startswith(expect_id.lower()):
                raise ManifestError(f"model id mismatch: wanted {expect_id}, the seeder serves {digest}")
        m, model_id = cls._parse(payload)
        if digest is not None and model_id != digest:
            raise ManifestError("manifest bytes are not in canonical form: their hash is not the model id they "
                                "describe")
        return m

    @classmethod
    def from_json(cls, text: str | bytes, expect_id: str | None = None) -> "Manifest":
        """Parse and check a manifest (``validate``: every field); ManifestError if it is too large, malformed,
        fails its own hash, or is not ``expect_id``."""
        m, model_id = cls._parse(text)
        if expect_id is not None and not model_id.startswith(expect_id.lower()):
            raise ManifestError(f"model id mismatch: wanted {expect_id}, the seeder serves {model_id}")
        return m

    @classmethod
    def _parse(cls, text: str | bytes) -> tuple["Manifest", str]:
        """The checked manifest in ``text`` and its model id (hashed once: a 1 TB model's takes 0.5 s)."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(text)} bytes exceeds the {MAX_MANIFEST_BYTES >> 20} MiB limit")
        try:
            doc = json.loads(text, object_pairs_hook=_counted(MAX_OBJECTS))
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"malformed manifest: {str(e)[:200]}") from None
        validate.check(doc, MAX_CHUNK_SIZE, VERSION)
        chunk_hasher(doc.get("hash", "xxh3_64"))  # known, and usable here (blake3 needs its package)
        m = cls(total_size=doc["total_size"], chunk_size=doc["chunk_size"], chunks=doc["chunks"],
                files=doc.get("files", []), tensors=doc.get("tensors", []), hash=doc.get("hash", "xxh3_64"),
                version=doc["version"], origin=doc.get("origin"))
        model_id, claimed = m.model_id, doc.get("model_id")
        if claimed is not None and claimed != model_id:
            raise ManifestError(f"manifest fails its own hash: claims model id {str(claimed)[:16]}..., content "
                                f"hashes to {model_id[:16]}...")
        return m, model_id


def _counted(limit: int):
    """A ``json.loads`` object hook that builds each object as ``dict`` and stops the parse past ``limit`` of
    them: a manifest of millions of empty objects costs gigabytes to hold, not to send."""
    left = [limit]

    def hook(pairs):
        left[0] -= 1
        if left[0] < 0:
            raise ValueError(f"more than {limit} objects")
        return dict(pairs)
    return hook


def canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def file_segments(files: list[dict], lo: int, hi: int):
    """Yield (file entry, offset in file, blob lo, blob hi) for each file overlapping blob bytes [lo, hi)."""
    for f in files:
        a, b = max(lo, f["offset"]), min(hi, f["offset"] + f["size"])
        if a < b:
            yield f, a - f["offset"], a, b


def read_manifest(path: str) -> Manifest:
    """The manifest in the file at ``path`` (``p2pw manifest -o``, ``--manifest``), checked by the strict
    validator; P2PError if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return Manifest.from_json(f.read())
    except OSError as e:
        raise P2PError(f"cannot read manifest {path}: {e.strerror}") from None
