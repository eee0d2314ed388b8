"""Origin: fleets with no seeder, around a standalone tracker (``p2pw tracker``).

The tracker keeps the manifests published for each origin's URL (``publish``,
``candidate``), a hint, not an authority.  ``p2pw get URL --tracker HOST`` takes
only a manifest it can trust (``trusted``: the id it was given, one it checked
against the origin, or a keyed fleet's), opens the origin if this host can read
it (``open_source``: an ``s3://`` prefix whose objects have the manifest's
sizes and ETags, a path whose files have its sizes and first and last chunks,
a Hugging Face repo in the local hub cache), and joins the swarm as an
ordinary peer, reading the shares of the origin the tracker hands it when it
can (``Origin.serve``).  ``p2pw seed PATH --tracker
HOST`` publishes its manifest and joins as a reader that serves what it reads
and pulls nothing (``member_of``); several seeders of one model share the reading.
"""
from __future__ import annotations

import logging
import math
import os
import time

import zmq

from .errors import P2PError, UserError
from .sources.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, check_model_id
from .wire import keys, protocol
from .wire.context import node_context
from .wire.protocol import Msg, ProtocolError

log = logging.getLogger("p2pw")

LOOKUP_EVERY = 1.0  # seconds between LOOKUPs while no manifest is published for the URL
SAY_EVERY = 10.0  # seconds between lines saying so


class Origin:
    """A model's origin as a member of its swarm sees it: the URL, the manifest, and a reader (``source``,
    None where this host cannot read the origin)."""

    def __init__(self, url: str, manifest: Manifest, source=None):
        self.url, self.manifest, self.source = url, manifest, source

    def serve(self, node) -> None:
        """``node`` (joined, not started) publishes the manifest again to a restarted tracker, and, with a
        source, reads the shares it is handed and tells the tracker what it holds."""
        from .swarm.node.originread import attach

        node.member.publishes = (self.url, self.manifest.wire_bytes())
        if self.source is not None:
            attach(node, self.source)
            node.member.report_held()

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read if self.source is not None else 0

    @property
    def hello(self) -> dict:
        """What a HELLO adds: ``origin`` where this host reads the origin."""
        return {"origin": True} if self.source is not None else {}


class NoAnswer(P2PError):
    """The tracker said nothing in time (down, restarting, or not there)."""


def _ask(tracker: str, frames: list, key, timeout: float, ctx=None):
    """Send ``frames`` to the tracker on a fresh connection; its answer (an Event)."""
    from .library.handshake import no_answer, parse_addr

    host, port = parse_addr(tracker)
    addr = f"{host}:{port}"
    own = ctx is None
    ctx = zmq.Context() if own else ctx
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MANIFEST_BYTES + (64 << 10))
        keys.secure_client(sock, key)
        if not _send_frames(sock, addr, frames, timeout, key):
            raise NoAnswer(no_answer(addr, timeout, " (a p2pw tracker, with --key if the fleet is keyed)"))
        try:
            return protocol.decode(sock.recv_multipart())
        except ProtocolError as e:
            raise P2PError(f"{addr} is not a compatible p2pw tracker: {e}") from None
    finally:
        sock.close(0)
        if own:
            ctx.term()


def _send_frames(sock, addr: str, frames: list, timeout: float, key) -> bool:
    from .swarm.node.node import tcp

    watch = keys.LinkWatch(sock, addr, key)
    try:
        sock.connect(tcp(addr))
        sock.send_multipart(frames)
        return watch.wait(timeout)
    except keys.LinkRefused as e:
        raise P2PError(str(e)) from None
    finally:
        watch.close()


def publish(tracker: str, url: str, manifest: Manifest, key=None, timeout: float = 30.0, ctx=None) -> str:
    """Tell the tracker at ``tracker`` that ``manifest`` is the origin's at ``url``; its model id."""
    event = _ask(tracker, [protocol.control(Msg.PUBLISH, url=url), manifest.wire_bytes()], key, timeout, ctx)
    if event.type == Msg.ERROR:
        raise P2PError(f"{tracker} refused the manifest of {url}: {event.fields['message']}")
    if event.type != Msg.PUBLISHED or event.fields["model_id"] != manifest.model_id:
        raise P2PError(f"{tracker} answered PUBLISH with {event.type.name} {event.fields}")
    return manifest.model_id


class Mismatch(P2PError):
    """The origin is readable here, and a manifest does not describe it."""


