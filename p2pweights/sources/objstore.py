"""Object store: a checkpoint under ``s3://BUCKET/PREFIX``, read with parallel ranged GETs.

``S3Checkpoint`` lists the objects (a prefix holding a checkpoint's files, or
one object) and lays them out as the blob, exactly as local files are laid
out (name order, 4 KiB aligned).  ``S3Source`` reads blob ranges with
``concurrency`` ranged GETs of ``range_size`` bytes in flight, straight into
the caller's buffer, each byte once; it has the interface the seeder uses for
files (``BlobSource``).  Chunks asked for together are read as runs of
consecutive chunks, one ranged GET of up to ``range_size`` bytes per run and
object, each chunk verified on its own.  Every GET carries ``If-Match`` with the object's ETag
(which the manifest records per file), so an object that changed under the
seeder is refused by the store itself and never served.  A throttled (503
SlowDown) or dropped GET is tried again after a backoff (``Retry``) from the
byte where it stopped, within bounds: ``Retry.tries`` tries of one range in
all and ``Retry.deadline`` seconds for it, then ``RetriesSpent`` names the
object and the range.

The client is boto3 (the ``s3`` extra), imported only when an s3:// source is
opened: credentials and endpoint come the standard AWS way (environment
variables including ``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` and the shared
config files, instance roles).
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from . import formats
from .manifest import Manifest, chunk_hasher, chunk_size_for, file_segments
from .source import SourceError

log = logging.getLogger("p2pw")

SCHEME = "s3://"
DEFAULT_CONCURRENCY = 16  # GETs in flight
DEFAULT_RANGE_SIZE = 8 << 20  # bytes per ranged GET
DEFAULT_TRIES = 32  # tries of one request (a ranged GET, a listing) in all, those that made progress included
DEFAULT_DEADLINE = 300.0  # seconds one request may take from its first try, backoffs included
READ_STEP = 256 << 10  # bytes per read from a GET's body: at most this much of a dropped GET is fetched again
THROTTLED = {"SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestTimeout",
             "InternalError", "RequestLimitExceeded"}
DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
          "AccountProblem", "ExpiredToken", "InvalidToken"}


def is_s3(path) -> bool:
    """Whether ``path`` names an object store location rather than local files."""
    return isinstance(path, str) and path.startswith(SCHEME)


class ObjectStoreError(SourceError):
    """An object store read that cannot go on: missing bucket or object, access denied, retries spent."""


class RetriesSpent(ObjectStoreError):
    """A request failed or stalled past its retry bounds (``Retry.tries``, ``Retry.deadline``)."""


class NoSuchObject(ObjectStoreError):
    """The bucket has no object under that key."""


class ObjectChanged(ObjectStoreError):
    """An object's ETag is no longer the one recorded for it: its bytes are not the manifest's."""


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str

    @classmethod
    def parse(cls, text: str) -> "S3Url":
        bucket, _, key = text[len(SCHEME):].partition("/")
        if not text.startswith(SCHEME) or not bucket:
            raise ObjectStoreError(f"bad object store URL {text!r}: expected s3://BUCKET/PREFIX")
        return cls(bucket, key)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


@dataclass
class Retry:
    """When a failed request is tried again: exponential backoff with jitter, at most ``attempts``
    failures in a row (a GET that made progress starts counting again), and whatever its progress at
    most ``tries`` tries in all and ``deadline`` seconds from its first try (a server that sends a
    little and drops is not retried for ever).  Pure: ``sleep``, ``random`` and ``clock`` are injected."""

    attempts: int = 8
    base: float = 0.05
    cap: float = 5.0
    tries: int = DEFAULT_TRIES
    deadline: float = DEFAULT_DEADLINE
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    random: Callable[[], float] = field(default=random.random, repr=False)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)

    def spent(self, tries: int, started: float) -> str | None:
        """Why a request begun at ``started`` (by ``clock``) is not tried again after ``tries`` tries, or None."""
        if tries >= self.tries:
            return f"{tries} tries"
        if self.clock() - started >= self.deadline:
            return f"{self.deadline:g} s"
        return None

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (1, 2, ...)."""
        return min(self.cap, self.base * 2 ** (failures - 1)) * (0.5 + 0.5 * self.random())

    def wait(self, failures: int) -> bool:
        """After the ``failures``-th failure in a row: wait and return True, or False when the tries are spent."""
        if failures >= self.attempts:
            return False
        self.sleep(self.delay(failures))
        return True


