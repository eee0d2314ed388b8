"""Paths: where a copy may write, checked to stay inside its root after resolving symlinks.

A manifest's names passed ``sources.validate`` (relative, no '..'), but a
folder on the way may be a symlink that someone placed there; every path a
join or the cache writes is resolved and must still lie under the root.
What p2pw keeps about a copy (``StateDir``: ``.p2pw/``) is opened relative to
the root's fd with no link followed.
"""
from __future__ import annotations

import errno
import os

from ..errors import UserError
from ..sources.validate import STATE_DIR


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


def write_text(fd: int, text: str, durable: bool = False) -> None:
    """Write ``text`` to the new file open at ``fd`` (fsynced when ``durable``), mode 0644, and close it: the
    one way an atomic write (a temporary name, then a rename) fills its file."""
    with os.fdopen(fd, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
        os.fchmod(f.fileno(), 0o644)


class StateDir:
    """A copy's ``.p2pw`` folder, opened relative to an fd of its resolved root without following a link
    (``O_NOFOLLOW | O_DIRECTORY``), as is every file in it: a planted symlink (the folder, or a file in it)
    is one PathError, and nothing outside the root is written or deleted through it.  Made if missing, root
    too (``create``); closed by ``close`` or ``with``."""

    def __init__(self, root: str, create: bool = True):
        self.root = os.path.realpath(root)
        self.path = os.path.join(self.root, STATE_DIR)
        if create:
            os.makedirs(self.root, exist_ok=True)
        rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if create:
                try:
                    os.mkdir(STATE_DIR, 0o755, dir_fd=rfd)
                except FileExistsError:
                    pass
            self.fd = os.open(STATE_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise PathError(f"{self.path} is a symlink or not a folder: p2pw keeps a copy's state there and "
                                f"follows no link out of {self.root} (remove it)") from None
            raise
        finally:
            os.close(rfd)

    def _refused(self, name: str, e: OSError):
        if e.errno == errno.ELOOP:
            return PathError(f"{self.path}/{name} is a symlink: p2pw follows no link out of {self.root} (remove it)")
        return e

    def open(self, name: str, flags: int, mode: int = 0o644) -> int:
        """An fd of ``name`` in the folder (``flags`` as ``os.open``'s; a link is refused)."""
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)
        except OSError as e:
            raise self._refused(name, e) from None

    def read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or None if it is missing, a link or unreadable."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def write(self, name: str, text: str, durable: bool = False) -> None:
        """Write ``text`` to ``name`` by rename from a temporary name of its own (fsynced, folder too, when
        ``durable``): a link under ``name`` is replaced, never written through."""
        for _ in range(100):
            tmp = f".{name}.{os.urandom(6).hex()}.tmp"
            try:
                fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"no unused temporary name in {self.path}")
        try:
            write_text(fd, text, durable)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.remove(tmp)
            raise
        if durable:
            os.fsync(self.fd)

    def remove(self, name: str) -> None:
        """Unlink ``name`` (a link is unlinked itself); missing is fine."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def inode(self, name: str) -> int | None:
        """``name``'s inode (a link's own), or None if missing."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_state(root: str, name: str) -> bytes | None:
    """The bytes of ``root/.p2pw/name``, or None (missing, a link on the way, unreadable)."""
    try:
        with StateDir(root, create=False) as d:
            return d.read(name)
    except (OSError, PathError):
        return None