def candidate(tracker: str, url: str, key=None, timeout: float = 5.0, model_id: str | None = None,
              index: int = 0) -> tuple[Manifest, dict] | None:
    """Candidate ``index`` of the manifests published at ``tracker`` for ``url``, or the one of ``model_id`` (a
    64-hex ``url`` is a model id, never a URL), with the MANIFEST's fields (``count``, ``confirmed``); None if
    none is.  The manifest's hash is checked against the id asked for (or the tracker's word for it)."""
    want = model_id or (url if protocol.is_model_id(url) else None)
    ask = {"url": url, **({"model_id": want.lower()} if want and protocol.is_model_id_prefix(want) else {}),
           **({"index": index} if index else {})}
    event = _ask(tracker, [protocol.control(Msg.LOOKUP, **ask)], key, timeout)
    if event.type == Msg.ERROR:
        if "no manifest published" in str(event.fields.get("message")):
            return None
        raise P2PError(f"{tracker} refused the lookup of {url}: {event.fields['message']}")
    if event.type != Msg.MANIFEST:
        raise P2PError(f"{tracker} answered LOOKUP with {event.type.name}")
    try:
        m = Manifest.from_wire(bytes(event.payload), expect_id=want or event.fields["model_id"])
    except ManifestError as e:
        raise P2PError(f"{tracker}'s manifest for {url}: {e}") from None
    return m, event.fields


def lookup(tracker: str, url: str, key=None, timeout: float = 5.0, model_id: str | None = None) -> Manifest | None:
    """The manifest published at ``tracker`` for ``url`` (the first candidate, or ``model_id``'s), or None."""
    found = candidate(tracker, url, key, timeout, model_id)
    return found[0] if found is not None else None


def find(tracker: str, url: str, key=None, wait: float = 30.0, published: str | None = None,
         model_id: str | None = None) -> Manifest:
    """The manifest of ``url``: ``published`` (a manifest file) is published first if the tracker knows none;
    else the tracker's, asked again each second for up to ``wait`` seconds."""
    return _found(tracker, url, key, wait, published, model_id)[0]


def _found(tracker, url, key, wait, published, model_id) -> tuple[Manifest, dict]:
    from .sources.manifest import read_manifest

    if published is not None:
        m = read_manifest(published)
        if protocol.is_model_id(url):
            raise P2PError(f"--manifest is published under the origin's URL, not a model id ({url[:16]}...): give "
                           "the URL")
        deadline = time.monotonic() + wait
        if _answered(deadline, lambda: lookup(tracker, url, key, model_id=m.model_id)) is None:
            _answered(deadline, lambda: publish(tracker, url, m, key))
        return m, {"count": 1}
    deadline, said = time.monotonic() + wait, time.monotonic()
    while True:
        found = _answered(deadline, lambda: candidate(tracker, url, key, model_id=model_id))
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise P2PError(f"no manifest published for {url} at {tracker} after {wait:g} s: publish one "
                           f"(p2pw manifest {url} --tracker {tracker}, p2pw seed {url} --tracker {tracker}, or "
                           f"p2pw get {url} --manifest M)")
        if time.monotonic() - said >= SAY_EVERY:
            said = time.monotonic()
            log.warning("no manifest published for %s at %s yet: asking again for %.0f s more", url, tracker,
                        deadline - said)
        time.sleep(LOOKUP_EVERY)


def _answered(deadline: float, ask):
    """``ask()``, asked again while the tracker does not answer, until ``deadline`` (then its NoAnswer)."""
    said = False
    while True:
        try:
            return ask()
        except NoAnswer as e:
            if time.monotonic() + LOOKUP_EVERY > deadline:
                raise
            if not said:
                log.warning("%s: asking again for %.0f s more", e, deadline - time.monotonic())
                said = True
            time.sleep(LOOKUP_EVERY)


