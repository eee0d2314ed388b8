"""Remote origins by URL scheme: which reader a checkpoint's URL opens (``s3://``, ``http(s)://``).

Each reader has ``S3Checkpoint``'s interface (``files``, ``build``, ``check``, ``source``); its client is
imported only when a URL of its scheme is opened."""
from __future__ import annotations


def is_remote(path) -> bool:
    """Whether ``path`` names a checkpoint read over the network rather than local files."""
    from .httpstore import is_http
    from .objstore import is_s3

    return is_s3(path) or is_http(path)


def checkpoint(url: str, concurrency: int, range_size: int):
    """The reader of the checkpoint at remote ``url`` (listed here)."""
    from .httpstore import HttpCheckpoint, is_http
    from .objstore import S3Checkpoint

    return (HttpCheckpoint if is_http(url) else S3Checkpoint)(url, concurrency, range_size)
