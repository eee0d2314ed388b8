"""Formats: the byte layout of a checkpoint (single file, directory, safetensors shards).

Only headers are read, never tensor data, so a layout of a multi-TB checkpoint
costs one small read per safetensors file.  The *blob* of a checkpoint is its
files concatenated, small non-tensor files first, each group in name order,
each file starting on an ``ALIGN`` boundary (zero padding between files,
none after the last), so every file can be mapped at its blob offset; tensor
offsets from ``layout`` are positions in that blob.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
import stat
import struct
from ..errors import UserError

ALIGN = 4096
MAX_HEADER = 100 << 20
PACKED_SUFFIX = ".p2pw"  # the blob of a packed checkpoint (see pack.py)
PACKED_INDEX_SUFFIX = ".p2pw.json"  # its index: {format, version, align, total_size, tensors}
PACKED_FORMAT = "p2pw-packed"
PACKED_VERSION = 1

# Bytes per element of every whole-byte safetensors dtype.
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "C64": 8,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
# Bits per element of the packed sub-byte dtypes (nbytes rounds up to whole bytes).
SUBBYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


class FormatError(UserError, ValueError):
    """A checkpoint that cannot be read: message names the file and what is wrong."""


def tensor_nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``; KeyError for an unknown dtype."""
    numel = math.prod(shape)
    if dtype in DTYPE_SIZES:
        return numel * DTYPE_SIZES[dtype]
    return (numel * SUBBYTE_BITS[dtype] + 7) // 8


def read_safetensors_header(path) -> tuple[list[dict], int]:
    """Tensors of one .safetensors file and the offset where its data starts.

    Tensors are ``{name, dtype, shape, offset, nbytes}`` sorted by offset, with
    ``offset`` absolute within the file (8 + header length + data_offsets[0]).
    The ``__metadata__`` entry is skipped.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            header_len = safetensors_header_len(f.read(8), file_size, path)
            raw = f.read(header_len)
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from e
    return parse_safetensors_header(raw, file_size, path)


def safetensors_header_len(head: bytes, file_size: int, path) -> int:
    """The header length a safetensors file's first 8 bytes give, checked against its ``file_size``."""
    if len(head) < 8:
        raise FormatError(f"{path}: {file_size} bytes, too short for a safetensors header length (8 bytes)")
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len > MAX_HEADER:
        raise FormatError(f"{path}: header length {header_len} exceeds the {MAX_HEADER} byte limit")
    if 8 + header_len > file_size:
        raise FormatError(f"{path}: header length {header_len} runs past the end of the {file_size} byte file")
    return header_len


def parse_safetensors_header(raw: bytes, file_size: int, path) -> tuple[list[dict], int]:
    """``read_safetensors_header`` for a header already read: ``raw`` is its JSON (after the 8 length bytes)."""
    header_len = len(raw)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is a JSON {type(header).__name__}, expected an object")

    data_start = 8 + header_len
    data_size = file_size - data_start
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise FormatError(f"{where}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_SIZES and dtype not in SUBBYTE_BITS:
            raise FormatError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FormatError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets)):
            raise FormatError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise FormatError(f"{where}: data_offsets [{begin}, {end}] outside the {data_size} data bytes of the file")
        nbytes = tensor_nbytes(dtype, shape)
        if end - begin != nbytes:
            raise FormatError(f"{where}: data_offsets span {end - begin} bytes but {dtype}{shape} needs {nbytes}")
        tensors.append({"name": name, "dtype": dtype, "shape": shape,
                        "offset": data_start + begin, "nbytes": nbytes})
    tensors.sort(key=lambda t: (t["offset"], t["nbytes"], t["name"]))
    return tensors, data_start


def read_packed_index(path) -> tuple[dict, list[dict]]:
    """The index of a packed checkpoint: (its JSON document, tensors ``{name, dtype, shape, offset, nbytes}``).

    Offsets are positions in the packed blob; each is checked to be
    ``align``-aligned, inside the blob and sized for its dtype and shape.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_HEADER + 1)
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from e
    return parse_packed_index(raw, path)


def parse_packed_index(raw: bytes, path) -> tuple[dict, list[dict]]:
    """``read_packed_index`` for an index already read (``raw`` is the file's bytes)."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: packed index is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != PACKED_FORMAT:
        raise FormatError(f"{path}: not a p2pw packed index (format is not {PACKED_FORMAT!r})")
    if doc.get("version") != PACKED_VERSION:
        raise FormatError(f"{path}: packed index version {doc.get('version')!r}, this p2pw reads {PACKED_VERSION}")
    total, align = doc.get("total_size"), doc.get("align")
    if type(total) is not int or type(align) is not int or total < 0 or align <= 0:
        raise FormatError(f"{path}: total_size and align must be non-negative integers")
    if not isinstance(doc.get("tensors", []), list):
        raise FormatError(f"{path}: tensors must be a list")
    tensors = []
    for i, t in enumerate(doc.get("tensors", [])):
        try:
            name, dtype, shape, offset = t["name"], t["dtype"], list(t["shape"]), int(t["offset"])
            nbytes = tensor_nbytes(dtype, shape)
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{path}: tensor #{i} is malformed: {e!r}") from None
        if nbytes != t.get("nbytes") or offset % align or not 0 <= offset <= offset + nbytes <= total:
            raise FormatError(f"{path}: tensor {name!r} at {offset}+{t.get('nbytes')} is misaligned, "
                              f"mis-sized for {dtype}{shape} or outside the {total}-byte blob")
        tensors.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes})
    return doc, tensors


