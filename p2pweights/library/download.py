"""Download: ``join(parent) -> Download``, a host's copy filling in the background as chunks are verified,
usable while it downloads (``wait_range``, ``wait_tensor``, ``iter_tensors``)."""
from __future__ import annotations

import logging
import os
import resource
import time

import zmq

from ..errors import P2PError
from ..sources.manifest import check_model_id, Manifest, ManifestError
from ..storage import hfcache
from ..storage.cache import DiskCache
from ..storage.localcopy import Attached, claim as claim_copy
from ..storage.modelcache import ModelCache
from ..storage.store import Store, StoreClosed
from ..storage.workers import default_workers
from ..swarm.node.node import bind_router, DEFAULT_WINDOW, GIVE_UP_AFTER, Node, PARENT_TIMEOUT
from ..wire import keys
from ..wire.context import node_context
from ..wire.protocol import valid_host
from .copies import _destination, _open_copy, _refuse_remembered
from .handshake import handshake, local_ip_towards, parse_addr

log = logging.getLogger("p2pw")


CHECKSUM_GIVE_UP = 4  # chunks failing verification, none verified since, for CHECKSUM_STALL s: every source is bad


CHECKSUM_STALL = 5.0


def repeating(message: str, cause: str) -> P2PError:
    """A P2PError for a cause that repeats (``modelcache.CAUSES``), which the model cache remembers."""
    e = P2PError(message)
    e.cause = cause
    return e


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
        from ..storage.device import Loader

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
        from ..storage.agentcopy import through_agent

        return through_agent(agent, model_id or parent, model_id, device, wait=connect_timeout)
    started, workers = time.monotonic(), default_workers() if workers is None else workers
    where = _destination(out, cache, hf_cache)
    if model_id is not None and cache is not None and not retry_now:
        _refuse_remembered(cache, model_id, where)
    model_id, p_host, parent = _checked(model_id, device, parent, advertise)
    held = claim_copy(out, model_id, write_wait=give_up_after) if out is not None else None  # writer, reader, neither
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
        from ..storage.device import parse_device  # imports torch: only when a device is asked for
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
    """``handshake.handshake``, with the model cache's failure memory: an id the seeder refuses is remembered, and a
    model that failed lately (for a repeating cause) is refused here unless ``retry_now``.  A refusal is
    remembered for the node that answered it (``FailureMemory.refused``)."""
    if model_id is not None and cache is not None and not retry_now:
        _refuse_remembered(cache, model_id, where, tracker=parent)
    try:
        link, tracker_addr, welcome, manifest = handshake(ctx, parent, hello, model_id, timeout, key)
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
