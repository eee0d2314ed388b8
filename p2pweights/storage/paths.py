"""Paths: where a copy may write, checked to stay inside its root after resolving symlinks.

A manifest's names passed ``sources.validate`` (relative, no '..'), but a
folder on the way may be a symlink that someone placed there; every path a
join or the cache writes is resolved and must still lie under the root.
"""
from __future__ import annotations

import os

from ..errors import UserError


class PathError(UserError, ValueError):
    """A path a manifest names that would land outside the folder p2pw writes into."""


def inside(root: str, relative: str) -> str:
    """``root/relative`` (``relative`` '/'-separated), absolute; PathError if it escapes ``root`` once the
    symlinks of its existing folders are resolved."""
    root = os.path.abspath(root)
    path = os.path.normpath(os.path.join(root, *relative.split("/")))
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.dirname(path))
    if not (path.startswith(root + os.sep) and (real == real_root or real.startswith(real_root + os.sep))):
        raise PathError(f"{relative!r} escapes {root} (a '..' or a symlink on the way)")
    return path
