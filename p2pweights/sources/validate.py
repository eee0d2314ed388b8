"""Validate: the one strict check of a manifest document, whatever it came from (wire, file, catalog, cache).

A manifest names files a join will create, offsets a store will map and
tensors a loader will view, so every field is hostile until this module has
checked it: types, a closed set of keys, hashes of their algorithm's length,
file names that stay inside the copy (relative, no empty, ``.``, ``..`` or
NUL parts, nothing under ``.p2pw/``, unique, no file inside another), files
inside the blob on the layout's alignment and not overlapping, tensors inside
their files, and ``origin`` fields of a Hugging Face repo's shapes.  Pure:
no I/O, a document in, ``ManifestError`` (naming the field) or nothing out.
"""
from __future__ import annotations

import re

from ..errors import UserError
from .formats import ALIGN, DTYPE_SIZES, SUBBYTE_BITS, tensor_nbytes

STATE_DIR = ".p2pw"  # a copy's own state folder (storage.cache): no manifest file may live there
DIGEST_HEX = {"xxh3_64": 16, "sha256": 64, "blake2b": 128, "blake3": 64}
TOP_KEYS = {"version", "total_size", "chunk_size", "hash", "chunks", "files", "tensors", "origin", "model_id"}
FILE_KEYS = {"name", "offset", "size", "etag"}
TENSOR_KEYS = {"name", "dtype", "shape", "offset", "nbytes", "file"}
ORIGIN_KEYS = {"repo", "commit", "revision"}
MAX_PATH = 4096  # bytes of a file name, as Linux's PATH_MAX
MAX_PART = 255  # bytes of one path component, as Linux's NAME_MAX
MAX_TENSOR_NAME = 1024
MAX_DIMS = 64
REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
REVISION_PART = re.compile(r"[\w.-]{1,255}")
COMMIT = re.compile(r"[0-9a-f]{40}")
ETAG = re.compile(r"[\w.-]{1,255}")  # names a blob file in a Hugging Face cache: one plain path component
HEX = re.compile(r"[0-9a-f]+")


class ManifestError(UserError, ValueError):
    """A manifest that cannot be trusted or used: the message says why."""


def _fail(why: str):
    raise ManifestError(f"malformed manifest: {why}")


def _int(value, what: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        _fail(f"{what} is {str(value)[:40]!r}, not an integer >= {low}")
    return value


def _keys(doc, allowed: set, what: str, required=()) -> None:
    if not isinstance(doc, dict):
        _fail(f"{what} is {type(doc).__name__}, not an object")
    extra = set(doc) - allowed
    if extra:
        _fail(f"{what} has unknown field(s) {', '.join(sorted(map(str, extra)))[:100]}")
    missing = [k for k in required if k not in doc]
    if missing:
        _fail(f"{what} lacks {', '.join(missing)}")


def check_name(name) -> str:
    """A file name of a manifest, as a copy will create it under its root: ManifestError unless it is a
    relative '/'-separated path of plain components (no empty, '.', '..' or NUL part), not under ``.p2pw/``."""
    if not isinstance(name, str) or not name:
        _fail(f"file name {str(name)[:80]!r} is not a non-empty string")
    shown = repr(name[:80])
    if "\0" in name or len(name.encode("utf-8", "surrogatepass")) > MAX_PATH:
        _fail(f"file name {shown} has a NUL byte or is longer than {MAX_PATH} bytes")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        _fail(f"file name {shown} is not a plain relative path (an empty, '.' or '..' part, or a leading '/')")
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_PART for p in parts):
        _fail(f"file name {shown} has a part longer than {MAX_PART} bytes")
    if parts[0] == STATE_DIR:
        _fail(f"file name {shown} is inside {STATE_DIR}/, which p2pw keeps for itself")
    return name


def check_files(files, total: int) -> None:
    """The file table: each ``{name, offset, size[, etag]}`` inside the blob, on ``ALIGN``, in offset order and
    not overlapping, names unique and no file inside another (``a`` beside ``a/b``)."""
    if not isinstance(files, list):
        _fail("files is not a list")
    names, end = set(), 0
    for f in files:
        _keys(f, FILE_KEYS, "a file entry", required=("name", "offset", "size"))
        name = check_name(f["name"])
        offset, size = _int(f["offset"], f"{name}'s offset"), _int(f["size"], f"{name}'s size")
        if offset % ALIGN:
            _fail(f"{name} starts at {offset}, not on the layout's {ALIGN}-byte alignment")
        if offset < end:
            _fail(f"{name} at {offset} overlaps the file before it (which ends at {end})")
        end = offset + size
        if end > total:
            _fail(f"{name} ends at {end}, past the blob's {total} bytes")
        if "etag" in f and not (isinstance(f["etag"], str) and ETAG.fullmatch(f["etag"])
                                and f["etag"] not in (".", "..")):
            _fail(f"{name}'s etag {str(f['etag'])[:80]!r} is not a plain name")
        if name in names:
            _fail(f"two files are named {name!r}")
        names.add(name)
    folders = {"/".join(p[:i]) for p in (n.split("/") for n in names) for i in range(1, len(p))}
    clash = names & folders
    if clash:
        _fail(f"{sorted(clash)[0]!r} is both a file and the folder of another file")


