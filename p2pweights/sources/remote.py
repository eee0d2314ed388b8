"""Remote origins by URL scheme: which reader a checkpoint's URL opens (``s3://``, ``http(s)://``).

Each reader has ``S3Checkpoint``'s interface (``files``, ``build``, ``check``, ``source``); its client is
imported only when a URL of its scheme is opened."""
from __future__ import annotations


SCHEMES = ("s3://", "http://", "https://")  # each reader's own module is imported only when it is opened


def is_remote(path) -> bool:
    """Whether ``path`` names a checkpoint read over the network rather than local files."""
    return isinstance(path, str) and path.startswith(SCHEMES)


def checkpoint(url: str, concurrency: int, range_size: int):
    """The reader of the checkpoint at remote ``url`` (listed here)."""
    from .httpstore import HttpCheckpoint, is_http
    from .objstore import S3Checkpoint

    return (HttpCheckpoint if is_http(url) else S3Checkpoint)(url, concurrency, range_size)