def _check_readable(path: str) -> None:
    if not os.access(path, os.R_OK):
        raise FormatError(f"{path}: not readable (permission denied)")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise FormatError(f"{path}: cannot open: {e.strerror or e}") from e


# skipped at any depth, always (.p2pw/ is what p2pw keeps about a copy: never served); --exclude GLOB skips more
SKIPPED_DIRS = (".git", ".p2pw", ".cache/huggingface")
SMALL_FILE = 64 << 20  # non-tensor files up to this size go first in the blob (config, tokenizer, index JSON)


class Walk:
    """One scan of a checkpoint directory: the files to copy, what was skipped, what cannot be copied."""

    def __init__(self, root: str, exclude=()):
        self.root = root
        self.real = os.path.realpath(root)
        self.exclude = tuple(exclude)
        self.files: list[tuple[str, str, int]] = []
        self.skipped: list[str] = []  # relative names, directories with a trailing '/'
        self.bad: list[str] = []  # 'name (why)' for entries no copy can hold
        self.allowed = [self.real]
        parent = os.path.dirname(self.real)
        if os.path.basename(parent) == "snapshots":  # a Hugging Face cache snapshot links into ../../blobs
            self.allowed.append(os.path.join(os.path.dirname(parent), "blobs"))

    def skips(self, rel: str, is_dir: bool) -> bool:
        if is_dir and any(rel == d or rel.endswith("/" + d) for d in SKIPPED_DIRS):
            return True
        base = rel.rsplit("/", 1)[-1]
        names = (rel, base, rel + "/", base + "/") if is_dir else (rel, base)
        return any(fnmatch.fnmatchcase(n, g) for g in self.exclude for n in names)

    def inside(self, real: str) -> bool:
        return any(real == a or real.startswith(a + os.sep) for a in self.allowed)

    def walk(self, path: str, prefix: str, stack: tuple) -> None:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as e:
            raise FormatError(f"{path}: cannot list directory: {e.strerror or e}") from e
        for entry in entries:
            rel = prefix + entry.name
            try:
                st = os.stat(entry.path)  # follows symlinks
            except OSError as e:
                self.bad.append(f"{rel} (symlink that loops)" if e.errno == errno.ELOOP
                                else f"{rel} (broken symlink)" if entry.is_symlink() else f"{rel} ({e.strerror})")
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            if self.skips(rel, is_dir):
                self.skipped.append(rel + "/" if is_dir else rel)
                continue
            real = os.path.realpath(entry.path)
            if entry.is_symlink() and not self.inside(real):
                self.bad.append(f"{rel} (symlink leaving the tree, to {real})")
            elif is_dir:
                if real in stack:
                    self.bad.append(f"{rel} (symlink that loops, to {real})")
                else:
                    self.walk(entry.path, rel + "/", stack + (real,))
            elif stat.S_ISREG(st.st_mode):
                _check_readable(entry.path)
                self.files.append((rel, os.path.abspath(entry.path), st.st_size))
            else:
                kind = ("fifo" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode)
                        else "device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "special file")
                self.bad.append(f"{rel} ({kind})")


