"""p2pweights: broadcast model weights to a GPU fleet over a peer-to-peer tree.

``seed(path)`` serves a checkpoint; ``join("host:port")`` attaches a host and
returns a ``Download`` whose ``wait_range`` returns as soon as the bytes a
loader needs are verified.  Importing this package never imports torch.
"""
from .api import DEFAULT_PORT, Download, P2PError, Seeder, join, seed
from .manifest import Manifest

__all__ = ["seed", "join", "Seeder", "Download", "Manifest", "P2PError", "DEFAULT_PORT"]
__version__ = "0.1.0"
