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
import resource
import time

import zmq

from .storage import catalog, hfcache
from .wire import keys, protocol
from .errors import P2PError
from .storage.cache import STATE_DIR, DiskCache, copy_paths, marker_matches, remove_tree
from .storage.localcopy import Attached, WriterGone, attach, claim as claim_copy  # noqa: F401 (attach, WriterGone: the API)
from .storage.modelcache import CacheTooSmall, ModelCache, describe_failure
from .sources.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, check_model_id
from .swarm.tracker.admission import CHILD_TIMEOUT, MAX_PER_HOST, MEMBER_TIMEOUT
from .swarm.node.member import WAIT_REPORT
from .swarm.node.node import DEFAULT_WINDOW, GIVE_UP_AFTER, PARENT_TIMEOUT, Node, bind_router, tcp
from .wire.protocol import Msg, ProtocolError, valid_host
from .storage.ring import ChunkRing, ring_budget
from .storage.workers import default_workers, in_flight_limit
from .wire.context import node_context
from .storage.store import SourceStore, SpaceError, Store, StoreClosed, blob_backing
from .sources.formats import checkpoint_files, scan as scan_checkpoint
from .sources.source import BlobSource, sending_read_bytes

log = logging.getLogger("p2pw")

DEFAULT_PORT = 7420
DEFAULT_PLAN = "forest:2"  # measured best (README: broadcast results); the others stay for comparison
MAX_REDIRECTS = 4
MAX_STRIPES = 64  # parents a WELCOME may name (one link each)
CHECKSUM_GIVE_UP = 4  # chunks failing verification, none verified since, for CHECKSUM_STALL s: every source is bad
CHECKSUM_STALL = 5.0


def repeating(message: str, cause: str) -> P2PError:
    """A P2PError for a cause that repeats (``modelcache.CAUSES``), which the model cache remembers."""
    e = P2PError(message)
    e.cause = cause
    return e