def scan(path, exclude=()) -> Walk:
    """Scan checkpoint ``path``: every file, dot-files included, less SKIPPED_DIRS and ``exclude`` globs.

    A glob matches an entry's relative name ('sub/x.bin', directories also as
    'sub/') or its base name.  Special files, and symlinks that loop or leave
    the tree, are one FormatError naming them.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such file or directory")
    w = Walk(path, exclude)
    if not os.path.isdir(path):
        _check_readable(path)
        w.files.append((os.path.basename(path), os.path.abspath(path), os.path.getsize(path)))
        return w
    w.walk(path, "", (w.real,))
    if w.bad:
        shown = ", ".join(w.bad[:8]) + (f" and {len(w.bad) - 8} more" if len(w.bad) > 8 else "")
        raise FormatError(f"{path}: cannot copy {len(w.bad)} entr{'y' if len(w.bad) == 1 else 'ies'}: {shown}")
    if not w.files:
        raise FormatError(f"{path}: directory holds no checkpoint files")
    w.files.sort(key=lambda f: f[0])
    return w


def checkpoint_files(path, exclude=()) -> list[tuple[str, str, int]]:
    """``(name, absolute path, size)`` of every file of a checkpoint, sorted by name (see ``scan``).

    A file is its own checkpoint (name = basename).  For a directory, names are
    relative with '/' separators.
    """
    return scan(path, exclude).files


def listed(name: str, exclude=()) -> bool:
    """Whether a file at relative ``name`` ('/'-separated) belongs to a checkpoint, by the rules ``scan``
    applies (SKIPPED_DIRS, ``exclude`` globs), for sources listed by name (object stores)."""
    parts = name.split("/")
    if not all(parts):
        return False
    w = Walk("", exclude)
    return not any(w.skips("/".join(parts[:k]), k < len(parts)) for k in range(1, len(parts) + 1))


def goes_first(name: str, size: int) -> bool:
    """Small non-tensor files (config, tokenizer, index JSON...) lead the blob: final within the first chunks."""
    return size <= SMALL_FILE and not name.endswith((".safetensors", PACKED_SUFFIX))


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def layout(path, exclude=()) -> tuple[list[dict], list[dict], int]:
    """The logical blob of a checkpoint: ``(files, tensors, total_size)``.

    ``files`` are ``{name, offset, size}`` with each offset on an ``ALIGN``
    boundary; ``tensors`` are ``{name, dtype, shape, offset, nbytes, file}`` from
    every ``*.safetensors`` file, with ``offset`` in blob coordinates;
    ``total_size`` ends at the last file's last byte (no trailing padding).
    A packed checkpoint's tensors come from its index (``NAME.p2pw.json``
    describing ``NAME.p2pw``), not from reading the blob.
    """
    entries = checkpoint_files(path, exclude)
    full = {name: abspath for name, abspath, _ in entries}
    files, total = blob_files([(name, size) for name, _, size in entries])
    tensors = tensor_index(files, lambda name: read_safetensors_header(full[name])[0],
                           lambda name: read_packed_index(full[name]), where=full.__getitem__)
    return files, tensors, total


def blob_files(entries) -> tuple[list[dict], int]:
    """The file table of a checkpoint's ``(name, size)`` pairs and the blob size: the one layout rule
    (small non-tensor files first, then the rest, each group in name order, each file on an ``ALIGN``
    boundary), whatever the files came from (disk, object store)."""
    files, end = [], 0
    for name, size in sorted(entries, key=lambda e: (not goes_first(*e), e[0])):
        offset = align_up(end)
        files.append({"name": name, "offset": offset, "size": size})
        end = offset + size
    return files, end


def is_indexed(name: str) -> bool:
    """Whether file ``name`` holds tensor index bytes (a safetensors header, a packed index)."""
    return name.endswith(".safetensors") or name.endswith(PACKED_INDEX_SUFFIX)


def tensor_index(files: list[dict], header_of, index_of, where=str) -> list[dict]:
    """Tensors in blob coordinates, from ``header_of(name)`` (a safetensors file's tensors)
    and ``index_of(name)`` (a packed index's ``(doc, tensors)``); ``where(name)`` names a file in errors."""
    tensors, seen = [], {}
    starts = {f["name"]: f["offset"] for f in files}
    sizes = {f["name"]: f["size"] for f in files}
    for f in files:
        name, offset = f["name"], f["offset"]
        if name.endswith(PACKED_INDEX_SUFFIX):
            blob, packed = index_of(name)
            blob_name = name[: -len(PACKED_INDEX_SUFFIX)] + PACKED_SUFFIX
            if blob_name not in starts:
                raise FormatError(f"{where(name)}: packed index without its blob {blob_name}")
            if blob["total_size"] != sizes[blob_name]:
                raise FormatError(f"{where(name)}: index says the blob has {blob['total_size']} bytes, "
                                  f"{blob_name} has {sizes[blob_name]}")
            for t in packed:
                if t["name"] in seen:
                    raise FormatError(f"{where(name)}: tensor {t['name']!r} also appears in {seen[t['name']]}")
                seen[t["name"]] = blob_name
                tensors.append({**t, "offset": starts[blob_name] + t["offset"], "file": blob_name})
            continue
        if not name.endswith(".safetensors"):
            continue
        for t in header_of(name):
            if t["name"] in seen:
                raise FormatError(f"{where(name)}: tensor {t['name']!r} also appears in {seen[t['name']]}")
            seen[t["name"]] = name
            tensors.append({**t, "offset": offset + t["offset"], "file": name})
    return tensors
