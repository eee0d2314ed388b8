"""API: the library surface: ``seed(...) -> Seeder`` and ``join(...) -> Download``.

Both run a node's event loop in a background thread of the calling process and
return a handle.  A ``Download`` is usable while it downloads: ``wait_range``
returns as soon as the chunks covering a byte range are verified.  Errors are
never hidden: a failed download raises ``P2PError`` from every wait.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

import zmq

from . import catalog, keys, protocol
from .errors import P2PError
from .cache import DiskCache
from .chunker import build
from .manifest import DEFAULT_CHUNK_SIZE, MAX_MANIFEST_BYTES, Manifest, ManifestError, check_model_id
from .node import DEFAULT_WINDOW, GIVE_UP_AFTER, PARENT_TIMEOUT, Node, bind_router, tcp
from .protocol import Msg, ProtocolError
from .store import SourceStore, Store, StoreClosed, blob_backing
from .formats import checkpoint_files, scan as scan_checkpoint
from .source import BlobSource, storage_read_bytes
from .topology import make as make_topology
from .tracker import Tracker

log = logging.getLogger("p2pw")

DEFAULT_PORT = 7420
DEFAULT_PLAN = "forest:2"  # measured best (README: broadcast results); the others stay for comparison
MAX_REDIRECTS = 4
MAX_STRIPES = 64  # parents a WELCOME may name (one link each)




def parse_addr(addr: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """'HOST[:PORT]' -> (host, port)."""
    addr = addr.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep:
        return addr, default_port
    try:
        return host, int(port)
    except ValueError:
        raise P2PError(f"bad address {addr!r}: expected HOST[:PORT]") from None


def local_ip_towards(host: str) -> str:
    """The address of this host on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class Seeder:
    """A running seeder: serves the checkpoint at ``path`` and runs the tracker."""

    def __init__(self, path, *, port: int = DEFAULT_PORT, host: str = "0.0.0.0",
                 chunk_size: int = DEFAULT_CHUNK_SIZE, topology: str = DEFAULT_PLAN, hash: str = "xxh3_64",
                 advertise: str | None = None, window: int = DEFAULT_WINDOW, key: keys.FleetKey | None = None,
                 max_peers: int = 10_000, manifest: str | None = None, exclude=(),
                 s3_concurrency: int = 16, s3_range_size: int = 8 << 20):
        self.path = os.fspath(path)
        self.exclude = tuple(exclude)
        # entries not served (SKIPPED_DIRS, ``exclude``); an object store's listing skips them silently
        self.skipped = [] if self.path.startswith("s3://") else scan_checkpoint(path, self.exclude).skipped
        self.key = key
        self.topology = make_topology(topology)  # a bad name fails before the scan
        t0 = time.monotonic()
        self.source = self.s3 = None
        if self.path.startswith("s3://"):  # an object store: boto3 is imported only here
            from .objstore import S3Checkpoint

            self.s3 = S3Checkpoint(self.path, s3_concurrency, s3_range_size)
            known = self.s3.check(_read_manifest(manifest), manifest) if manifest else None
            scan, open_source = self.s3.build, self.s3.source
        else:
            known = (self._published(path, manifest, self.exclude) if manifest
                     else catalog.lookup(path, chunk_size, hash, self.exclude))
            scan = lambda *a, **kw: build(path, *a, exclude=self.exclude, **kw)  # noqa: E731
            open_source = lambda files: BlobSource(path, files)  # noqa: E731
        if known is not None:  # hashed before (a restart, a published manifest): serve now, read as peers ask
            self.manifest, self.scanned = known, 0
            self.store = Store(known) if self.s3 is not None else SourceStore.open(known, path)
            self.source = open_source(known.files)
        else:
            if self.s3 is not None:  # no local files to map: memory, or a temp file over the memory budget
                self.manifest, self.scanned, buffer = scan(chunk_size, hash, into=blob_backing)
                self.store = Store(self.manifest, buffer)
            else:  # hash every chunk, reading each byte from storage once; the mapping serves the page cache
                self.manifest, self.scanned, _ = scan(chunk_size, hash)
                catalog.remember(path, self.manifest, self.exclude)
                self.store = SourceStore.open(self.manifest, path)
            self.store.hold_all()
        self.scan_seconds = time.monotonic() - t0
        self.io_at_serve = storage_read_bytes()  # from here on, storage reads are pages sending read again
        if topology.strip().lower().startswith("auto"):  # now the chunk count is known: choose with it
            self.topology = make_topology(topology, chunks=self.manifest.n_chunks)
        self.ctx = zmq.Context()
        self.gate = keys.gate(self.ctx, key)  # ZAP allow-list, before any keyed socket exists
        try:
            router, self.port = bind_router(self.ctx, host, port, key)
        except zmq.ZMQError as e:
            self.gate and self.gate.stop()
            self.ctx.term()
            raise P2PError(f"cannot listen on {host}:{port}: {e}") from None
        self.tracker = Tracker(self.topology, advertise or "", max_peers=max_peers)
        self.node = Node(self.ctx, router, self.manifest, self.store, peer_id="seeder", tracker=self.tracker,
                         window=window, key=key)
        if self.source is not None:
            self.node.attach_source(self.source)
        self.node.start()

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    @staticmethod
    def _published(path, manifest_path: str, exclude=()) -> Manifest:
        """A manifest built earlier (``p2pw manifest PATH -o M``) that matches the files at ``path``."""
        m = _read_manifest(manifest_path)
        on_disk = {name: size for name, _, size in checkpoint_files(path, exclude)}
        for f in m.files:
            have = on_disk.get(f["name"])
            if have != f["size"]:
                found = "missing" if have is None else f"{have} bytes"
                raise P2PError(f"{manifest_path} does not describe {path}: {f['name']} is {found}, "
                               f"the manifest says {f['size']} bytes")
        return m

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage: the scan (or, restarted from the catalog, what peers asked for), plus what
        sending from the mapped files read again because the kernel had dropped those pages (``reread``)."""
        return self.scanned + (self.source.bytes_read if self.source is not None else 0) + self.reread

    @property
    def reread(self) -> int:
        """Bytes read from storage again by sending (the kernel's count for this process, less the scan and the
        read-ahead thread, whose reads are counted as they are made); 0 where the kernel keeps no count."""
        now = storage_read_bytes()
        if now is None or self.io_at_serve is None:
            return 0
        reader = getattr(self.node, "reader", None)
        return max(now - self.io_at_serve - (reader.storage_read if reader is not None else 0), 0)

    @property
    def stats(self):
        return self.node.stats

    @property
    def fleet(self):
        """The latest ``fleet.Fleet`` snapshot the loop published (every member: rank, sources, progress, rate,
        state); the only view of the membership other threads may read."""
        return self.node.fleet

    def peers_done(self) -> int:
        return self.node.fleet.done

    def wait_peers(self, n: int, timeout: float | None = None) -> bool:
        """Block until ``n`` peers have reported done (False on timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.peers_done() < n:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self.node.stop()
        if self.s3 is not None and self.source is not None:
            self.source.close()  # its GET threads
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _read_manifest(manifest_path: str) -> Manifest:
    try:
        with open(manifest_path) as f:
            return Manifest.from_json(f.read())
    except OSError as e:
        raise P2PError(f"cannot read manifest {manifest_path}: {e.strerror}") from None


def seed(path, **kw) -> Seeder:
    """Read the checkpoint at ``path`` once and serve it; see ``Seeder`` for options."""
    return Seeder(path, **kw)


class Download:
    """A running join: the blob fills in as chunks are verified."""

    loader = None  # a device.Loader when join(..., device=...) asked for one
    gate = None  # the keys.Gate (ZAP handler) of a keyed join

    def __init__(self, node: Node, store: Store, cache: DiskCache | None, welcome: dict, started: float,
                 listen: str):
        self.node, self.store, self.cache = node, store, cache
        self.listen = listen
        self.manifest: Manifest = store.manifest
        self.rank: int = welcome["rank"]
        self.started = started

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    @property
    def parents(self) -> list[dict]:
        """Our planned source in each stripe now (the tracker may have moved us since we joined)."""
        return self.node.partners.parents()

    @property
    def stats(self):
        return self.node.stats

    @property
    def progress(self) -> dict:
        """Bytes and chunks verified so far, elapsed seconds, mean rate (bytes/s)."""
        elapsed = time.monotonic() - self.started
        done = self.store.bytes
        return {"bytes": done, "total": self.manifest.total_size, "chunks": self.store.count,
                "n_chunks": self.manifest.n_chunks, "elapsed": elapsed,
                "rate": done / elapsed if elapsed > 0 else 0.0, "complete": self.store.complete}

    def wait_range(self, lo: int, hi: int, timeout: float | None = None) -> None:
        """Return once every chunk covering bytes [lo, hi) of the blob is verified."""
        chunks = self.manifest.chunks_covering(lo, hi)
        self.node.prioritize(chunks)
        if not (self.loader.wait_chunks(chunks, timeout) if self.loader else self._wait(chunks, timeout)):
            have = int(self.store.have[chunks.start:chunks.stop].sum())
            raise TimeoutError(f"bytes [{lo}, {hi}) not complete after {timeout} s: "
                               f"{have} of {len(chunks)} chunks verified")

    def _wait(self, chunks, timeout) -> bool:
        try:
            return self.store.wait_chunks(chunks, timeout)
        except StoreClosed as e:
            raise P2PError(str(e)) from None

    def wait(self, timeout: float | None = None) -> None:
        """Return once the whole blob is verified (and, with ``out``, on disk under its final names)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait(range(self.manifest.n_chunks), timeout):
            raise TimeoutError(f"download not complete after {timeout} s: {self.progress['chunks']} of "
                               f"{self.manifest.n_chunks} chunks verified")
        if self.cache is not None:
            while not self.cache.wait(0.1):
                if self.cache.error or self.node.fatal:
                    raise P2PError(self.cache.error or self.node.fatal)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"local copy not written after {timeout} s")

    @property
    def seconds(self) -> float:
        end = self.store.done_at or time.monotonic()
        return end - self.started

    def _device(self):
        if self.loader is None:
            raise P2PError("tensors need a device: join(..., device='cpu' or 'cuda:N')")
        return self.loader

    def wait_tensor(self, name: str, timeout: float | None = None):
        """Tensor ``name`` (a view into the device buffer, its dtype and shape) once its bytes are there."""
        return self._device().wait_tensor(name, timeout)

    def tensor_place(self, name: str):
        """Tensor ``name`` as a view of where its bytes land in the device buffer, before they may have:
        read it only after ``wait_tensor(name)`` returned (execute-while-load binds modules to these)."""
        return self._device().place(name)

    def iter_tensors(self, timeout: float | None = None):
        """Yield ``(name, tensor)`` in the order their bytes complete."""
        return self._device().iter_tensors(timeout)

    def state_dict(self, timeout: float | None = None) -> dict:
        """Every tensor as a view into the device buffer, once the whole blob is there."""
        return self._device().state_dict(timeout)

    def stage_report(self) -> dict:
        """Seconds and GB/s of fetch, verify, stage_host, h2d; when the first and last tensors were usable."""
        return self._device().report()

    def close(self, linger: bool = False, timeout: float | None = None) -> None:
        """Stop.  With ``linger``, first keep serving until the tracker says no peer depends on us."""
        if linger and not self.node.fatal:
            self.node.leave_when_done = True
            self.node.left.wait(timeout)
        self.node.stop()
        if self.loader is not None:
            self.loader.close()
        if self.gate is not None:
            self.gate.stop()
        self.node.ctx.term()
        if self.cache is not None:
            self.cache.close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


MAX_STATUS_BYTES = 8 << 20  # a STATUS_REPLY larger than this is refused


def status(addr: str, *, key: keys.FleetKey | None = None, timeout: float = 5.0) -> dict:
    """The fleet as the tracker at ``addr`` (or any peer: it redirects) sees it, slowest first:
    ``{"model_id", "n_chunks", "total_size", "count", "peers": [{"rank", "addr", "sources", "progress",
    "rate", "state", ...}]}``.  Needs no join; ``key`` when the fleet's links are keyed."""
    host, port = parse_addr(addr)
    addr = f"{host}:{port}"
    ctx = zmq.Context()
    try:
        for _ in range(MAX_REDIRECTS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES)
            keys.secure_client(sock, key)
            if not _send_and_wait(sock, addr, protocol.control(Msg.STATUS), timeout, key):
                raise P2PError(f"no answer from {addr} within {timeout:g} s: is a p2pw seeder or peer running "
                               f"there (with --key if the fleet is keyed)?")
            try:
                event = protocol.decode(sock.recv_multipart())
            except ProtocolError as e:
                raise P2PError(f"{addr} is not a compatible p2pw node: {e}") from None
            finally:
                sock.close(0)
            if event.type == Msg.REDIRECT and event.fields["tracker"]:
                addr = event.fields["tracker"]
                continue
            if event.type == Msg.ERROR:
                raise P2PError(f"{addr} refused the status request: {event.fields['message']}")
            if event.type != Msg.STATUS_REPLY:
                raise P2PError(f"{addr} answered STATUS with {event.type.name}")
            try:
                doc = json.loads(bytes(event.payload))
            except ValueError:
                raise P2PError(f"{addr} sent a status reply that is not JSON") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("peers"), list):
                raise P2PError(f"{addr} sent a malformed status reply")
            return doc
        raise P2PError(f"too many redirects asking {addr} for the status")
    finally:
        ctx.destroy(0)


