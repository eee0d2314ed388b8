"""HTTP(S) origin: a checkpoint on any web server, read with parallel ranged GETs.

A URL names one file (``https://host/m/model.safetensors``) or, ending in
``/``, a folder whose listing the server gives as JSON (nginx's
``autoindex on; autoindex_format json;``: ``[{"name", "type", "size"}...]``,
its plain files taken, sub-folders not).  Each file's size and validator come
from HEAD (``Content-Length``; ``ETag``, else ``Last-Modified``), recorded in
the manifest as the file's ``etag``.  Every GET is ``Range: bytes=a-b`` with
``If-Range: <validator>``: a file changed since answers 200 (the whole new
file) instead of 206, and is refused (``ObjectChanged``), never mixed.  Reads
go through ``objstore.S3Source`` (the client is the part that differs) with the
same retry bounds (``objstore.Retry``).  Stdlib only (``http.client``).
"""
from __future__ import annotations

import email.utils
import http.client
import json
import logging
import ssl
import threading
import urllib.parse
from typing import Callable

from . import formats
from .objstore import (DEFAULT_CONCURRENCY, DEFAULT_RANGE_SIZE, READ_STEP, NoSuchObject, ObjectChanged,
                       ObjectStoreError, Retry, RetriesSpent, S3Checkpoint, S3Source)
from .validate import ETAG

log = logging.getLogger("p2pw")

SCHEMES = ("http://", "https://")
TIMEOUT = 60.0  # seconds a connection may stay silent
LAST_MODIFIED = "mtime-"  # a recorded validator that is a Last-Modified date (seconds since the epoch)


def is_http(path) -> bool:
    """Whether ``path`` names a checkpoint on a web server."""
    return isinstance(path, str) and path.startswith(SCHEMES)


def validator(etag: str | None, last_modified: str | None) -> str | None:
    """What the manifest records for a file (a plain name, as for S3): its strong ETag unquoted, else
    ``mtime-SECONDS`` from Last-Modified, else None.  A weak ETag cannot guard a range (If-Range)."""
    if etag and not etag.startswith("W/") and ETAG.fullmatch(etag.strip('"')):
        return etag.strip('"')
    if last_modified:
        try:
            return f"{LAST_MODIFIED}{int(email.utils.parsedate_to_datetime(last_modified).timestamp())}"
        except (TypeError, ValueError):
            pass
    return None


def if_range(recorded: str) -> str:
    """The If-Range header for a recorded validator (``validator``)."""
    if recorded.startswith(LAST_MODIFIED) and recorded[len(LAST_MODIFIED):].isdigit():
        return email.utils.formatdate(int(recorded[len(LAST_MODIFIED):]), usegmt=True)
    return f'"{recorded}"'


class _Transient(Exception):
    """A response worth trying again (5xx, 429, a body cut short)."""


class Http:
    """Ranged reads from one server: a connection per reading thread, the retry policy, the errors users see.
    The interface ``objstore.S3Source`` reads through (``read``, ``bytes_read``, ``retries``)."""

    def __init__(self, base: str, retry: Retry | None = None):
        u = urllib.parse.urlsplit(base)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ObjectStoreError(f"bad origin URL {base!r}: expected http(s)://HOST/PATH")
        self.https, self.netloc = u.scheme == "https", u.netloc
        self.host, self.port = u.hostname, u.port
        self.origin = f"{u.scheme}://{u.netloc}"
        self.retry = retry or Retry()
        self.local = threading.local()
        self.lock = threading.Lock()
        self.retries = 0
        self.bytes_read = 0

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self.local, "conn", None)
        if c is None:
            c = (http.client.HTTPSConnection(self.host, self.port, timeout=TIMEOUT,
                                             context=ssl.create_default_context()) if self.https
                 else http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT))
            self.local.conn = c
        return c

    def _drop(self) -> None:
        c = getattr(self.local, "conn", None)
        self.local.conn = None
        if c is not None:
            c.close()

    def _status(self, r, what: str, ok: tuple[int, ...]) -> None:
        """Raise the user-facing error for a response that is not ``ok``, or _Transient."""
        if r.status in ok:
            return
        if r.status >= 500 or r.status in (408, 429):
            raise _Transient(f"HTTP {r.status} {r.reason}")
        if r.status == 404:
            raise NoSuchObject(f"{what}: no such file (HTTP 404)")
        if r.status in (401, 403):
            raise ObjectStoreError(f"{what}: access denied (HTTP {r.status})")
        if r.status == 412:
            raise ObjectChanged(f"{what} changed: its validator is no longer the one recorded in the manifest")
        raise ObjectStoreError(f"{what}: HTTP {r.status} {r.reason}")

    def _failed(self, e: Exception, what: str, failures: int, tries: int, started: float, span: str = "") -> None:
        """Raise the user-facing error, or count a retry and wait out its backoff."""
        self._drop()
        if isinstance(e, ObjectStoreError):
            raise e
        if not isinstance(e, (_Transient, OSError, http.client.HTTPException)):
            raise e
        spent = self.retry.spent(tries, started)
        if spent is not None:
            raise RetriesSpent(f"{what}{span}: gave up after {spent}: {str(e)[:200]}") from None
        if not self.retry.wait(failures):
            raise RetriesSpent(f"{what}{span}: gave up after {failures} failed tries in a row: {e}") from None
        with self.lock:
            self.retries += 1
        log.info("%s: %s; trying again (%d)", what, str(e)[:200], failures)

    def request(self, method: str, path: str, ok=(200,), headers=None) -> tuple[object, bytes]:
        """``(response, body)`` of one small request, tried again on transient failures."""
        failures, started, what = 0, self.retry.clock(), self.origin + path
        while True:
            try:
                c = self._conn()
                c.request(method, path, headers=headers or {})
                r = c.getresponse()
                body = r.read(formats.MAX_HEADER + 1) if method != "HEAD" else b""
                if not r.isclosed() and method != "HEAD":
                    self._drop()  # a body past what is read here: not this connection's next answer
                self._status(r, what, ok)
                return r, body
            except Exception as e:
                failures += 1
                self._failed(e, what, failures, failures, started)

    def head(self, path: str) -> tuple[int, str | None]:
        """``(size, validator)`` of the file at ``path`` (ETag, else Last-Modified, else None)."""
        r, _ = self.request("HEAD", path)
        size = r.getheader("Content-Length")
        if size is None or not size.isdigit():
            raise ObjectStoreError(f"{self.origin}{path}: the server gives no Content-Length")
        return int(size), validator(r.getheader("ETag"), r.getheader("Last-Modified"))

    def read(self, bucket: str, key: str, etag: str | None, offset: int, view: memoryview,
             landed: Callable[[int], None] | None = None) -> None:
        """Fill ``view`` with bytes [offset, offset + len(view)) of the file at path ``key`` (``bucket``
        unused: one server), resumed where it stopped (``objstore.S3.read``'s contract)."""
        done, failures, tries, want = 0, 0, 0, len(view)
        what, span = self.origin + key, f" bytes {offset}-{offset + want - 1}"
        started = self.retry.clock()
        while done < want:
            got, tries = 0, tries + 1
            try:
                c = self._conn()
                headers = {"Range": f"bytes={offset + done}-{offset + want - 1}",
                           **({"If-Range": if_range(etag)} if etag else {})}
                c.request("GET", key, headers=headers)
                r = c.getresponse()
                if r.status == 200 and etag:
                    raise ObjectChanged(f"{what} changed: its validator is no longer {etag}, the one recorded in "
                                        f"the manifest")
                self._status(r, what, (206,))
                if r.getheader("Content-Length") != str(want - done):
                    raise ObjectStoreError(f"{what}: asked for {want - done} bytes at {offset + done}, the server "
                                           f"sends {r.getheader('Content-Length')}")
                while done < want:
                    n = r.readinto(view[done: done + READ_STEP])
                    if not n:
                        raise _Transient(f"body cut at {done} of {want} bytes")
                    done, got, failures = done + n, got + n, 0
                    if landed is not None:
                        landed(done)
                    if done < want and self.retry.spent(0, started):
                        raise RetriesSpent(f"{what}{span}: gave up after {self.retry.deadline:g} s with {done} of "
                                           f"{want} bytes read")
            except Exception as e:
                failures += 1
                self._failed(e, what, failures, tries, started, span)
            finally:
                with self.lock:
                    self.bytes_read += got