def trusted(tracker: str, url: str, key=None, *, wait: float = 30.0, published: str | None = None,
            model_id: str | None = None, read_origin: bool = True, opener=None, **reading) -> tuple[Manifest, object]:
    """The manifest of ``url`` this host can trust, and its reader of the origin (None where it reads none).

    Trusted is (a) the one whose hash is the id it was given (``model_id``, ``published``'s, a 64-hex ``url``);
    (b) a candidate it checked against the origin itself (``open_source``, strict), walking the tracker's
    candidates past those that do not match; (c) in a keyed fleet (``key``), the tracker's first where this host
    cannot read the origin.  Else one P2PError saying which to add.  ``opener(manifest, strict)`` opens the
    origin where ``url`` is not read as it is named (the agent's rules); ``open_source`` by default."""
    if opener is None:
        def opener(m: Manifest, strict: bool):
            return open_source(url, m, strict=strict, **reading)
    if model_id is not None:
        model_id = check_model_id(model_id)
    pinned = published is not None or model_id is not None or protocol.is_model_id(url)
    m, fields = _found(tracker, url, key, wait, published, model_id)
    if pinned:
        read = read_origin and not protocol.is_model_id(url)
        return m, opener(m, False) if read else None
    count, refused = max(1, int(fields.get("count") or 1)), []
    for index in range(count):
        if index:
            found = candidate(tracker, url, key, model_id=model_id, index=index)
            if found is None:
                break
            m = found[0]
        if not read_origin:
            break
        try:
            source = opener(m, True)
        except Mismatch as e:
            log.warning("the manifest of %s published at %s as model %s is not the origin's (%s): trying the next",
                        url, tracker, m.model_id[:16], str(e).splitlines()[0][:300])
            refused.append(m.model_id)
            continue
        if source is not None:
            return m, source
        break  # this host cannot read the origin: every candidate alike
    if refused:
        raise P2PError(f"none of the {len(refused)} manifests published for {url} at {tracker} describes the "
                       f"origin as this host reads it: publish its own (p2pw manifest {url} --tracker {tracker})")
    if key is not None:
        first = candidate(tracker, url, key, model_id=model_id)
        if first is None:
            raise P2PError(f"no manifest published for {url} at {tracker} any more")
        return first[0], None
    raise P2PError(f"the manifest of {url} published at {tracker} is not one this host can trust: give --model-id "
                   f"ID, credentials to read the origin, or --key")


def open_source(url: str, manifest: Manifest, s3_concurrency: int = 16, s3_range_size: int = 8 << 20,
                strict: bool = False):
    """A reader of the origin at ``url`` that still holds ``manifest``'s files, or None (said why) where this
    host cannot read it: no credentials, no such path, files changed since the manifest was made.

    ``strict`` (a manifest from the tracker, not pinned by id): where the origin is readable but ``manifest``
    does not describe it (a size, an ETag missing or not equal, a path's first or last chunk not its hash),
    Mismatch is raised instead."""
    from .sources.remote import is_remote
    from .sources.source import BlobSource

    def mismatch(e: Exception):
        if strict:
            raise Mismatch(str(e) or type(e).__name__) from None
        return _unread(url, e)

    try:
        if is_remote(url):
            from .sources.remote import checkpoint

            ckpt = checkpoint(url, s3_concurrency, s3_range_size)
            try:
                ckpt.check(manifest, "the published manifest", etags=strict)
            except UserError as e:  # ObjectStoreError: not these objects
                return mismatch(e)
            return ckpt.source(manifest.files)
        path = url
        if not os.path.exists(path):
            from .storage import hfcache

            if not hfcache.parse_repo_ref(url):
                raise P2PError(f"{url}: no such file or directory here")
            path, _ = hfcache.resolve(url)
        try:
            for f in manifest.files:
                full = os.path.join(path, f["name"]) if os.path.isdir(path) else path
                if os.path.getsize(full) != f["size"]:
                    raise P2PError(f"{full} is not the size the manifest says ({f['size']} bytes)")
            if strict and not _ends_match(path, manifest):
                raise P2PError(f"{path}: its first or last chunk is not the manifest's hash")
        except (P2PError, OSError) as e:
            return mismatch(e)
        return BlobSource(path, manifest.files)
    except (UserError, OSError, ImportError) as e:  # no credentials, access denied, no such bucket
        if isinstance(e, Mismatch):
            raise
        return _unread(url, e)


def _unread(url: str, e: Exception) -> None:
    """No reader of the origin here: said why, once."""
    log.warning("not reading the origin %s here (%s): taking every chunk from peers", url,
                str(e).splitlines()[0][:300] if str(e) else type(e).__name__)


def _ends_match(path: str, manifest: Manifest) -> bool:
    """Whether the first and last chunks of the files at ``path`` are ``manifest``'s (read here, not counted as
    the origin's reading): a manifest with the right sizes and other bytes' hashes is found out before any
    peer's copy is taken."""
    from .sources.manifest import chunk_hasher
    from .sources.source import BlobSource

    if not manifest.n_chunks:
        return True
    probe, digest = BlobSource(path, manifest.files), chunk_hasher(manifest.hash)
    try:
        for i in sorted({0, manifest.n_chunks - 1}):
            lo, hi = manifest.chunk_span(i)
            if not probe.read_chunk(manifest, i, memoryview(bytearray(hi - lo)), digest):
                return False
        return True
    finally:
        probe.close()


