"""Forgery: test-only fault injection of a parent that serves forged chunks; never active by default.

``P2PW_FAULT_FORGE=I[,J...]`` in a node's environment makes it send a forged
copy of chunks I, J... the first time it sends each (its store stays intact,
so a child that drops the forgery and asks again gets the true bytes).

The forgery keeps the chunk's xxh3_64 unchanged when the chunk was prepared
for it with ``prepare``: xxh3 adds each 8-byte input lane to one accumulator
and the product of the halves of (lane XOR secret) to another, so two lanes
whose low halves equal the secret's contribute nothing to the product and
only their sum to the other accumulator.  Moving 2**32 from one such lane to
the other is then an xxh3 collision.  xxh3 is a checksum against corruption,
not a defence against a peer that forges on purpose; sha256 or blake3 chunk
hashes are (docs/security.md).
"""
from __future__ import annotations

import logging
import os
import struct

log = logging.getLogger("p2pw")

ENV = "P2PW_FAULT_FORGE"
# Low 32 bits of the first two 8-byte words of XXH3's default secret (kSecret).
_KEY_LO = (0x39_6C_FE_B8, 0x2C_81_01_7C)
_LANES = (0, 64)  # lane 0 of stripes 0 and 1: secret words 0 and 1
_LANE = struct.Struct("<Q")


def prepare(data: bytearray) -> None:
    """Set two lanes of ``data`` (at least 1088 bytes, a chunk's start) so that ``forge`` keeps its xxh3_64."""
    for offset, lo in zip(_LANES, _KEY_LO):
        hi = _LANE.unpack_from(data, offset)[0] >> 32
        _LANE.pack_into(data, offset, (hi << 32) | lo)


def forge(data) -> bytearray:
    """A copy of ``data`` with different bytes and, if it was ``prepare``d, the same xxh3_64."""
    out = bytearray(data)
    a, b = (_LANE.unpack_from(out, o)[0] for o in _LANES)
    _LANE.pack_into(out, _LANES[0], (a + (1 << 32)) % (1 << 64))
    _LANE.pack_into(out, _LANES[1], (b - (1 << 32)) % (1 << 64))
    return out


class Forger:
    """Which chunks to forge, each once."""

    def __init__(self, indices):
        self.pending = set(indices)

    def outgoing(self, index: int, data):
        if index in self.pending and len(data) >= 1088:
            self.pending.discard(index)
            log.warning("fault injection: sending a forged chunk %d", index)
            return forge(data)
        return data


def from_env() -> Forger | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    try:
        indices = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad {ENV}={spec!r}: expected chunk indices like 0,3") from None
    log.warning("fault injection is ON (%s=%s): this node forges chunks", ENV, spec)
    return Forger(indices)