def _handshake(ctx, addr: str, hello: dict, model_id: str | None, timeout: float, key=None):
    """HELLO the node at ``addr``, following REDIRECTs to the tracker; returns (socket, addr, welcome, manifest)."""
    for _ in range(MAX_REDIRECTS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MANIFEST_BYTES)
        keys.secure_client(sock, key)
        try:
            event = _hello(sock, addr, hello, timeout, key)
            if event.type == Msg.REDIRECT:
                sock.close(0)
                addr = event.fields["tracker"] or addr
                continue
            return sock, addr, event.fields, _welcome_manifest(event, addr, model_id)
        except BaseException:
            sock.close(0)
            raise
    raise P2PError(f"too many redirects joining through {addr}")


def _send_and_wait(sock, addr: str, frame: bytes, timeout: float, key) -> bool:
    """Connect ``sock`` to ``addr``, send ``frame``, wait for an answer; P2PError if the link is refused."""
    watch = keys.LinkWatch(sock, addr, key)
    sock.connect(tcp(addr))
    sock.send(frame)
    try:
        return watch.wait(timeout)
    except keys.LinkRefused as e:
        raise P2PError(str(e)) from None
    finally:
        watch.close()


def _hello(sock, addr: str, hello: dict, timeout: float, key):
    """Send HELLO on ``sock`` to ``addr`` and return the answer: WELCOME or REDIRECT, else P2PError."""
    if not _send_and_wait(sock, addr, protocol.control(Msg.HELLO, **hello), timeout, key):
        raise P2PError(f"no answer from {addr} within {timeout:g} s: is a p2pw seeder or peer running there?")
    try:
        event = protocol.decode(sock.recv_multipart())
    except ProtocolError as e:
        raise P2PError(f"{addr} is not a compatible p2pw node: {e}") from None
    if event.type == Msg.ERROR:
        raise P2PError(f"{addr} refused us: {event.fields['message']}")
    if event.type not in (Msg.WELCOME, Msg.REDIRECT):
        raise P2PError(f"{addr} answered HELLO with {event.type.name}")
    return event


