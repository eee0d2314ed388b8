"""Sizes: the one syntax of a size a user gives (``--cache-size``, ``--memory-budget``, ``P2PW_CACHE_SIZE``)."""
from __future__ import annotations

import re

from ..errors import UserError

UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
         "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """'100GiB', '512M', '1048576' -> bytes; UserError otherwise."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in UNITS:
        raise UserError(f"bad size {text!r}: use e.g. 100GiB, 512M, 1048576")
    return int(float(m.group(1)) * UNITS[m.group(2).upper()])