def parse_addr(addr: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """'HOST[:PORT]' -> (host, port)."""
    addr = addr.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or host.count("[") != host.count("]"):  # no port (an IPv6 address's colons are in brackets)
        host, port = addr, default_port
    try:
        port = int(port)
    except ValueError:
        port = -1
    if not valid_host(host) or not 0 < port < 65536:
        raise P2PError(f"bad address {addr!r}: expected HOST[:PORT], PORT in 1-65535")
    return host, port


def local_ip_towards(host: str) -> str:
    """The address of this host on the route to ``host`` (no packet is sent).

    Through ``_socket``, the C module under ``socket``: importing ``socket`` itself builds its enums, 2 ms
    of every join's start-up, paid by every host of a broadcast at once."""
    import _socket

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        s.connect((host, 9))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


class Seeder:
    """A running seeder: serves the checkpoint at ``path`` and runs the tracker."""

    reread_at_close: int | None = None  # ``reread`` as the I/O threads ended

    def __init__(self, path, *, port: int = DEFAULT_PORT, host: str = "0.0.0.0",
                 chunk_size: int | None = None, topology: str = DEFAULT_PLAN, hash: str = "xxh3_64",
                 advertise: str | None = None, window: int = DEFAULT_WINDOW, key: keys.FleetKey | None = None,
                 max_peers: int = 10_000, manifest: str | None = None, exclude=(),
                 s3_concurrency: int = 16, s3_range_size: int = 8 << 20, cache: ModelCache | None = None,
                 probe_port: int = 0, member_timeout: float = MEMBER_TIMEOUT, child_timeout: float = CHILD_TIMEOUT,
                 max_per_host: int = MAX_PER_HOST, tracker: str | None = None, io_threads: int | None = None):
        from .sources.chunker import build  # the seeder's parts: a join never imports them (start-up is on the clock)
        from .swarm.tracker.topology import make as make_topology
        from .swarm.tracker.tracker import Tracker
        self.path = self.url = os.fspath(path)  # url: the origin as given (a standalone tracker knows it so)
        origin = etags = None
        if not os.path.exists(self.path) and hfcache.parse_repo_ref(self.path):  # ORG/NAME[@REVISION]
            self.path, origin = hfcache.resolve(self.path)
        path = self.path
        # a hub cache snapshot: record its repo, commit and etags
        snapshot = None if self.path.startswith("s3://") else hfcache.snapshot_of(path)
        if snapshot is not None:
            origin = dict(snapshot[0], **(origin or {}))
            etags = snapshot[1]
        self.exclude = tuple(exclude)
        # entries not served (SKIPPED_DIRS, ``exclude``); an object store's listing skips them silently
        self.skipped = [] if self.path.startswith("s3://") else scan_checkpoint(path, self.exclude).skipped
        self.key = key
        self.topology = make_topology(topology)  # a bad name fails before the scan
        t0 = time.monotonic()
        self.source = self.s3 = None
        if self.path.startswith("s3://"):  # an object store: boto3 is imported only here
            from .sources.objstore import S3Checkpoint

            self.s3 = S3Checkpoint(self.path, s3_concurrency, s3_range_size)
            known = self.s3.check(_read_manifest(manifest), manifest) if manifest else None
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
            from .origin import member_of
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

    def _listen(self, host: str, port: int, probe_port: int, key, io_threads: int | None = None):
        """The ROUTER peers and members reach (``self.port``) and the probe sink (``self.probe_sink``);
        P2PError, with nothing left open, where either cannot listen.  ``io_threads``: libzmq's
        (``wire.context.default_io_threads()`` by default)."""
        self.ctx = node_context(io_threads)
        self.gate = keys.gate(self.ctx, key)  # ZAP allow-list, before any keyed socket exists
        router = None
        try:
            router, self.port = bind_router(self.ctx, host, port, key)
            self.probe_sink = _probe_sink(host, probe_port)
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


def _probe_sink(host: str, port: int):
    """The seeder's ``uplink.ProbeSink`` on host:port; with port 0 any free one, or None where none
    can listen (joiners then go unprobed, and the rate reviews find slow hosts)."""
    from .swarm.node.uplink import ProbeSink

    try:
        return ProbeSink(host, port)
    except OSError as e:
        if port:
            raise P2PError(f"cannot listen on {host}:{port} for uplink probes (--probe-port): {e}") from None
        log.warning("no uplink probe sink on %s (%s): slow hosts are found by their rates alone", host, e)
        return None


def _read_manifest(manifest_path: str) -> Manifest:
    try:
        with open(manifest_path, "rb") as f:
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
    path: str | None = None  # the directory holding the copy (--out, the model cache's, a hub cache repo folder)
    snapshot: str | None = None  # with hf_cache: the snapshot directory, once complete
    model_cache: ModelCache | None = None
    lock = None  # the modelcache.CopyLock on the copy, held until close
    finishing = ()  # callables run once when the copy is complete (publish the HF snapshot, note the use)

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

    def arrivals(self) -> list[list] | None:
        """Each verified chunk as ``[seconds since join(), chunk, from rank, planned rank]``, in arrival
        order (a rank of None: no planned source then); None unless joined with ``trace=True``."""
        got = self.node.stats.arrivals
        return None if got is None else [[round(t - self.started, 4), i, r, p] for t, i, r, p in list(got)]

    @property
    def stats(self):
        return self.node.stats

    def threads(self) -> dict:
        """CPU seconds of this process's threads by role so far: ``loop`` (the node's event loop), ``zmq_io``
        (libzmq's I/O threads), ``workers`` (byte-path threads off the loop), ``finisher`` (fsyncs and renames),
        ``main`` and ``other`` (threads that have ended among them); ``loop_us_per_chunk``: the loop's CPU
        microseconds per chunk received; ``loop_passes``: its polls (near one a chunk, it woke for each chunk,
        and the wakes weigh in its CPU); ``workers``: the pool's threads, ``io_threads``: libzmq's,
        ``zmq_io_each``: CPU seconds of each of them, ``lanes``: connections pulled over per partner,
        ``lane_chunks``: chunks received on each (the links first), ``checked_on_loop``: chunks the loop
        verified itself (no workers), ``waited_for_workers``: times it waited for one (every one busy)."""
        roles = dict.fromkeys(("loop", "zmq_io", "workers", "finisher", "main", "other"), 0.0)
        io_each = []
        usage = resource.getrusage(resource.RUSAGE_SELF)
        roles["other"] = usage.ru_utime + usage.ru_stime  # less each live thread's below: what ended threads used
        loop = self.node.thread.native_id if self.node.thread is not None else None
        tick = os.sysconf("SC_CLK_TCK")
        import threading  # Python's threads (loop, workers, finisher, main) are read to the ns, not in clock ticks

        clocks = {t.native_id: t.ident for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    comm, fields = f.read().rsplit(")", 1)
                cpu = sum(map(int, fields.split()[11:13])) / tick
                if int(tid) in clocks:
                    cpu = time.clock_gettime(time.pthread_getcpuclockid(clocks[int(tid)]))
            except OSError:
                continue  # ended meanwhile
            comm = comm.partition("(")[2]
            role = ("loop" if int(tid) == loop else "main" if int(tid) == os.getpid() else
                    "zmq_io" if comm.startswith("ZMQbg/IO") else "workers" if comm.startswith("p2pw-worker") else
                    "finisher" if comm.startswith("p2pw-finish") else "other")
            roles[role] += cpu
            roles["other"] -= cpu
            if role == "zmq_io":
                io_each.append(round(cpu, 3))
        roles["other"] = max(roles["other"], 0.0)  # (clock ticks against microseconds)
        got = self.node.stats.chunks_received
        return {"threads": {k: round(v, 3) for k, v in roles.items()},
                "loop_us_per_chunk": round(roles["loop"] * 1e6 / got, 1) if got else None,
                "loop_passes": self.node.stats.loop_passes,
                "workers": self.node.intake.pool.size, "io_threads": self.node.ctx.get(zmq.IO_THREADS),
                "zmq_io_each": io_each, "lanes": self.node.pull_lanes,
                "lane_chunks": self.node.stats.lane_chunks[:max(self.node.pull_lanes, 1)],
                "checked_on_loop": self.node.intake.on_loop,
                "waited_for_workers": self.node.intake.pool.waits}

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
            have = sum(self.store.have[chunks.start:chunks.stop])
            raise TimeoutError(f"bytes [{lo}, {hi}) not complete after {timeout} s: "
                               f"{have} of {len(chunks)} chunks verified")

    def _wait(self, chunks, timeout) -> bool:
        try:
            return self.store.wait_chunks(chunks, timeout)
        except StoreClosed as e:
            raise P2PError(str(e)) from None

    def wait(self, timeout: float | None = None) -> None:
        """Return once the whole blob is verified (and, with ``out``, on disk under its final names).

        Fails (``P2PError``, cause ``checksums``) when CHECKSUM_GIVE_UP chunks failed verification and none
        verified since, for CHECKSUM_STALL s: every source sends bad bytes.  A repeating cause is remembered by the model cache, if any."""
        try:
            self._wait_complete(timeout)
        except P2PError as e:
            failed = self.model_cache.failed if self.model_cache is not None else None
            if getattr(e, "cause", None) == "checksums" and failed is not None:
                failed.bad_sources(self.model_id, str(e), self.node.tracker_addr, getattr(e, "sources", ()))
            elif getattr(e, "cause", None) and failed is not None:
                failed.remember(self.model_id, e.cause, str(e))
            raise
        for step in self.finishing:
            step()
        self.finishing = ()

    def _wait_complete(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = range(self.manifest.n_chunks)
        seen, bad_since, moved = self.store.count, 0, time.monotonic()
        while not self._wait(chunks, 0.25):
            st = self.node.stats
            if self.store.count != seen:
                seen, bad_since, moved = self.store.count, st.bad_chunks, time.monotonic()
            elif st.bad_chunks - bad_since >= CHECKSUM_GIVE_UP and time.monotonic() - moved > CHECKSUM_STALL:
                bad = sorted(dict(st.bad_from))
                message = (f"every source failed its checksums: {st.bad_chunks - bad_since} chunks in a row failed "
                           f"verification, none verified in between ({self.store.count} of "
                           f"{self.manifest.n_chunks} verified; bad chunks from {', '.join(bad) or 'unknown'})")
                self.node.fail(message)
                e = repeating(message, "checksums")
                e.sources = bad  # the failure is remembered for these sources only
                raise e
            if deadline is not None and time.monotonic() > deadline:
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

    def close(self, linger: bool | float = False, timeout: float | None = None) -> None:
        """Stop.  With ``linger``, first keep serving until the tracker says no peer depends on us (by
        plan, or as a partner still missing chunks: for a quarter of our download's time, or for ``linger``
        seconds after our copy was complete where it is a number)."""
        if linger is not False and not self.node.fatal:
            if linger is not True and self.node.member is not None:
                self.node.member.linger = float(linger)
            self.node.post(b"leave")
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
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


MAX_STATUS_BYTES = 8 << 20  # a STATUS_REPLY larger than this is refused


def status(addr: str, *, key: keys.FleetKey | None = None, timeout: float = 5.0, model_id: str | None = None) -> dict:
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
            ask = protocol.control(Msg.STATUS, **({"model_id": model_id} if model_id else {}))
            if not _send_and_wait(sock, addr, ask, timeout, key):
                raise P2PError(_no_answer(addr, timeout, " (with --key if the fleet is keyed)"))
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
        except BaseException as e:
            sock.close(0)
            if isinstance(e, P2PError):
                e.answered_by = addr  # the node whose answer ended the join: a refusal is remembered for it
            raise
    raise P2PError(f"too many redirects joining through {addr}")


def _send_and_wait(sock, addr: str, frame: bytes, timeout: float, key) -> bool:
    """Connect ``sock`` to ``addr``, send ``frame``, wait for an answer; P2PError if the link is refused."""
    watch = keys.LinkWatch(sock, addr, key)
    sock.connect(tcp(addr))
    sock.send(frame)
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > WAIT_REPORT:  # a line every WAIT_REPORT s while we wait
            if watch.wait(WAIT_REPORT):
                return True
            log.warning("no answer from %s yet: trying for %g s more", addr,
                        round(max(0.0, deadline - time.monotonic()), 1))
        return watch.wait(max(0.0, left))
    except keys.LinkRefused as e:
        raise P2PError(str(e)) from None
    finally:
        watch.close()


def _no_answer(addr: str, timeout: float, hint: str = "") -> str:
    """Why ``addr`` said nothing: a name that does not resolve (ZeroMQ retries one silently: it may come up,
    as a Kubernetes service's does), else nobody there."""
    import socket  # only once nothing answered: a join's start-up never looks a name up itself

    host = addr.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        return f"no answer from {addr} within {timeout:g} s: the name {host!r} does not resolve ({e})"
    return f"no answer from {addr} within {timeout:g} s: is a p2pw seeder or peer running there{hint}?"


def _hello(sock, addr: str, hello: dict, timeout: float, key):
    """Send HELLO on ``sock`` to ``addr`` and return the answer: WELCOME or REDIRECT, else P2PError."""
    if not _send_and_wait(sock, addr, protocol.control(Msg.HELLO, **hello), timeout, key):
        raise P2PError(_no_answer(addr, timeout))
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
        return Manifest.from_wire(bytes(event.payload), expect_id=model_id)
    except ManifestError as e:
        raise P2PError(str(e)) from None


def _wire(node, store, cache, link, tracker_addr: str, welcome: dict, device, started: float, out, origin=None):
    """Connect a joined node to its plan, its copy on disk, its device sink and the origin (``origin.Origin``:
    a standalone tracker's swarm); returns the loader."""
    manifest = store.manifest
    recovered = cache.recover(store) if cache is not None else []
    for index in recovered:  # chunks an earlier run left on disk: verified again, never fetched again
        node.pull.verified(index)
    node.attach_tracker(link, tracker_addr, welcome["rank"], welcome.get("uplink_probe"), welcome.get("secret"))
    partners = welcome.get("partners") if isinstance(welcome.get("partners"), list) else []
    node.partners.set_plan(welcome["parents"], partners, welcome["stripes"])
    if cache is not None:
        cache.on_error = node.fail
        cache.on_finished = lambda: node.post(b"wake")  # DONE goes out now, not at the loop's next timeout
        node.extra_done.append(cache.finished.is_set)
        store.sinks.append(cache)
    loader = None
    if device is not None:
        from .storage.device import Loader

        loader = Loader(node, store, device, started)
    for index in recovered:
        store.verified(index)
    if origin is not None:  # after the recovered chunks: a reader tells the tracker what it holds
        origin.serve(node)
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
         key: keys.FleetKey | None = None, parent_timeout: float = PARENT_TIMEOUT, workers: int | None = None,
         io_threads: int | None = None, lanes: int | None = None, give_up_after: float = GIVE_UP_AFTER,
         verify: str = "marker", memory_budget: int | None = None, cache: ModelCache | None = None,
         hf_cache: str | None = None, retry_now: bool = False, trace: bool = False, origin=None,
         agent: str | None = None, **limits) -> Download | Attached:
    """Attach to the broadcast that ``parent`` (the seeder or any peer, 'HOST[:PORT]') belongs to.

    Returns at once with a ``Download`` whose chunks fill in the background.  ``out``: write the checkpoint's files
    there; they are the store (mapped), each final as soon as it is verified, ``out/.p2pw/complete.json`` once all
    are; a copy whose marker matches is served at once, unless ``verify='full'`` (re-hash what is there).  Without
    ``out``, the blob lives in memory, or in an unlinked temporary file when larger than ``memory_budget`` bytes
    (default: half the memory available).  ``model_id``: refuse any other checkpoint.  ``connect_timeout``: how long
    to keep trying a parent that is not up yet.  ``parent_timeout``: a parent silent this long is given up for
    another (the tracker names it).  ``give_up_after``: fail once no chunk has arrived from anyone for this long
    (the seeder and every holder gone); verified chunks stay on disk for a resume.  ``device`` ('cpu', 'cuda:N'):
    stream verified chunks into one buffer there, for ``wait_tensor`` / ``iter_tensors`` / ``state_dict``.  ``key``
    (``keys.load(DIR)``): CURVE-encrypt and authenticate every link.  ``cache`` (``ModelCache``): without ``out``,
    the copy goes to (or is found complete in) the cache, which evicts first under its size and remembers repeating
    failures (``retry_now`` ignores them).  ``hf_cache`` (a hub cache directory): the copy in the Hugging Face
    layout there (``hfcache``).  ``trace``: keep when and from whom each chunk verified (``Download.arrivals``).
    ``limits``: ``swarm.tracker.admission``'s.  ``origin`` (``origin.Origin``): ``parent`` is a standalone tracker; with its
    ``source``, this host reads the shares of the origin it is handed.  ``workers``, ``io_threads``, ``lanes``: threads
    that verify and write received chunks beside the loop, libzmq's that carry bytes, connections to pull over from
    each partner (``default_workers``, ``wire.context``, ``swarm.node.lanes``).

    One download per folder on a host: while another local process writes ``out`` (``localcopy``), this returns an
    ``Attached`` that reads that copy's files as they are verified, fetching nothing.

    ``agent`` (the node agent's cache directory, ``p2pw agent --cache DIR``): ask the agent for ``model_id`` (else
    ``parent``, a URL or a model id) and return an ``Attached`` to its copy; the agent fetches it once for the host.
    """
    if agent is not None:
        from .storage.agentcopy import through_agent

        return through_agent(agent, model_id or parent, model_id, device)
    started, workers = time.monotonic(), default_workers() if workers is None else workers
    where = _destination(out, cache, hf_cache)
    if model_id is not None and cache is not None and not retry_now:
        _refuse_remembered(cache, model_id, where)
    model_id, p_host, parent = _checked(model_id, device, parent, advertise)
    held = claim_copy(out, model_id) if out is not None else None  # the folder's writer, reader or neither
    if held is not None and held.mode == "attach":
        return Attached(out, model_id, device)
    ctx, gate, router, my_port = _bound(host, port, key, held, io_threads)
    me = advertise or local_ip_towards(p_host)
    peer_id = peer_id or f"{os.uname().nodename}-{os.urandom(4).hex()}"
    hello = {"peer_id": peer_id, "listen": f"{me}:{my_port}", "model_id": model_id, **(origin.hello if origin else {})}
    try:
        link, tracker_addr, welcome, manifest = _handshake_remembered(ctx, parent, hello, model_id,
                                                                      connect_timeout, key, cache, retry_now, where)
        disk, store, lock, target, layout = _open_copy(manifest, out, cache, hf_cache, verify, memory_budget,
                                                       where, ring=device is None, held=held, workers=workers)
    except Exception:
        router.close(0)
        gate and gate.stop()
        ctx.destroy(0)
        held and held.release()
        raise
    cache, model_cache = disk, cache
    node = Node(ctx, router, manifest, store, peer_id=peer_id, window=window, workers=workers, lanes=lanes,
                key=key, parent_timeout=parent_timeout, hello=hello, give_up_after=give_up_after, **limits)
    node.stats.arrivals = [] if trace else None
    try:
        loader = _wire(node, store, cache, link, tracker_addr, welcome, device, started, target, origin)
    except Exception:
        node._close_sockets()
        gate and gate.stop()
        ctx.destroy(0)
        lock and lock.release()
        raise
    node.start()
    _name_thread(node.thread.native_id, "p2pw-loop")
    cache and cache.thread and _name_thread(cache.thread.native_id, "p2pw-finish")
    dl = Download(node, store, cache, welcome, started, hello["listen"])
    dl.loader, dl.gate, dl.path, dl.lock, dl.model_cache = loader, gate, target, lock, model_cache
    dl.finishing = [lambda: _finished(dl, layout, origin.url if origin is not None else None)]
    return dl


def _bound(host: str, port: int, key, held, io_threads: int | None = None):
    """A join's context (``io_threads`` I/O threads), its ZAP gate (keyed) and its router listening on
    ``host:port``; ``held`` (the copy's claim) is let go if the port cannot be had."""
    ctx = node_context(io_threads)
    gate = keys.gate(ctx, key)
    try:
        router, my_port = bind_router(ctx, host, port, key)
    except P2PError:
        gate and gate.stop()
        ctx.term()
        held and held.release()
        raise
    return ctx, gate, router, my_port


def _name_thread(tid: int, name: str) -> None:
    """Name thread ``tid`` of this process as ``top`` and /proc show it (best effort)."""
    try:
        with open(f"/proc/self/task/{tid}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _checked(model_id, device, parent: str, advertise):
    """``join``'s arguments, checked before anything opens: (the full model id, the parent's host, HOST:PORT)."""
    if device is not None:
        from .storage.device import parse_device  # imports torch: only when a device is asked for
        parse_device(device)
    if model_id is not None:
        try:
            model_id = check_model_id(model_id)
        except ManifestError as e:
            raise P2PError(str(e)) from None
    p_host, p_port = parse_addr(parent)
    if advertise is not None and not valid_host(advertise):
        raise P2PError(f"bad --advertise {advertise!r}: expected the HOST (a name or an address) peers reach this "
                       "one at")
    return model_id, p_host, f"{p_host}:{p_port}"


def _handshake_remembered(ctx, parent, hello, model_id, timeout, key, cache, retry_now, where):
    """``_handshake``, with the model cache's failure memory: an id the seeder refuses is remembered, and a
    model that failed lately (for a repeating cause) is refused here unless ``retry_now``.  A refusal is
    remembered for the node that answered it (``FailureMemory.refused``)."""
    if model_id is not None and cache is not None and not retry_now:
        _refuse_remembered(cache, model_id, where, tracker=parent)
    try:
        link, tracker_addr, welcome, manifest = _handshake(ctx, parent, hello, model_id, timeout, key)
    except P2PError as e:
        if "model id mismatch" in str(e) and model_id is not None and cache is not None:
            cache.failed.refused(model_id, str(e), getattr(e, "answered_by", parent), keyed=key is not None)
        raise
    if cache is not None and not retry_now:
        try:
            _refuse_remembered(cache, manifest.model_id, where, tracker_addr, _planned_sources(welcome, tracker_addr))
        except P2PError:
            link.close(0)
            raise
    return link, tracker_addr, welcome, manifest


def _planned_sources(welcome: dict, tracker_addr: str) -> list[str]:
    """The addresses a WELCOME's plan names to pull from (a parent's empty address: the tracker), as a
    failure tied to sources (their chunks failed their checksums) compares them."""
    named = [p for key in ("parents", "partners") if isinstance(welcome.get(key), list) for p in welcome[key]]
    return sorted({(p.get("addr") or tracker_addr) for p in named if isinstance(p, dict)
                   and isinstance(p.get("addr", ""), str) and p.get("rank") != welcome.get("rank")})


def _destination(out, cache, hf_cache) -> str:
    """Where a join writes, as failures tied to a place (not enough disk) remember it."""
    if hf_cache is not None:
        return "hf:" + os.path.abspath(hf_cache)
    if out is not None:
        return os.path.abspath(out)
    return cache.models if cache is not None else "memory"


def _refuse_remembered(cache: ModelCache, wanted: str, where: str, tracker: str | None = None,
                       sources=None) -> None:
    """P2PError with the remembered reason if a join of ``wanted`` into ``where`` (through ``tracker``, pulling
    from ``sources``) failed lately for a repeating cause."""
    rec = cache.failed.blocking(wanted, where, tracker, sources)
    if rec is not None:
        raise P2PError(describe_failure(rec, cache.failures))


def _open_copy(manifest, out, cache, hf_cache, verify, memory_budget, where, ring: bool, held=None, workers=0):
    """The copy this join writes: ``(DiskCache or None, Store, CopyLock or None, directory, layout)``.

    ``held``: the ``localcopy.CopyClaim`` on ``out``, which becomes the copy's lock and publishes each verified
    chunk to local readers.

    ``ring``: files on disk are received, written and served through a ``ring.ChunkRing`` where they can be
    written around the page cache (not for a device sink, which reads the store later, on its own thread), with
    a slot more for each chunk ``workers`` threads may still verify and write; it grows with the rate to an eighth
    of ``memory_budget`` (``ring.ring_budget``).

    In the model cache's own folder, room is made first (eviction); the copy is locked for writing and
    the cache told of it.  Nothing is left behind on failure; not enough disk is remembered."""
    target, names, layout = _place(manifest, out, cache, hf_cache)
    fresh = target is not None and not os.path.exists(target)
    disk, lock = None, held
    try:
        if target is not None and cache is not None:
            if layout == "files" and out is None:  # the cache's own folder: make room under its size first
                for e in cache.make_room(sum(f["size"] for f in manifest.files), manifest.model_id):
                    log.warning("evicted model %s (%s, %d bytes) from the cache to make room",
                                e.model_id[:16], e.name or e.path, e.bytes)
            lock = held or cache.hold(target, write=True, complete=lambda: marker_matches(
                manifest, target, copy_paths(manifest, target, names)))
            cache.remember(manifest, target, layout)
        # with out, the destination files are the store (mapped); else memory, or a temp file over the budget
        disk = DiskCache(manifest, target, verify=verify, names=names, direct=ring) if target is not None else None
        slots = (ChunkRing(manifest.chunk_size, busy=in_flight_limit(workers),
                           most=ring_budget(manifest.chunk_size, memory_budget)) if disk and disk.direct else None)
        store = (Store(manifest, disk.filemap.buffer, files=disk, ring=slots) if disk is not None
                 else Store(manifest, blob_backing(manifest.total_size, memory_budget)))
        if held is not None:
            store.sinks.append(held.publish(manifest))
    except Exception as e:
        disk and disk.close()
        lock and lock.release()
        if disk is None and fresh and os.path.isdir(target) and os.listdir(target) == [STATE_DIR]:
            remove_tree(target)  # made for this join, holds nothing
        if cache is not None and isinstance(e, (SpaceError, CacheTooSmall)):
            cache.failed.remember(manifest.model_id, "disk", str(e), where=where)
        raise
    return disk, store, lock, target, layout


def _place(manifest, out, cache, hf_cache):
    """(directory of the copy or None for memory, file names there or None, layout) for this join."""
    if hf_cache is not None:
        return hfcache.repo_dir(manifest, hf_cache), hfcache.blob_names(manifest), "hf"
    if out is not None:
        return os.path.abspath(out), None, "files"
    if cache is None:
        return None, None, "memory"
    known = cache.find_complete(manifest.model_id)
    return (known[1] if known else cache.copy_dir(manifest.model_id)), None, "files"


def _finished(dl: Download, layout: str, url: str | None = None) -> None:
    """The copy is complete: publish the HF snapshot (blobs, symlinks, then the ref of the revision ``url`` asked
    for); tell the cache it was used."""
    if layout == "hf":
        dl.snapshot = hfcache.publish(dl.manifest, dl.path, hfcache.asked_revision(url, dl.manifest.origin["repo"]))
    if dl.lock is not None:
        dl.lock.share()
    if dl.model_cache is not None and dl.path is not None:
        fetched = dl.node.stats.chunks_received > 0
        dl.model_cache.used(dl.model_id, fetch_seconds=dl.seconds if fetched else None)
        dl.model_cache.failed.clear(dl.model_id)


def local_copy(model_id: str, cache: ModelCache, out: str | None = None, hf_cache: str | None = None):
    """The directory of a complete copy of ``model_id`` (an id or a prefix) that the cache knows, for a join
    that need not ask anyone: in ``out``, in the hub cache ``hf_cache`` (its snapshot directory, symlinks and
    ref written again if missing), or anywhere, and its manifest; None if there is none.  Costs the marker
    check."""
    try:
        wanted = check_model_id(model_id)
    except ManifestError as e:
        raise P2PError(str(e)) from None
    if hf_cache is not None:
        found = cache.find_complete(wanted, hf_cache, "hf")
    else:
        found = cache.find_complete(wanted, out, "files")
    if found is None:
        return None
    manifest, path, layout = found
    cache.used(manifest.model_id)
    cache.failed.clear(manifest.model_id)
    return (hfcache.publish(manifest, path) if layout == "hf" else path), manifest