def _welcome_manifest(event, addr: str, model_id: str | None) -> Manifest:
    """Check a WELCOME's tree fields and return its manifest (pinned to ``model_id`` if given)."""
    stripes, parents = event.fields["stripes"], event.fields["parents"]
    if not 1 <= stripes <= MAX_STRIPES or len(parents) > stripes or not all(
            isinstance(p, dict) and isinstance(p.get("addr"), str) and p.get("stripe") in range(stripes)
            and isinstance(p.get("rank"), int) for p in parents):
        raise P2PError(f"{addr} sent a malformed WELCOME: {stripes} stripes, parents {str(parents)[:200]}")
    try:
        return Manifest.from_json(bytes(event.payload), expect_id=model_id)
    except ManifestError as e:
        raise P2PError(str(e)) from None


def _wire(node, store, cache, link, tracker_addr: str, welcome: dict, device, started: float, out):
    """Connect a joined node to its plan, its copy on disk and its device sink; returns the loader."""
    manifest = store.manifest
    recovered = cache.recover(store) if cache is not None else []
    for index in recovered:  # chunks an earlier run left on disk: verified again, never fetched again
        node.pull.verified(index)
    node.attach_tracker(link, tracker_addr, welcome["rank"])
    partners = welcome.get("partners") if isinstance(welcome.get("partners"), list) else []
    node.partners.set_plan(welcome["parents"], partners, welcome["stripes"])
    if cache is not None:
        cache.on_error = node.fail
        node.extra_done.append(cache.finished.is_set)
        store.sinks.append(cache)
    loader = None
    if device is not None:
        from .device import Loader

        loader = Loader(node, store, device, started)
    for index in recovered:
        store.verified(index)
    node.stats.resumed = len(recovered)
    if cache is not None and cache.complete:
        log.warning("%s already holds model %s, complete (its marker matches): serving it, fetching nothing",
                    out, manifest.model_id[:16])
    elif recovered:
        log.warning("resumed from %s: %d of %d chunks on disk verified; fetching the rest",
                    out, len(recovered), manifest.n_chunks)
    return loader


