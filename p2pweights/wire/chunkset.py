"""Sets of chunks as Python ints, bit i for chunk i: what a peer holds, what a partner holds,
what is in flight.

Each set operation is one C call on the int, cheaper than numpy's per-call cost at the sizes
of a blob's chunk count, and a joiner need not import numpy.
"""
from __future__ import annotations

_ASCII_BITS = bytes.maketrans(b"\x00\x01", b"01")


def bitset(flags) -> int:
    """The bitset of a sequence of truth values (a bytearray or array of 0/1, a list of bools), or an int."""
    if isinstance(flags, int):
        return flags
    raw = bytes(bytearray(map(bool, flags))) if isinstance(flags, (list, tuple)) else bytes(flags)
    return int(raw[::-1].translate(_ASCII_BITS), 2) if raw else 0


def bitset_of(indices) -> int:
    """The bitset of chunk ``indices``."""
    bits = 0
    for i in indices:
        bits |= 1 << i
    return bits


def indices_of(bits: int) -> list[int]:
    """The chunks in ``bits``, lowest first."""
    text = bin(bits)[:1:-1]  # lowest bit first
    out, i = [], text.find("1")
    while i >= 0:
        out.append(i)
        i = text.find("1", i + 1)
    return out


def lowest_of(bits: int, k: int) -> list[int]:
    """The lowest ``k`` chunks in ``bits``."""
    out = []
    while bits and len(out) < k:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def stripe_mask(n: int, stripes: int, s: int) -> int:
    """The bitset of stripe ``s``: chunks i < ``n`` with i mod ``stripes`` == ``s``."""
    unit = "".join("1" if j == s else "0" for j in range(stripes))  # lowest bit first
    text = (unit * (n // stripes + 1))[:n]
    return int(text[::-1], 2) if text else 0

