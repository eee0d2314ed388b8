"""Registry: the swarms of a standalone tracker, one per model id, on one port (sans-IO).

A manifest arrives with PUBLISH (an origin's URL and the manifest's canonical
bytes, checked by the strict validator) and opens the swarm of its model id;
LOOKUP answers the manifest last published for a URL (or of a model id).  A HELLO names its
swarm by the full model id; from then on its connection speaks to that swarm
only (one member per connection, as in the seeder's tracker), so a peer of
one model is never placed with, nor told of, another's.  Each swarm is a
``rootless.RootlessTracker`` behind the seeder's own handlers
(``endpoint.TrackerEndpoint``: placement, partners, demotion, status) and the
origin shares of its readers (``shares.OriginShares``).

After a restart the registry is empty: members re-introduce themselves (a
HEARTBEAT from a connection that is no member is answered with an ERROR that
makes it do so at once), each first publishing its manifest again, and a
reader reports what it holds (READ), so the pool of chunks to read is rebuilt.
"""
from __future__ import annotations

import json
import logging
import time

from ..sources.manifest import Manifest, ManifestError
from ..wire import protocol
from ..wire.protocol import Msg, ProtocolError
from .endpoint import REVIEW_INTERVAL, TrackerEndpoint
from .rootless import RootlessTracker
from .shares import OriginShares

log = logging.getLogger("p2pw")

MAX_SWARMS = 256  # models one tracker serves at once; the least lately used one with no live member makes room
NOT_A_MEMBER = "not a member here (the tracker restarted?): introduce yourself"
NO_SWARM = "no swarm for model"


class Swarm:
    """One model's swarm: its tracker, the seeder's handlers over it, and its origin readers' shares."""

    def __init__(self, manifest: Manifest, topology, root_listen: str, clock, **kw):
        self.tracker = RootlessTracker(topology, root_listen, clock=clock, **kw)
        self.endpoint = TrackerEndpoint(self.tracker, manifest, clock)
        self.shares = OriginShares(manifest.n_chunks)
        self.used, self.next_sync = clock(), 0.0

    @property
    def live(self) -> int:
        return len(self.tracker.roster.live)

    def sync(self) -> None:
        """Readers gone since give back their shares; every reader at most half through its share gets more."""
        t = self.tracker
        for rank in self.shares.readers:
            m = t.members.get(rank)
            if m is None or m.left:
                self.shares.gone(rank)
                t.drop_reader(rank)
        if self.shares.orphans:  # read by readers that left: read again if nobody holds all and one still pulls
            live = [t.members[r] for r in t.roster.live if r not in t.sources]
            if not any(m.done for m in live) and any(not m.done for m in live):
                self.shares.reclaim()
        hungry = [r for r in self.shares.readers if self.shares.hungry(r)]
        complete = bool(hungry) and any(m.done and not m.left for m in t.members.values())
        for rank in hungry:
            chunks = self.shares.hand(rank, complete)
            ident = self.endpoint.ident_of(rank)
            if chunks and ident is not None:
                self.endpoint._send(ident, protocol.control(Msg.SHARE, chunks=chunks))