def join(parent: str, *, out: str | None = None, port: int = 0, host: str = "0.0.0.0",
         advertise: str | None = None, model_id: str | None = None, window: int = DEFAULT_WINDOW,
         connect_timeout: float = 30.0, peer_id: str | None = None, device: str | None = None,
         key: keys.FleetKey | None = None, parent_timeout: float = PARENT_TIMEOUT,
         give_up_after: float = GIVE_UP_AFTER, verify: str = "marker", memory_budget: int | None = None) -> Download:
    """Attach to the broadcast that ``parent`` (the seeder or any peer, 'HOST[:PORT]') belongs to.

    Returns at once with a ``Download`` whose chunks fill in the background.
    ``out``: write the checkpoint's files there; they are the store (mapped),
    each final as soon as it is verified, ``out/.p2pw/complete.json`` once all
    are; a copy whose marker matches is served at once, unless ``verify='full'``
    (re-hash what is there).  Without ``out``, the blob lives in memory, or in
    an unlinked temporary file when larger than ``memory_budget`` bytes
    (default: half the memory available).  ``model_id``: refuse any
    other checkpoint.  ``connect_timeout``: how long to keep trying a parent
    that is not up yet.  ``parent_timeout``: a parent silent this long is
    given up for another (the tracker names it).  ``give_up_after``: fail once
    no chunk has arrived from anyone for this long (the seeder and every holder
    gone); verified chunks stay on disk for a resume.  ``device`` ('cpu', 'cuda:N'): stream verified chunks
    into one buffer there, for ``wait_tensor`` / ``iter_tensors`` / ``state_dict``.
    ``key`` (``keys.load(DIR)``): CURVE-encrypt and authenticate every link.
    """
    started = time.monotonic()
    if device is not None:
        from .device import parse_device  # imports torch: only when a device is asked for
        parse_device(device)
    if model_id is not None:
        try:
            model_id = check_model_id(model_id)
        except ManifestError as e:
            raise P2PError(str(e)) from None
    p_host, p_port = parse_addr(parent)
    parent = f"{p_host}:{p_port}"
    ctx = zmq.Context()
    gate = keys.gate(ctx, key)
    try:
        router, my_port = bind_router(ctx, host, port, key)
    except zmq.ZMQError as e:
        gate and gate.stop()
        ctx.term()
        raise P2PError(f"cannot listen on {host}:{port}: {e}") from None
    me = advertise or local_ip_towards(p_host)
    peer_id = peer_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    hello = {"peer_id": peer_id, "listen": f"{me}:{my_port}", "model_id": model_id}
    cache = None
    try:
        link, tracker_addr, welcome, manifest = _handshake(ctx, parent, hello, model_id, connect_timeout, key)
        # with out, the destination files are the store (mapped); else memory, or a temp file over the budget
        cache = DiskCache(manifest, out, verify=verify) if out else None
        store = Store(manifest, cache.filemap.buffer if cache is not None
                      else blob_backing(manifest.total_size, memory_budget))
    except Exception:
        cache and cache.close()
        router.close(0)
        gate and gate.stop()
        ctx.destroy(0)
        raise
    node = Node(ctx, router, manifest, store, peer_id=peer_id, window=window,
                key=key, parent_timeout=parent_timeout, hello=hello, give_up_after=give_up_after)
    try:
        loader = _wire(node, store, cache, link, tracker_addr, welcome, device, started, out)
    except Exception:
        node._close_sockets()
        gate and gate.stop()
        ctx.destroy(0)
        raise
    node.start()
    dl = Download(node, store, cache, welcome, started, hello["listen"])
    dl.loader = loader
    dl.gate = gate
    return dl