def check_tensors(tensors, files: list[dict], total: int) -> None:
    """The tensor index: each ``{name, dtype, shape, offset, nbytes[, file]}`` typed, sized by its dtype and
    shape, inside the blob and inside its file; names unique."""
    if not isinstance(tensors, list):
        _fail("tensors is not a list")
    spans = {f["name"]: (f["offset"], f["offset"] + f["size"]) for f in files}
    seen = set()
    for t in tensors:
        _keys(t, TENSOR_KEYS, "a tensor entry", required=("name", "dtype", "shape", "offset", "nbytes"))
        name, dtype, shape = t["name"], t["dtype"], t["shape"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TENSOR_NAME:
            _fail(f"tensor name {str(name)[:80]!r} is not a string of 1 to {MAX_TENSOR_NAME} characters")
        if name in seen:
            _fail(f"two tensors are named {name[:80]!r}")
        seen.add(name)
        if dtype not in DTYPE_SIZES and dtype not in SUBBYTE_BITS:
            _fail(f"tensor {name[:80]!r} has unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            _fail(f"tensor {name[:80]!r}'s shape is not a list of at most {MAX_DIMS} sizes")
        for n in shape:
            _int(n, f"tensor {name[:80]!r}'s shape")
        lo, nbytes = _int(t["offset"], f"tensor {name[:80]!r}'s offset"), _int(t["nbytes"], f"{name[:80]!r}'s nbytes")
        if nbytes != tensor_nbytes(dtype, shape):
            _fail(f"tensor {name[:80]!r} is {nbytes} bytes, but {dtype}{shape} needs {tensor_nbytes(dtype, shape)}")
        a, b = (0, total) if "file" not in t else spans.get(t["file"], (None, None))
        if a is None:
            _fail(f"tensor {name[:80]!r} names file {str(t['file'])[:80]!r}, which the manifest does not list")
        if not a <= lo <= lo + nbytes <= b:
            _fail(f"tensor {name[:80]!r} at {lo}+{nbytes} lies outside its file or the blob")


def check_origin(origin) -> None:
    """``origin``: ``{repo: ORG/NAME, commit: 40 hex, revision?: a ref name}`` of a Hugging Face snapshot."""
    _keys(origin, ORIGIN_KEYS, "origin", required=("repo", "commit"))
    repo, commit = origin["repo"], origin["commit"]
    if not isinstance(repo, str) or not REPO.fullmatch(repo) or ".." in repo:
        _fail(f"origin repo {str(repo)[:100]!r} is not ORG/NAME")
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        _fail(f"origin commit {str(commit)[:100]!r} is not a 40-digit commit hash")
    rev = origin.get("revision", "x")
    if not isinstance(rev, str) or len(rev) > MAX_PATH or not all(
            REVISION_PART.fullmatch(p) and p not in (".", "..") for p in rev.split("/")):
        _fail(f"origin revision {str(rev)[:100]!r} is not a branch or tag name")


def check_chunks(chunks, hash_name: str, n: int) -> None:
    """``n`` chunk hashes, each lower-case hex of ``hash_name``'s digest length."""
    if not isinstance(chunks, list):
        _fail("chunks is not a list")
    if len(chunks) != n:
        _fail(f"it lists {len(chunks)} chunk hashes but its size needs {n}")
    digits = DIGEST_HEX[hash_name]
    for h in chunks:
        if not (isinstance(h, str) and len(h) == digits and HEX.fullmatch(h)):
            _fail(f"chunk hash {str(h)[:80]!r} is not {digits} lower-case hex digits of {hash_name}")


def check(doc, max_chunk_size: int, version: int) -> None:
    """ManifestError unless ``doc`` (a parsed manifest) is well formed in every field."""
    _keys(doc, TOP_KEYS, "the manifest", required=("version", "total_size", "chunk_size", "chunks"))
    if doc["version"] != version or type(doc["version"]) is not int:
        raise ManifestError(f"manifest version {str(doc['version'])[:20]} is not supported (this p2pw reads {version})")
    total, size = _int(doc["total_size"], "total_size"), _int(doc["chunk_size"], "chunk_size", low=1)
    if size > max_chunk_size:
        raise ManifestError(f"manifest chunk size {size} exceeds the {max_chunk_size >> 20} MiB limit")
    hash_name = doc.get("hash", "xxh3_64")
    if hash_name not in DIGEST_HEX:
        raise ManifestError(f"unknown chunk hash {str(hash_name)[:40]!r} (known: {', '.join(DIGEST_HEX)})")
    check_chunks(doc["chunks"], hash_name, -(-total // size))
    files = doc.get("files", [])
    check_files(files, total)
    check_tensors(doc.get("tensors", []), files, total)
    if "origin" in doc:
        check_origin(doc["origin"])