def _quoted(etag: str) -> str:
    return etag if etag.startswith('"') else f'"{etag}"'


class S3:
    """One boto3 client, shared by every reading thread, with the retry policy and the errors users see."""

    def __init__(self, concurrency: int = DEFAULT_CONCURRENCY, retry: Retry | None = None):
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError:
            raise ObjectStoreError("s3:// sources need boto3: pip install 'p2pweights[s3]'") from None
        self.errors = botocore.exceptions
        for name in ("boto3", "botocore", "urllib3"):  # their INFO lines ("Found credentials...") are noise here
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        config = botocore.config.Config(max_pool_connections=concurrency + 2, connect_timeout=10, read_timeout=60,
                                        retries={"total_max_attempts": 1})  # retries are ours: they resume
        try:
            self.client = boto3.session.Session().client("s3", config=config)
        except botocore.exceptions.BotoCoreError as e:
            raise ObjectStoreError(f"cannot set up the S3 client: {e}") from None
        self.retry = retry or Retry()
        self.lock = threading.Lock()
        self.retries = 0  # requests tried again (throttled, dropped, server errors)
        self.bytes_read = 0

    def _fatal(self, e: Exception, what: str) -> ObjectStoreError | None:
        """The user-facing error for ``e``, or None when it is worth trying again."""
        if isinstance(e, ObjectStoreError):
            return e
        if isinstance(e, self.errors.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in THROTTLED or status >= 500:
                return None
            if code == "NoSuchBucket":
                return ObjectStoreError(f"{what}: no such bucket")
            if code in ("NoSuchKey", "404") or status == 404:
                return NoSuchObject(f"{what}: no such object")
            if code in DENIED or status == 403:
                return ObjectStoreError(f"{what}: access denied ({code}): check the credentials "
                                        "(AWS_PROFILE, AWS_ACCESS_KEY_ID) and the bucket's policy")
            if code == "PreconditionFailed" or status == 412:
                return ObjectChanged(f"{what} changed: its ETag is no longer the one recorded in the manifest")
            return ObjectStoreError(f"{what}: {code or status}: {err.get('Message', '')}".rstrip(": "))
        if isinstance(e, self.errors.NoCredentialsError):
            return ObjectStoreError("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                    "or AWS_PROFILE")
        if isinstance(e, (self.errors.HTTPClientError, self.errors.ConnectionError, OSError,
                          self.errors.ResponseStreamingError, self.errors.IncompleteReadError)):
            return None  # refused, reset, timed out, cut mid-body
        if isinstance(e, self.errors.BotoCoreError):
            return ObjectStoreError(f"{what}: {e}")
        raise e

    def _failed(self, e: Exception, what: str, failures: int, tries: int, started: float, span: str = "") -> None:
        """Raise the user-facing error, or count a retry and wait out its backoff (``span``: the bytes asked)."""
        fatal = self._fatal(e, what)
        if fatal is not None:
            raise fatal from None
        spent = self.retry.spent(tries, started)
        if spent is not None:
            raise RetriesSpent(f"{what}{span}: gave up after {spent}: {str(e).splitlines()[0][:200]}") from None
        if not self.retry.wait(failures):
            raise RetriesSpent(f"{what}{span}: gave up after {failures} failed tries in a row: {e}") from None
        with self.lock:
            self.retries += 1
        log.info("%s: %s; trying again (%d)", what, str(e).splitlines()[0][:200], failures)

    def call(self, what: str, fn):
        """``fn()`` (one request), tried again on transient failures."""
        failures, started = 0, self.retry.clock()
        while True:
            try:
                return fn()
            except Exception as e:  # classified by _fatal: user errors raise, transient ones retry
                failures += 1
                self._failed(e, what, failures, failures, started)

    def list(self, url: S3Url) -> list[tuple[str, str, int, str]]:
        """``(name, key, size, etag)`` of the checkpoint at ``url``: the one object ``url`` names, or every
        object under it as a prefix (names relative to it; '.'-hidden and empty path parts skipped), by name."""
        c = self.client
        if url.key and not url.key.endswith("/"):
            try:
                head = self.call(str(url), lambda: c.head_object(Bucket=url.bucket, Key=url.key))
                return [(url.key.rsplit("/", 1)[-1], url.key, head["ContentLength"], head["ETag"].strip('"'))]
            except NoSuchObject:
                pass  # not one object: a prefix
            prefix = url.key + "/"
        else:
            prefix = url.key
        found, token = [], None
        while True:
            kw = {"Bucket": url.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            where = f"{SCHEME}{url.bucket}" if not prefix else str(url)
            page = self.call(where, lambda: c.list_objects_v2(**kw))
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix):]
                if formats.listed(name):
                    found.append((name, o["Key"], o["Size"], o["ETag"].strip('"')))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        if not found:
            raise ObjectStoreError(f"{url}: no such object, and no objects under it")
        return sorted(found)

    def read(self, bucket: str, key: str, etag: str | None, offset: int, view: memoryview,
             landed: Callable[[int], None] | None = None) -> None:
        """Fill ``view`` with bytes [offset, offset + len(view)) of object ``key`` (which must still have
        ``etag``), with one ranged GET, resumed from where it stopped when throttled or dropped (within
        ``Retry.tries`` and ``Retry.deadline``: RetriesSpent names the object and the range).  ``landed(n)``
        is told each time the first ``n`` bytes of ``view`` are in place."""
        done, failures, tries, want = 0, 0, 0, len(view)
        what, span = f"{SCHEME}{bucket}/{key}", f" bytes {offset}-{offset + want - 1}"
        extra = {"IfMatch": _quoted(etag)} if etag else {}
        started = self.retry.clock()
        while done < want:
            got, tries = 0, tries + 1
            try:
                r = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset + done}-{offset + want - 1}",
                                           **extra)
                body = r["Body"]
                try:
                    if r.get("ContentLength") != want - done:
                        raise ObjectStoreError(f"{what}: asked for {want - done} bytes at {offset + done}, the "
                                               f"server sends {r.get('ContentLength')} (does it ignore Range?)")
                    while done < want:
                        n = body.readinto(view[done: done + READ_STEP])
                        if not n:
                            raise self.errors.IncompleteReadError(actual_bytes=done, expected_bytes=want)
                        done, got, failures = done + n, got + n, 0
                        if landed is not None:
                            landed(done)
                        if done < want and self.retry.spent(0, started):  # a trickle never fails a read
                            raise RetriesSpent(f"{what}{span}: gave up after {self.retry.deadline:g} s with {done} of "
                                               f"{want} bytes read")
                finally:
                    body.close()
            except Exception as e:  # classified by _fatal: user errors raise, transient ones retry from `done`
                failures += 1
                self._failed(e, what, failures, tries, started, span)
            finally:
                with self.lock:
                    self.bytes_read += got