class HttpCheckpoint(S3Checkpoint):
    """The checkpoint at an http(s):// URL: its files (listed and HEAD-ed once, here), their blob layout, readers
    over it (``S3Checkpoint``'s, over ``Http``)."""

    def __init__(self, url: str, concurrency: int = DEFAULT_CONCURRENCY, range_size: int = DEFAULT_RANGE_SIZE,
                 retry: Retry | None = None):
        if concurrency < 1 or range_size < formats.ALIGN:
            raise ObjectStoreError(f"--s3-concurrency must be at least 1 and --s3-range-size at least "
                                   f"{formats.ALIGN} bytes (got {concurrency}, {range_size})")
        self.url = url
        self.concurrency, self.range_size = concurrency, range_size
        self.s3 = Http(url, retry)
        u = urllib.parse.urlsplit(url)
        path, query = u.path or "/", f"?{u.query}" if u.query else ""
        objects = [(name, p) + self.s3.head(p) for name, p in self._listing(path, query)]
        self.keys = {name: p for name, p, _, _ in objects}
        etags = {name: etag for name, _, _, etag in objects}
        files, self.total = formats.blob_files([(name, size) for name, _, size, _ in objects])
        self.files = [dict(f, etag=etags[f["name"]]) for f in files]

    def _listing(self, path: str, query: str = "") -> list[tuple[str, str]]:
        """``(name, path)`` of the file ``path`` names (its ``query`` kept), or of each plain file in the
        folder's JSON listing."""
        if not path.endswith("/"):
            return [(urllib.parse.unquote(path.rsplit("/", 1)[-1]), path + query)]
        r, body = self.s3.request("GET", path + query)
        try:
            entries = json.loads(body)
            names = [e["name"] for e in entries if isinstance(e, dict) and e.get("type") == "file"]
            if not all(isinstance(n, str) and n and "/" not in n for n in names):
                raise ValueError("a name that is not a file's")
        except (ValueError, TypeError, KeyError) as e:
            raise ObjectStoreError(f"{self.url}: the server's listing is not a JSON file list ({e}); serve it "
                                   f"with nginx's autoindex_format json, or name one file") from None
        names = sorted(n for n in names if formats.listed(n))
        if not names:
            raise ObjectStoreError(f"{self.url}: no files listed")
        return [(n, path + urllib.parse.quote(n)) for n in names]

    def where(self, name: str) -> str:
        return self.s3.origin + self.keys.get(name, name)

    def source(self, files: list[dict] | None = None) -> S3Source:
        """A reader over the blob of ``files`` (a manifest's file table; default: as listed)."""
        listed = {f["name"]: f["etag"] for f in self.files}
        files = [dict(f, etag=f.get("etag") or listed.get(f["name"])) for f in (files or self.files)]
        return S3Source(self.s3, None, self.keys, files, self.concurrency, self.range_size)
