"""p2pweights: broadcast model weights to a GPU fleet over a peer-to-peer tree.

``seed(path)`` serves a checkpoint; ``join("host:port")`` attaches a host and
returns a ``Download`` whose ``wait_range`` returns as soon as the bytes a
loader needs are verified.  Importing this package never imports torch, and
imports the library itself (numpy, zmq) only when one of these names is first
used, so the CLI starts fast.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"seed": "api", "join": "api", "Seeder": "api", "Download": "api", "P2PError": "errors",
            "DEFAULT_PORT": "api", "Manifest": "sources.manifest"}

__all__ = ["seed", "join", "Seeder", "Download", "Manifest", "P2PError", "DEFAULT_PORT"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