class Registry:
    """Swarms by model id, origin URLs to model ids, member connections to their swarm."""

    def __init__(self, make_topology, root_listen: str = "", clock=time.monotonic, keyed: bool = False,
                 member_timeout: float | None = None, max_peers: int = 10_000, max_swarms: int = MAX_SWARMS):
        self.make_topology, self.root_listen, self.clock = make_topology, root_listen, clock
        self.keyed, self.member_timeout, self.max_peers, self.max_swarms = keyed, member_timeout, max_peers, max_swarms
        self.swarms: dict[str, Swarm] = {}
        self.urls: dict[str, str] = {}  # origin URL -> model id of the manifest last published for it
        self.conns: dict[bytes, str] = {}  # member connection -> its swarm's model id
        self.out: list[tuple[bytes, list]] = []
        self.probe_port = 0

    def take(self) -> list[tuple[bytes, list]]:
        out, self.out = self.out, []
        for s in self.swarms.values():
            out += s.endpoint.take()
        return out

    def _send(self, ident: bytes, *frames) -> None:
        self.out.append((ident, list(frames)))

    def members(self):
        """Every member connection of every swarm (heartbeats go to each)."""
        return [i for s in self.swarms.values() for i in s.endpoint.members]

    def swarm_of(self, ident: bytes) -> Swarm | None:
        mid = self.conns.get(ident)
        return self.swarms.get(mid) if mid is not None else None

    def who(self, ident: bytes) -> str | None:
        s = self.swarm_of(ident)
        return s.endpoint.who(ident) if s is not None else None

    # ----- manifests ---------------------------------------------------------

    def publish(self, ident: bytes, f: dict, payload) -> bool:
        """PUBLISH: the manifest of the origin at ``url``; opens its swarm.  Answered PUBLISHED."""
        try:
            manifest = Manifest.from_wire(bytes(payload))
        except ManifestError as e:
            raise ProtocolError(f"PUBLISH of a manifest that is not valid: {e}") from None
        mid = manifest.model_id
        if mid not in self.swarms:
            if not self._room():
                self._send(ident, protocol.control(Msg.ERROR, fatal=True, message=(
                    f"this tracker serves {len(self.swarms)} models, each with live members: no room for another")))
                return False
            self.swarms[mid] = self._swarm(manifest)
            log.info("model %s published for %s: %d chunks of %d bytes", mid[:16], f["url"], manifest.n_chunks,
                     manifest.chunk_size)
        if self.urls.get(f["url"]) not in (None, mid):
            log.warning("%s now names model %s (it named %s)", f["url"], mid[:16], self.urls[f["url"]][:16])
        self.urls[f["url"]] = mid
        self.swarms[mid].used = self.clock()
        self._send(ident, protocol.control(Msg.PUBLISHED, model_id=mid))
        return ident in self.conns

    def _swarm(self, manifest: Manifest) -> Swarm:
        s = Swarm(manifest, self.make_topology(manifest.n_chunks), self.root_listen, self.clock,
                  max_peers=self.max_peers)
        s.endpoint.keyed, s.endpoint.probe_port = self.keyed, self.probe_port
        if self.member_timeout is not None:
            s.endpoint.member_timeout = self.member_timeout
        return s

    def _room(self) -> bool:
        """Whether a new swarm fits, evicting the least lately used swarm with no live member if need be."""
        if len(self.swarms) < self.max_swarms:
            return True
        idle = [(s.used, mid) for mid, s in self.swarms.items() if not s.live]
        if not idle:
            return False
        mid = min(idle)[1]
        del self.swarms[mid]
        self.urls = {u: m for u, m in self.urls.items() if m != mid}
        return True

    def lookup(self, ident: bytes, f: dict) -> bool:
        """LOOKUP: the manifest last published for ``url`` (MANIFEST), or an ERROR saying none is."""
        mid = self.urls.get(f["url"])
        if mid is None and f["url"].lower() in self.swarms:  # a model id: its swarm's manifest, by whatever URL
            mid = f["url"].lower()
        if mid is None or mid not in self.swarms:
            self._send(ident, protocol.control(Msg.ERROR, message=f"no manifest published for {f['url']}"))
        else:
            self._send(ident, protocol.control(Msg.MANIFEST, url=f["url"], model_id=mid),
                       self.swarms[mid].endpoint.manifest_frame)
        return False  # answered: the asker holds no state here

    # ----- members -----------------------------------------------------------

    def hello(self, ident: bytes, f: dict) -> bool:
        """HELLO for the swarm of its ``model_id``: joined through that swarm's endpoint; a reader registered."""
        mid = str(f.get("model_id") or "").lower()
        bound = self.conns.get(ident)
        if bound is not None and bound != mid:
            raise ProtocolError("HELLO for another model on a connection that joined one already")
        s = self.swarms.get(mid)
        if s is None:
            self._send(ident, protocol.control(Msg.ERROR, message=(
                f"{NO_SWARM} {mid[:64] or '(none named)'} here: publish its manifest first (p2pw seed PATH "
                "--tracker, p2pw manifest URL --tracker, or p2pw get URL --manifest M)")))
            return False
        if not s.endpoint.hello(ident, f):
            return False
        self.conns[ident] = mid
        s.used = self.clock()
        rank = s.endpoint.members[ident]
        if f.get("pulls") is False:
            s.tracker.pulls_nothing(rank)
        if f.get("origin") is True:
            s.shares.register(rank)
            s.tracker.add_reader(rank)
            s.endpoint._announce()
        s.sync()
        return True

    def read(self, ident: bytes, f: dict) -> None:
        """READ: chunks the reader holds now."""
        s = self.swarm_of(ident)
        rank = s.endpoint.members.get(ident) if s is not None else None
        if rank is None:
            raise ProtocolError("READ from a connection that never joined")
        n = s.endpoint.manifest.n_chunks
        if any(i >= n for i in f["chunks"]):
            raise ProtocolError(f"READ names chunk {max(f['chunks'])}; the blob has {n}")
        s.shares.held(rank, f["chunks"])
        s.sync()

    def status(self, ident: bytes, f: dict) -> bool:
        """STATUS: the swarm of ``model_id`` (or the only one); else a list of the swarms."""
        mid = str(f.get("model_id") or "").lower()
        found = [s for m, s in self.swarms.items() if m.startswith(mid)] if mid else list(self.swarms.values())
        if len(found) == 1:
            return found[0].endpoint.status(ident, f)
        swarms = [{"model_id": m, "urls": sorted(u for u, x in self.urls.items() if x == m),
                   "peers": s.live, "done": s.endpoint.fleet.done, "total_size": s.endpoint.manifest.total_size}
                  for m, s in sorted(self.swarms.items()) if not mid or m.startswith(mid)]
        doc = {"model_id": None, "n_chunks": 0, "total_size": 0, "count": 0, "peers": [], "swarms": swarms}
        self._send(ident, protocol.control(Msg.STATUS_REPLY, peers=0, shown=0), json.dumps(doc).encode())
        return False

    def route(self, ident: bytes, kind: Msg, f: dict) -> bool | None:
        """DONE, LEAVE, BYE, ORPHAN, HEARTBEAT, PROBE: to the sender's swarm.  A HEARTBEAT from a connection
        that is no member (a restarted tracker) is told to introduce itself."""
        s = self.swarm_of(ident)
        if s is None:
            if kind == Msg.HEARTBEAT:
                self._send(ident, protocol.control(Msg.ERROR, message=NOT_A_MEMBER))
                return False
            if kind == Msg.BYE:
                return False
            raise ProtocolError(f"{kind.name} from a connection that never joined")
        result = TrackerEndpoint.HANDLERS[kind](s.endpoint, ident, f)
        if kind == Msg.BYE:
            self.conns.pop(ident, None)
        if kind in (Msg.BYE, Msg.DONE, Msg.LEAVE, Msg.ORPHAN):
            s.sync()
        return result

    def forget(self, ident: bytes) -> None:
        """Connection ``ident`` is gone: a member of it is gone."""
        s = self.swarm_of(ident)
        if s is not None and ident in s.endpoint.members:
            s.endpoint.bye(ident)
            s.sync()
        self.conns.pop(ident, None)

    def review(self, now: float) -> None:
        """Each swarm's rate review and fleet snapshot; members silent too long dropped, their shares back."""
        for s in self.swarms.values():
            s.endpoint.review(0)
            s.endpoint.publish(now)
            if now >= s.next_sync:  # readers gone silently (dropped by the review) give their shares back
                s.next_sync = now + REVIEW_INTERVAL
                s.sync()
        live = {i for s in self.swarms.values() for i in s.endpoint.members}
        for ident in [i for i in self.conns if i not in live]:
            del self.conns[ident]

    HANDLERS = {Msg.HELLO: hello, Msg.READ: read, Msg.LOOKUP: lookup, Msg.STATUS: status}
