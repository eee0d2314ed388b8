"""Seeding: ``seed(path) -> Seeder``, a checkpoint read once and served with its tracker (or as an origin
reader in a standalone tracker's swarm)."""
from __future__ import annotations

import os
import time

import zmq

from ..errors import P2PError
from ..sources.formats import checkpoint_files, scan as scan_checkpoint
from ..sources.manifest import Manifest, read_manifest
from ..sources.remote import is_remote
from ..sources.source import BlobSource, sending_read_bytes
from ..storage import catalog, hfcache
from ..storage.modelcache import ModelCache
from ..storage.store import blob_backing, SourceStore, Store
from ..swarm.node.node import bind_router, DEFAULT_WINDOW, Node
from ..swarm.node.uplink import probe_port_for, probe_sink
from ..swarm.tracker.admission import CHILD_TIMEOUT, MAX_PER_HOST, MEMBER_TIMEOUT
from ..wire import keys
from ..wire.context import node_context
from .handshake import DEFAULT_PORT, parse_addr


DEFAULT_PLAN = "forest:2"  # measured best (README: broadcast results); the others stay for comparison


class Seeder:
    """A running seeder: serves the checkpoint at ``path`` and runs the tracker."""

    reread_at_close: int | None = None  # ``reread`` as the I/O threads ended

    def __init__(self, path, *, port: int = DEFAULT_PORT, host: str = "0.0.0.0",
                 chunk_size: int | None = None, topology: str = DEFAULT_PLAN, hash: str = "xxh3_64",
                 advertise: str | None = None, window: int = DEFAULT_WINDOW, key: keys.FleetKey | None = None,
                 max_peers: int = 10_000, manifest: str | None = None, exclude=(),
                 s3_concurrency: int = 16, s3_range_size: int = 8 << 20, cache: ModelCache | None = None,
                 probe_port: int | None = None, member_timeout: float = MEMBER_TIMEOUT, child_timeout: float = CHILD_TIMEOUT,
                 max_per_host: int = MAX_PER_HOST, tracker: str | None = None, io_threads: int | None = None):
        from ..sources.chunker import build  # the seeder's parts: a join never imports them (start-up is on the clock)
        from ..swarm.tracker.topology import make as make_topology
        from ..swarm.tracker.tracker import Tracker
        self.path = self.url = os.fspath(path)  # url: the origin as given (a standalone tracker knows it so)
        origin = etags = None
        if not os.path.exists(self.path) and hfcache.parse_repo_ref(self.path):  # ORG/NAME[@REVISION]
            self.path, origin = hfcache.resolve(self.path)
        path = self.path
        # a hub cache snapshot: record its repo, commit and etags
        snapshot = None if is_remote(self.path) else hfcache.snapshot_of(path)
        if snapshot is not None:
            origin = dict(snapshot[0], **(origin or {}))
            etags = snapshot[1]
        self.exclude = tuple(exclude)
        # entries not served (SKIPPED_DIRS, ``exclude``); an object store's listing skips them silently
        self.skipped = [] if is_remote(self.path) else scan_checkpoint(path, self.exclude).skipped
        self.key = key
        self.topology = make_topology(topology)  # a bad name fails before the scan
        t0 = time.monotonic()
        self.source = self.s3 = None
        if is_remote(self.path):  # an object store, a web server: its client is imported only here
            from ..sources.remote import checkpoint

            self.s3 = checkpoint(self.path, s3_concurrency, s3_range_size)
            known = self.s3.check(read_manifest(manifest), manifest) if manifest else None
            scan, open_source = self.s3.build, self.s3.source
        else:
            known = (self._published(path, manifest, self.exclude) if manifest
                     else catalog.lookup(path, chunk_size, hash, self.exclude))
            if known is not None and not manifest and (known.origin != origin or [
                    f.get("etag") for f in known.files] != [(etags or {}).get(f["name"]) for f in known.files]):
                known = None  # filed before under another revision's name: hash again (the files are the same)
            scan = lambda *a, **kw: build(path, *a, exclude=self.exclude, origin=origin, etags=etags,  # noqa: E731
                                          **kw)
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
                catalog.remember(path, self.manifest, self.exclude, chunk_size)
                self.store = SourceStore.open(self.manifest, path)
            self.store.hold_all()
        self.scan_seconds = time.monotonic() - t0
        if topology.strip().lower().startswith("auto"):  # now the chunk count is known: choose with it
            self.topology = make_topology(topology, chunks=self.manifest.n_chunks)
        # serving a copy the model cache keeps: hold it, so it is not evicted while seeded
        cache = cache if cache is not None else ModelCache()
        self.lock = None if self.s3 is not None else cache.hold_if_known(path)
        if tracker is not None:  # an origin reader in a standalone tracker's swarm, not a tracker
            from ..origin import member_of
            return member_of(self, tracker, host=host, port=port, advertise=advertise, window=window, key=key,
                             child_timeout=child_timeout, max_per_host=max_per_host, io_threads=io_threads)
        router = self._listen(host, port, probe_port, key, io_threads)
        advertise = advertise and "%s:%d" % parse_addr(advertise, self.port)  # WELCOME's tracker: HOST:PORT
        self.tracker = Tracker(self.topology, advertise or "", max_peers=max_peers)
        self.node = Node(self.ctx, router, self.manifest, self.store, peer_id="seeder", tracker=self.tracker,
                         window=window, key=key, child_timeout=child_timeout, max_per_host=max_per_host)
        self.node.endpoint.member_timeout = member_timeout
        if self.probe_sink is not None:  # WELCOME asks joiners to time their uplinks against it
            self.node.endpoint.probe_port = self.probe_sink.port
        if self.source is not None:
            self.node.attach_source(self.source)
        # from here on, what the kernel reads for libzmq's I/O threads is pages sending reads again; an object
        # store's temp file is not its storage: the bucket's reads are counted there
        self.io_at_serve = sending_read_bytes() if self.s3 is None else None
        self.node.start()

    def _listen(self, host: str, port: int, probe_port: int | None, key, io_threads: int | None = None):
        """The ROUTER peers and members reach (``self.port``) and the probe sink (``self.probe_sink``);
        P2PError, with nothing left open, where either cannot listen.  ``io_threads``: libzmq's
        (``wire.context.default_io_threads()`` by default)."""
        self.ctx = node_context(io_threads)
        self.gate = keys.gate(self.ctx, key)  # ZAP allow-list, before any keyed socket exists
        router = None
        try:
            router, self.port = bind_router(self.ctx, host, port, key)
            self.probe_sink = probe_sink(host, probe_port_for(port, probe_port))
            return router
        except (zmq.ZMQError, P2PError) as e:
            router is not None and router.close(0)
            self.gate and self.gate.stop()
            self.ctx.term()
            self.lock and self.lock.release()
            if isinstance(e, P2PError):
                raise
            raise P2PError(f"cannot listen on {host}:{port}: {e}") from None

    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    @staticmethod
    def _published(path, manifest_path: str, exclude=()) -> Manifest:
        """A manifest built earlier (``p2pw manifest PATH -o M``) that matches the files at ``path``."""
        m = read_manifest(manifest_path)
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
        """Bytes read from storage again by sending: the kernel's count for libzmq's I/O threads since serving
        began (``source.sending_read_bytes``), kept at close, when they end; 0 where the kernel keeps no count."""
        if self.reread_at_close is not None:
            return self.reread_at_close
        if self.io_at_serve is None:
            return 0
        return sum(n - self.io_at_serve.get(tid, 0) for tid, n in sending_read_bytes().items())

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
        if self.probe_sink is not None:
            self.probe_sink.close()
        if self.s3 is not None and self.source is not None:
            self.source.close()  # its GET threads
        if self.gate is not None:
            self.gate.stop()
        self.reread_at_close = self.reread  # the I/O threads' counts end with them
        self.ctx.term()
        self.store.close()
        if self.lock is not None:
            self.lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def seed(path, **kw) -> Seeder:
    """Read the checkpoint at ``path`` once and serve it; see ``Seeder`` for options."""
    return Seeder(path, **kw)
