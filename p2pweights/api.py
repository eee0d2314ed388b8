"""API: the library surface: ``seed(...) -> Seeder`` and ``join(...) -> Download``.

Both run a node's event loop in a background thread of the calling process and
return a handle.  A ``Download`` is usable while it downloads: ``wait_range``
returns as soon as the chunks covering a byte range are verified.  Errors are
never hidden: a failed download raises ``P2PError`` from every wait.  The parts
live in ``library/``: seeding, downloading, local copies, the handshake.
"""
from __future__ import annotations

from .errors import P2PError
from .library.copies import local_copy  # noqa: F401
from .library.download import Download, join  # noqa: F401
from .library.handshake import DEFAULT_PORT, MAX_STATUS_BYTES, local_ip_towards, parse_addr, status  # noqa: F401
from .library.seeding import DEFAULT_PLAN, Seeder, seed  # noqa: F401
from .storage.localcopy import Attached, WriterGone, attach  # noqa: F401

__all__ = ["Attached", "DEFAULT_PLAN", "DEFAULT_PORT", "Download", "MAX_STATUS_BYTES", "P2PError", "Seeder",
           "WriterGone", "attach", "join", "local_copy", "local_ip_towards", "parse_addr", "seed", "status"]