class S3Source:
    """Reads blob ranges of a checkpoint's objects; the interface of ``source.BlobSource``.

    ``files`` is the file table (``{name, offset, size, etag?}``); ``keys`` maps
    each name to its object key.  ``ahead`` tells a read-ahead how many chunks
    past a request are worth reading at once (they are read in parallel).
    """

    def __init__(self, s3: S3, bucket: str, keys: dict[str, str], files: list[dict],
                 concurrency: int = DEFAULT_CONCURRENCY, range_size: int = DEFAULT_RANGE_SIZE):
        self.s3, self.bucket, self.keys = s3, bucket, keys
        self.files = [f for f in files if f["size"] > 0]
        self.concurrency, self.range_size = concurrency, range_size
        self.ahead = 2 * concurrency
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="p2pw-s3")
        self.changed: set[str] = set()  # objects reported as changed

    @property
    def bytes_read(self) -> int:
        return self.s3.bytes_read

    def _fill(self, lo: int, view: memoryview, landed: Callable[[int], None] | None = None) -> None:
        """Read blob bytes [lo, lo + len(view)) in this thread, one GET per object and ``range_size``;
        ``landed(x)``, if given, is told each time blob bytes [lo, x) are in place."""
        hi, pos = lo + len(view), lo
        for f, offset, a, b in file_segments(self.files, lo, hi):
            view[pos - lo: a - lo] = bytes(a - pos)  # padding before this file
            for s in range(a, b, self.range_size):
                e = min(b, s + self.range_size)
                self.s3.read(self.bucket, self.keys[f["name"]], f.get("etag"), offset + s - a, view[s - lo: e - lo],
                             None if landed is None else (lambda n, s=s: landed(s + n)))
            pos = b
        view[pos - lo:] = bytes(hi - pos)
        if landed is not None:
            landed(hi)

    def read_into(self, lo: int, view: memoryview) -> None:
        """Fill ``view`` with blob bytes [lo, lo + len(view)), ``concurrency`` ranged GETs at a time."""
        step = self.range_size
        jobs = [self.pool.submit(self._fill, s, view[s - lo: min(s + step, lo + len(view)) - lo])
                for s in range(lo, lo + len(view), step)]
        for job in jobs:
            job.result()

    def read_chunk(self, manifest, index: int, view: memoryview, digest) -> bool:
        """Read chunk ``index`` into ``view`` (in this thread); whether its hash is the manifest's."""
        lo, _ = manifest.chunk_span(index)
        self._fill(lo, view)
        return digest(view) == manifest.chunks[index]

    def runs(self, manifest, indices) -> list[list[int]]:
        """``indices`` as runs of consecutive chunks of at most ``range_size`` bytes (one chunk at least)."""
        runs: list[list[int]] = []
        for i in sorted(indices):
            if runs and runs[-1][-1] == i - 1 and manifest.chunk_span(i)[1] - manifest.chunk_span(runs[-1][0])[0] \
                    <= self.range_size:
                runs[-1].append(i)
            else:
                runs.append([i])
        return runs

    def read_run(self, manifest, run: list[int], view_of, digest, emit, span_of=None) -> None:
        """Read consecutive chunks ``run`` with one ranged GET per object, and ``emit(index, verified)`` each
        chunk as soon as its bytes have landed (in ``view_of(index)``, hashed against the manifest), not when
        the GET ends: the swarm has a run's first chunk while the rest still streams.  ``span_of(lo, hi)``,
        where the chunks' views are one buffer's bytes [lo, hi), is read into directly; else the run lands in
        a buffer of its own and each chunk is copied out.  A run that cannot be read is read again chunk by
        chunk from the first chunk not yet emitted, so only the chunks of the object at fault fail.  Every
        chunk of ``run`` is emitted once."""
        if len(run) == 1:
            emit(run[0], self._checked(manifest, run[0], view_of(run[0]), digest))
            return
        lo, hi = manifest.chunk_span(run[0])[0], manifest.chunk_span(run[-1])[1]
        direct = span_of is not None
        got = span_of(lo, hi) if direct else memoryview(bytearray(hi - lo))
        todo = list(run)

        def landed(upto: int) -> None:
            while todo and (span := manifest.chunk_span(todo[0]))[1] <= upto:
                i, (a, b) = todo[0], span
                view = got[a - lo: b - lo] if direct else view_of(i)
                if not direct:
                    view[:] = got[a - lo: b - lo]
                ok = digest(view) == manifest.chunks[i]
                todo.pop(0)  # only now: a chunk that raised on its way is read again below
                emit(i, ok)

        try:
            self._fill(lo, got, landed)
        except Exception:
            while todo:
                i = todo.pop(0)
                emit(i, self._checked(manifest, i, view_of(i), digest))

    def _checked(self, manifest, index: int, view: memoryview, digest) -> bool:
        """``read_chunk``, a failure reported (an object that changed once) and answered False."""
        try:
            return self.read_chunk(manifest, index, view, digest)
        except ObjectChanged as e:
            if str(e) not in self.changed:
                self.changed.add(str(e))
                log.error("%s: not serving its chunks (make the manifest again and restart the seeder)", e)
        except Exception as e:  # a serving seeder reports a chunk it cannot read and goes on
            log.error("chunk %d: %s", index, e)
        return False

    def read_chunks(self, manifest, indices, view_of, digest, span_of=None):
        """Yield ``(index, verified)`` for each chunk in ``indices`` as it lands in ``view_of(index)``: runs of
        consecutive chunks (``runs``) read in parallel, one ranged GET each, each chunk yielded as soon as its
        bytes are in (``read_run``; ``span_of``: see there).

        A chunk of an object that changed (ETag) or cannot be read is reported and yields False."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        runs = self.runs(manifest, indices)
        jobs = [self.pool.submit(self.read_run, manifest, run, view_of, digest, lambda i, ok: out.put((i, ok, None)),
                                 span_of) for run in runs]
        def failed(job) -> None:  # a bug in a run's reading ends the wait instead of hanging it
            if job.exception() is not None:
                out.put((None, False, job.exception()))

        for job in jobs:
            job.add_done_callback(failed)
        for _ in range(sum(map(len, runs))):
            i, ok, error = out.get()
            if error is not None:
                raise error
            yield i, ok

    def stream(self, total: int, chunk_size: int, into=None):
        """Yield ``(lo, view)`` for consecutive whole-chunk pieces of blob [0, total), in order, read with
        ``concurrency`` pieces in flight.  Bytes land in ``into`` (the blob's buffer) when given, else in
        scratch slots: a view is valid until the generator is resumed."""
        piece = max(chunk_size, self.range_size // chunk_size * chunk_size)
        scratch = None if into is not None else [memoryview(bytearray(piece)) for _ in range(self.concurrency)]
        blob = memoryview(into).cast("B") if into is not None else None
        inflight = []
        try:
            for n, lo in enumerate(range(0, total, piece)):
                if len(inflight) >= self.concurrency:
                    done_lo, view, job = inflight.pop(0)
                    job.result()
                    yield done_lo, view
                hi = min(lo + piece, total)
                view = blob[lo:hi] if blob is not None else scratch[n % self.concurrency][: hi - lo]
                inflight.append((lo, view, self.pool.submit(self._fill, lo, view)))
            while inflight:
                done_lo, view, job = inflight.pop(0)
                job.result()
                yield done_lo, view
        finally:
            for _, _, job in inflight:
                job.cancel()
            for _, _, job in inflight:
                if not job.cancelled():
                    job.exception()  # let running GETs end before the buffer goes away

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class IndexBytes:
    """Keeps each file's tensor index bytes (safetensors header, packed index) as the blob streams by in order."""

    def __init__(self, files: list[dict], where):
        self.files = [f for f in files if formats.is_indexed(f["name"])]
        self.got = {f["name"]: bytearray() for f in self.files}
        self.where = where

    def _end(self, f: dict, got: bytearray) -> int:
        """Blob offset where this file's index bytes end (as far as the bytes seen so far tell)."""
        if f["name"].endswith(formats.PACKED_INDEX_SUFFIX):
            return f["offset"] + min(f["size"], formats.MAX_HEADER + 1)
        if len(got) < 8:
            return f["offset"] + min(8, f["size"])
        return f["offset"] + 8 + formats.safetensors_header_len(bytes(got[:8]), f["size"], self.where(f["name"]))

    def feed(self, lo: int, view: memoryview) -> None:
        hi = lo + len(view)
        for f in self.files:
            got = self.got[f["name"]]
            while True:
                a = f["offset"] + len(got)
                b = min(self._end(f, got), hi)
                if not lo <= a < b:
                    break
                got += view[a - lo: b - lo]

    def header_of(self, name: str) -> list[dict]:
        got, size = self.got[name], next(f["size"] for f in self.files if f["name"] == name)
        formats.safetensors_header_len(bytes(got[:8]), size, self.where(name))
        return formats.parse_safetensors_header(bytes(got[8:]), size, self.where(name))[0]

    def index_of(self, name: str):
        return formats.parse_packed_index(bytes(self.got[name]), self.where(name))


class S3Checkpoint:
    """The checkpoint at an s3:// URL: its objects (listed once, here), their blob layout, readers over it."""

    def __init__(self, url: str, concurrency: int = DEFAULT_CONCURRENCY, range_size: int = DEFAULT_RANGE_SIZE,
                 retry: Retry | None = None):
        if concurrency < 1 or range_size < formats.ALIGN:
            raise ObjectStoreError(f"--s3-concurrency must be at least 1 and --s3-range-size at least "
                                   f"{formats.ALIGN} bytes (got {concurrency}, {range_size})")
        self.url = S3Url.parse(url)
        self.concurrency, self.range_size = concurrency, range_size
        self.s3 = S3(concurrency, retry)
        objects = self.s3.list(self.url)
        self.keys = {name: key for name, key, _, _ in objects}
        etags = {name: etag for name, _, _, etag in objects}
        files, self.total = formats.blob_files([(name, size) for name, _, size, _ in objects])
        self.files = [dict(f, etag=etags[f["name"]]) for f in files]

    @property
    def retries(self) -> int:
        """Requests tried again so far (throttled, dropped, server errors)."""
        return self.s3.retries

    def where(self, name: str) -> str:
        return f"{SCHEME}{self.url.bucket}/{self.keys.get(name, name)}"

    def source(self, files: list[dict] | None = None) -> S3Source:
        """A reader over the blob of ``files`` (a manifest's file table; default: as listed)."""
        listed = {f["name"]: f["etag"] for f in self.files}
        files = [dict(f, etag=f.get("etag") or listed.get(f["name"])) for f in (files or self.files)]
        return S3Source(self.s3, self.url.bucket, self.keys, files, self.concurrency, self.range_size)

    def check(self, manifest: Manifest, label: str, etags: bool = False) -> Manifest:
        """``manifest`` (read from ``label``), once checked to describe these objects: every file listed with
        its size, and the ETag it records (an object changed since is reported and not served: ObjectChanged).
        ``etags``: a file it records no ETag for, where the object has one, is refused too (a manifest from
        elsewhere is only this checkpoint's if its ETags say so)."""
        listed = {f["name"]: f for f in self.files}
        for f in manifest.files:
            have = listed.get(f["name"])
            if have is None or have["size"] != f["size"]:
                found = "missing" if have is None else f"{have['size']} bytes"
                raise ObjectStoreError(f"{label} does not describe {self.url}: {f['name']} is {found}, "
                                       f"the manifest says {f['size']} bytes")
            if etags and have.get("etag") and not f.get("etag"):
                raise ObjectStoreError(f"{label} records no ETag for {f['name']} ({self.where(f['name'])} has "
                                       f"one): it cannot be checked against {self.url}")
            if f.get("etag") and f["etag"] != have["etag"]:
                raise ObjectChanged(f"{self.where(f['name'])} changed since {label} was made (ETag {have['etag']}, "
                                    f"the manifest records {f['etag']}): not serving it; make the manifest again "
                                    f"(p2pw manifest {self.url} -o {label})")
        return manifest

    def build(self, chunk_size: int | None = None, hash: str = "xxh3_64", into=None):
        """Read the blob once, in parallel: (Manifest with each file's ETag, bytes read, the ``into`` buffer or None).

        As ``chunker.build``: ``into(size)`` returns the buffer where the bytes stay (a seeder's store);
        ``chunk_size`` None: ``default_chunk_size`` of the blob."""
        chunk_size = chunk_size_for(chunk_size, self.total)
        digest = chunk_hasher(hash)
        source = self.source()
        buffer = into(self.total) if into is not None else None
        index = IndexBytes(self.files, self.where)
        chunks: list[str] = []
        try:
            for lo, view in source.stream(self.total, chunk_size, buffer):
                index.feed(lo, view)
                chunks.extend(digest(view[o: o + chunk_size]) for o in range(0, len(view), chunk_size))
        finally:
            source.close()
        tensors = formats.tensor_index(self.files, index.header_of, index.index_of, where=self.where)
        m = Manifest(total_size=self.total, chunk_size=chunk_size, chunks=chunks, files=self.files, tensors=tensors,
                     hash=hash)
        return m, source.bytes_read, buffer
