"""Pack: rewrite a safetensors checkpoint into the loading-optimised layout, and back.

A packed checkpoint is a directory holding ``model.p2pw`` (one blob: every
tensor in forward-pass order, each starting on a 4 KiB boundary, zero padding
between) and ``model.p2pw.json`` (the index: name, dtype, shape, offset,
nbytes per tensor), plus the source's non-tensor files (config, tokenizer)
copied as they are.  Because the blob starts on a 4 KiB boundary of the
broadcast blob too, every tensor of a packed checkpoint is page-aligned on
the receiving host, so loading it is views only.  No torch here.
"""
from __future__ import annotations

import json
import os
import re
import shutil

from .formats import (ALIGN, PACKED_FORMAT, PACKED_INDEX_SUFFIX, PACKED_SUFFIX, PACKED_VERSION, FormatError,
                      align_up, checkpoint_files, read_packed_index, read_safetensors_header)

BLOB = "model" + PACKED_SUFFIX
INDEX = "model" + PACKED_INDEX_SUFFIX
COPY_STEP = 64 << 20
SHARD_INDEX = re.compile(r"(^|/)[^/]*\.safetensors\.index\.json$")  # names shards that packing removes
LAYER = re.compile(r"\.(?:layers?|h|blocks?)\.(\d+)\.")
HEAD = re.compile(r"(^|\.)(lm_head|head|output|classifier|score)\.")
EMBED = re.compile(r"(embed|wte|wpe|tok_embeddings|word_embeddings|position_embeddings)")


def forward_key(name: str, position: int) -> tuple:
    """Sort key for forward-pass order: embeddings, layers 0, 1, ... (numerically), other (final norm), head.

    ``position`` (the tensor's place in its source) breaks ties, so a layer
    keeps the order its file had.
    """
    layer = LAYER.search("." + name)
    if layer:
        return (1, int(layer.group(1)), position)
    if HEAD.search(name):
        return (3, 0, position)
    if EMBED.search(name):
        return (0, 0, position)
    return (2, 0, position)


def pack(src, dst) -> dict:
    """Write the packed form of checkpoint ``src`` (safetensors file or directory) into directory ``dst``.

    Returns the index document.  FormatError if ``src`` has no safetensors
    tensors or ``dst`` already holds a packed checkpoint.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    entries = checkpoint_files(src)
    tensors = []
    for name, abspath, _ in entries:
        if name.endswith(".safetensors"):
            tensors += [(t, abspath) for t in read_safetensors_header(abspath)[0]]
    if not tensors:
        raise FormatError(f"{src}: no safetensors tensors to pack")
    names = [t["name"] for t, _ in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise FormatError(f"{src}: tensor {dup!r} appears in more than one file")
    order = sorted(range(len(tensors)), key=lambda i: forward_key(tensors[i][0]["name"], i))
    os.makedirs(dst, exist_ok=True)
    if os.path.exists(os.path.join(dst, INDEX)):
        raise FormatError(f"{dst}: already holds a packed checkpoint ({INDEX})")
    index, offset = [], 0
    for i in order:
        t = tensors[i][0]
        index.append({"name": t["name"], "dtype": t["dtype"], "shape": t["shape"], "offset": offset,
                      "nbytes": t["nbytes"]})
        offset = align_up(offset + t["nbytes"])
    total = index[-1]["offset"] + index[-1]["nbytes"]
    fds: dict[str, int] = {}
    blob_path = os.path.join(dst, BLOB)
    try:
        with open(blob_path + ".partial", "wb") as out:
            out.truncate(total)
            for i, entry in zip(order, index):
                t, abspath = tensors[i]
                if abspath not in fds:
                    fds[abspath] = os.open(abspath, os.O_RDONLY)
                fd = fds[abspath]
                _copy_range(fd, t["offset"], out.fileno(), entry["offset"], t["nbytes"])
            out.flush()
            os.fsync(out.fileno())
    finally:
        for fd in fds.values():
            os.close(fd)
    doc = {"format": PACKED_FORMAT, "version": PACKED_VERSION, "align": ALIGN, "total_size": total,
           "tensors": index}
    with open(os.path.join(dst, INDEX), "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(blob_path + ".partial", blob_path)
    for name, abspath, _ in entries:  # config, tokenizer, ...: as they are
        if name.endswith(".safetensors") or SHARD_INDEX.search(name):
            continue
        target = os.path.join(dst, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(abspath, target)
    return doc


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    done = 0
    while done < n:
        data = os.pread(src_fd, min(COPY_STEP, n - done), src_off + done)
        if not data:
            raise FormatError(f"source file ended {n - done} bytes early while packing")
        os.pwrite(dst_fd, data, dst_off + done)
        done += len(data)


def unpack(src, dst_file) -> int:
    """Write packed checkpoint directory ``src`` back to one safetensors file; returns the tensor count."""
    from .synth import _header  # the safetensors header writer

    index_path = os.path.join(os.fspath(src), INDEX)
    _, tensors = read_packed_index(index_path)
    fd = os.open(os.path.join(os.fspath(src), BLOB), os.O_RDONLY)
    try:
        with open(dst_file, "wb") as out:
            header = _header([(t["name"], t["dtype"], t["shape"]) for t in tensors], {"format": "pt"})
            out.write(header)
            out.flush()
            pos = len(header)
            for t in tensors:
                _copy_range(fd, t["offset"], out.fileno(), pos, t["nbytes"])
                pos += t["nbytes"]
    finally:
        os.close(fd)
    return len(tensors)