def member_of(s, tracker: str, *, host: str, port: int, advertise: str | None, window: int, key,
              connect_timeout: float = 30.0, io_threads: int | None = None, **limits) -> None:
    """Make seeder ``s`` (its manifest and store open) an origin reader of the standalone tracker's swarm: it
    publishes its manifest, joins, serves what it reads of the shares it is handed, and pulls nothing."""
    from .library.handshake import handshake, local_ip_towards, parse_addr
    from .sources.source import sending_read_bytes
    from .swarm.node.node import Node, bind_router

    t_host, t_port = parse_addr(tracker)
    tracker = f"{t_host}:{t_port}"
    s.ctx, s.probe_sink, s.tracker = node_context(io_threads), None, None
    s.gate = keys.gate(s.ctx, key)
    try:
        router, s.port = bind_router(s.ctx, host, port, key)
        me = parse_addr(advertise, s.port)[0] if advertise else local_ip_towards(t_host)
        publish(tracker, s.url, s.manifest, key, connect_timeout, s.ctx)
        hello = {"peer_id": f"seeder-{os.uname().nodename}-{os.urandom(4).hex()}", "listen": f"{me}:{s.port}",
                 "model_id": s.model_id, "origin": True, "pulls": False}
        link, tracker_addr, welcome, _ = handshake(s.ctx, tracker, hello, s.model_id, connect_timeout, key)
    except BaseException:
        s.gate and s.gate.stop()
        s.ctx.destroy(0)
        s.lock and s.lock.release()
        raise
    node = s.node = Node(s.ctx, router, s.manifest, s.store, peer_id=hello["peer_id"], window=window, key=key,
                         hello=hello, give_up_after=math.inf, **limits)
    node.partners.pulls = False  # a seeder serves what it reads; the swarm brings the rest to the peers
    node.attach_tracker(link, tracker_addr, welcome["rank"], welcome.get("uplink_probe"), welcome.get("secret"))
    partners = welcome.get("partners") if isinstance(welcome.get("partners"), list) else []
    node.partners.set_plan(welcome["parents"], partners, welcome["stripes"])
    s.origin = Origin(s.url, s.manifest, s.source)
    s.origin.serve(node)
    s.io_at_serve = sending_read_bytes() if s.s3 is None else None
    node.start()


class Tracking:
    """A running standalone tracker (``p2pw tracker``): ``port``, ``registry``, and ``node`` (its loop)."""

    model_id = ""  # many models: none names the process (its log lines, its metrics)

    def __init__(self, *, port: int = 7420, host: str = "0.0.0.0", key=None, topology: str = "forest:2",
                 advertise: str | None = None, max_peers: int = 10_000, member_timeout: float | None = None,
                 probe_port: int | None = None, max_per_host: int | None = None, publish_from: str | None = None,
                 state_dir: str | None = None):
        from .library.handshake import parse_addr
        from .swarm.node.uplink import probe_port_for, probe_sink
        from .swarm.node.node import bind_router
        from .swarm.tracker.registry import Registry
        from .swarm.tracker.topology import make
        from .swarm.tracker.publishers import Publishers
        from .swarm.node.trackerd import MAX_MESSAGE, TrackerServer

        if not hasattr(make(topology), "place"):  # a bad name fails before anything listens
            raise P2PError(f"--topology {topology}: a tracker with no seeder places forest:K plans only (a rule-based "
                           "plan hangs every tree off a seeder)")
        publishers = Publishers.parse(publish_from)
        state = kept = None
        if state_dir is not None:  # read before anything listens: a member finds every kept swarm open
            from .swarm.tracker.registry import MAX_SWARMS
            from .swarm.tracker.statedir import TrackerState
            try:
                state = TrackerState(state_dir, MAX_SWARMS)
                kept = state.load()
            except OSError as e:
                raise P2PError(f"--state-dir {state_dir}: {e.strerror or e}") from None
        self.ctx = zmq.Context()
        self.gate = keys.gate(self.ctx, key)
        try:
            router, self.port = bind_router(self.ctx, host, port, key, max_msg=MAX_MESSAGE)
        except BaseException:
            self.gate and self.gate.stop()
            self.ctx.term()
            raise
        self.probe_sink = probe_sink(host, probe_port_for(port, probe_port))
        root = "%s:%d" % parse_addr(advertise, self.port) if advertise else ""
        self.registry = Registry(lambda n: make(topology), root_listen=root, keyed=key is not None,
                                 member_timeout=member_timeout, max_peers=max_peers)
        if self.probe_sink is not None:
            self.registry.probe_port = self.probe_sink.port
        if kept is not None:
            self.registry.restore(kept.manifests, kept.urls, kept.opened)
        self.node = TrackerServer(router, self.registry, publishers=publishers, state=state,
                                  **({"max_per_host": max_per_host} if max_per_host else {}))
        self.node.start()

    def close(self) -> None:
        self.node.stop()
        if self.probe_sink is not None:
            self.probe_sink.close()
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
