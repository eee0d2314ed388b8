"""Read-back: a verified chunk the ring no longer holds, read from the copy's files into a send buffer.

A join writes its files around the page cache (``O_DIRECT``), so a chunk it
serves after its ring slot was reused is on disk only.  Sent from the
store's mapping, its pages were faulted in, and read from disk, inside
libzmq's I/O thread, one 4 KiB page at a time.  Here it is read by explicit
``O_DIRECT`` reads on the 4 KiB grid into a page-aligned buffer (a ring
slot), from fds opened for reading once, at the start, so a file renamed
final meanwhile reads the same.  Only verified chunks are ever asked for:
the loop serves nothing else.
"""
from __future__ import annotations

import os

DIRECT_ALIGN = 4096  # O_DIRECT: memory, file offset and length on this grid (every block size in use divides it)


class ChunkReads:
    """``paths`` (the copy's files, in the manifest's order) open for ``O_DIRECT`` reads; ``read`` fills a buffer
    with a chunk's bytes.  ``chunk_files[c]``: the files chunk ``c`` covers."""

    def __init__(self, manifest, paths: list[str], chunk_files):
        self.manifest, self.chunk_files = manifest, chunk_files
        self.fds: list[int] = []
        try:
            for p in paths:
                self.fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            self.close()
            raise

    def read(self, index: int, into) -> None:
        """Chunk ``index``'s bytes into ``into`` (page-aligned, at least the chunk's size rounded up to the 4 KiB
        grid: a file's last page is read whole); the padding between files as zeros.  OSError if a read fails
        or a file is shorter than the manifest says."""
        if not self.fds:
            raise OSError("the copy's files are closed")
        m = self.manifest
        lo, hi = m.chunk_span(index)
        at = lo  # blob offset of the next byte of ``into`` not yet filled
        for i in self.chunk_files[index]:
            o, size = m.files[i]["offset"], m.files[i]["size"]
            a, b = max(lo, o), min(hi, o + size)
            if b <= a:
                continue
            into[at - lo:a - lo] = bytes(a - at)  # padding before this file's bytes
            self._pread(self.fds[i], into[a - lo:a - lo + -(-(b - a) // DIRECT_ALIGN) * DIRECT_ALIGN], a - o, b - a)
            at = b
        into[at - lo:hi - lo] = bytes(hi - at)

    @staticmethod
    def _pread(fd: int, view, offset: int, want: int) -> None:
        got = 0
        while got < want:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise OSError(f"a file of the copy ended {want - got} bytes early")
            got += n

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
