"""Registry: the swarms of a standalone tracker, one per model id, on one port (sans-IO).

A manifest arrives with PUBLISH (an origin's URL and the manifest's canonical
bytes, checked by the strict validator) and opens the swarm of its model id.
The tracker is a hint, not an authority: a URL keeps every candidate manifest
published for it (first come, at most MAX_CANDIDATES, PER_SOURCE from one
address), those an origin reader joined (confirmed) first, and a publish never
replaces a confirmed one; LOOKUP answers candidate ``index`` of a URL's, or
the swarm of a model id (a 64-hex ``url`` or ``model_id``: ids only), and the
asker checks what it is given.  One address opens at most MAX_OPENED swarms;
when the table is full, a swarm with no origin reader and no complete member
makes room first (an operator's, from ``--publish-from``, only for the operator).  A HELLO names its
swarm by the full model id; from then on its connection speaks to that swarm
only (one member per connection, as in the seeder's tracker), so a peer of
one model is never placed with, nor told of, another's.  Each swarm is a
``rootless.RootlessTracker`` behind the seeder's own handlers
(``endpoint.TrackerEndpoint``: placement, partners, demotion, status) and the
origin shares of its readers (``shares.OriginShares``).

After a restart the registry is empty, unless a state folder kept its manifests
and URL bindings (``statedir``: ``restore`` opens their swarms at once, ``kept``
is what to write back after each change, flagged by ``dirty``): members
re-introduce themselves (a HEARTBEAT from a connection that is no member is
answered with an ERROR that makes it do so), each first publishing its manifest
again, and a reader reports what it holds (READ), so the pool of chunks to read
is rebuilt.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from ...sources.manifest import Manifest, ManifestError
from ...wire import protocol
from ...wire.protocol import MAX_CANDIDATES, Msg, ProtocolError, is_model_id, is_model_id_prefix
from .endpoint import REVIEW_INTERVAL, TrackerEndpoint
from .rootless import RootlessTracker
from .shares import OriginShares, Progress

log = logging.getLogger("p2pw")

MAX_SWARMS = 256  # models one tracker serves at once; see ``Registry._room`` for which makes room
MAX_OPENED = 16  # swarms one source address may have opened at once (the operator's: no cap)
PER_SOURCE = 2  # candidate manifests one source address may hold under one URL
NOT_A_MEMBER = "not a member here (the tracker restarted?): introduce yourself"
NO_SWARM = "no swarm for model"


class Swarm:
    """One model's swarm: its tracker, the seeder's handlers over it, and its origin readers' shares."""

    def __init__(self, manifest: Manifest, topology, root_listen: str, clock, **kw):
        self.tracker = RootlessTracker(topology, root_listen, clock=clock, **kw)
        self.endpoint = TrackerEndpoint(self.tracker, manifest, clock)
        self.shares = OriginShares(manifest.n_chunks, clock=clock)
        self.progress = Progress(clock, every=REVIEW_INTERVAL)
        self.away: set[int] = set()  # readers that left or were dropped (one reported dead may speak again)
        self.doubted: set[int] = set()  # members that held every chunk, they said, while the fleet stalled
        self.used, self.next_sync = clock(), 0.0

    @property
    def live(self) -> int:
        return len(self.tracker.roster.live)

    def stalled(self) -> bool:
        """Whether an unfinished member that pulls verified nothing for ``CLAIM_BOUND`` (``shares.Progress``)."""
        t, n = self.tracker, self.endpoint.manifest.n_chunks
        return self.progress.stalled((r, t.members[r].have) for r in t.roster.live
                                     if r not in t.sources and not t.members[r].done and t.members[r].have < n)

    def sync(self) -> None:
        """Readers gone since give back their shares; while the fleet stalls, claims nobody vouched for go back
        (``shares``); every reader at most half through its share gets more, unless a member holds every chunk
        and the fleet has not stalled since it said so (a DONE is a hint, not a reason to stop reading the origin)."""
        t = self.tracker
        for rank in self.shares.readers:
            m = t.members.get(rank)
            if m is None or m.left:
                self.shares.gone(rank)
                t.drop_reader(rank)
                self.away.add(rank)
        for rank in [r for r in self.away if r in t.members and not t.members[r].left]:  # reported dead, alive
            self.away.discard(rank)
            self.shares.register(rank)
            t.add_reader(rank)
        stalled = self.stalled()
        back = self.shares.expire(stalled)
        if back:
            log.warning("%d claimed chunks held by no second reader while the fleet stalls: read again by others",
                        back.bit_count())
        done = [r for r in t.roster.live if t.members[r].done]
        if stalled:  # a complete holder while the fleet stalls pauses the readers no more
            self.doubted.update(done)
        complete = any(r not in self.doubted for r in done)
        if self.shares.orphans:  # read by readers that left: read again if nobody holds all and one still pulls
            live = [t.members[r] for r in t.roster.live if r not in t.sources]
            if (stalled or not any(m.done for m in live)) and any(not m.done for m in live):
                self.shares.reclaim()
        for rank in [r for r in self.shares.readers if self.shares.hungry(r)]:
            chunks = self.shares.hand(rank, complete)
            ident = self.endpoint.ident_of(rank)
            if chunks and ident is not None:
                self.endpoint._send(ident, protocol.control(Msg.SHARE, chunks=chunks))


@dataclass
class Candidate:
    """A manifest published for a URL: its model id, the address it came from, whether a reader confirmed it."""

    model_id: str
    source: str
    operator: bool = False
    confirmed: bool = False


class Registry:
    """Swarms by model id, origin URLs to their candidate manifests, member connections to their swarm."""

    def __init__(self, make_topology, root_listen: str = "", clock=time.monotonic, keyed: bool = False,
                 member_timeout: float | None = None, max_peers: int = 10_000, max_swarms: int = MAX_SWARMS,
                 max_opened: int = MAX_OPENED):
        self.make_topology, self.root_listen, self.clock = make_topology, root_listen, clock
        self.keyed, self.member_timeout, self.max_peers, self.max_swarms = keyed, member_timeout, max_peers, max_swarms
        self.max_opened = max_opened
        self.swarms: dict[str, Swarm] = {}
        self.urls: dict[str, list[Candidate]] = {}  # origin URL -> its candidate manifests, first come first
        self.opened: dict[str, Candidate] = {}  # model id -> who opened its swarm
        self.conns: dict[bytes, str] = {}  # member connection -> its swarm's model id
        self.out: list[tuple[bytes, list]] = []
        self.probe_port = 0
        self.dirty = False  # manifests or URL bindings changed since ``kept`` was last written
        self.joins = 0  # HELLOs welcomed: joins and re-introductions

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

    def publish(self, ident: bytes, f: dict, payload, source: str = "local", operator: bool = False) -> bool:
        """PUBLISH from address ``source`` (``operator``: a --publish-from one): a candidate manifest of the
        origin at ``url``; opens its swarm.  Answered PUBLISHED, or an ERROR saying which cap refused it."""
        try:
            manifest = Manifest.from_wire(bytes(payload))
        except ManifestError as e:
            raise ProtocolError(f"PUBLISH of a manifest that is not valid: {e}") from None
        mid, url = manifest.model_id, f["url"]
        if is_model_id(url):
            return self.refuse(ident, f"{url[:16]}... is a model id, not an origin's URL: publish under the URL")
        cand = Candidate(mid, source, operator)
        why = self._placed(url, cand, dry=True)
        if why is None and mid not in self.swarms:
            if not operator and sum(c.source == source for c in self.opened.values()) >= self.max_opened:
                why = f"{source} opened {self.max_opened} swarms here already (at most {self.max_opened} an address)"
            elif not self._room(operator):
                why = f"this tracker serves {len(self.swarms)} models, each with live members: no room for another"
        if why is not None:
            return self.refuse(ident, why)
        before = self._bound(url)
        if mid not in self.swarms:
            self.swarms[mid], self.opened[mid] = self._swarm(manifest), cand
            self.dirty = True
            log.info("model %s published for %s from %s: %d chunks of %d bytes", mid[:16], url, source,
                     manifest.n_chunks, manifest.chunk_size)
        self._placed(url, cand)
        self.dirty |= self._bound(url) != before
        self.swarms[mid].used = self.clock()
        self._send(ident, protocol.control(Msg.PUBLISHED, model_id=mid))
        return ident in self.conns

    def refuse(self, ident: bytes, why: str) -> bool:
        """One ERROR, ``why``, to ``ident``, which keeps no state here."""
        self._send(ident, protocol.control(Msg.ERROR, fatal=True, message=why))
        return False

    def _placed(self, url: str, cand: Candidate, dry: bool = False) -> str | None:
        """Put ``cand`` among ``url``'s candidates (``dry``: only say whether it fits); why not, or None.  One of its
        source's own unconfirmed ones makes way past PER_SOURCE, the oldest unconfirmed one past MAX_CANDIDATES;
        a confirmed or operator's candidate is never replaced."""
        cands = self.urls.get(url, [])
        same = [c for c in cands if c.model_id == cand.model_id]
        if same:
            if not dry:
                same[0].operator |= cand.operator
            return None
        spare = [c for c in cands if not (c.confirmed or c.operator)]
        if not cand.operator and sum(c.source == cand.source for c in cands) >= PER_SOURCE:
            spare = [c for c in spare if c.source == cand.source]
            if not spare:
                return f"{cand.source} published {PER_SOURCE} manifests for {url} already, each confirmed"
        elif len(cands) < MAX_CANDIDATES:
            spare = []
        elif not spare:
            return f"{url} has {len(cands)} manifests confirmed by its readers: no room for another"
        if not dry:
            if spare:
                log.warning("%s: the manifest of model %s (from %s) makes way for model %s (from %s)", url,
                            spare[0].model_id[:16], spare[0].source, cand.model_id[:16], cand.source)
                cands.remove(spare[0])
            self.urls[url] = [*cands, cand]
        return None

    def _bound(self, url: str) -> list[tuple]:
        return [(c.model_id, c.source, c.operator, c.confirmed) for c in self.urls.get(url, [])]

    def candidates(self, url: str) -> list[Candidate]:
        """``url``'s candidates of a live swarm: confirmed (or the operator's) first, then first come."""
        cands = [c for c in self.urls.get(url, []) if c.model_id in self.swarms]
        return sorted(cands, key=lambda c: not (c.confirmed or c.operator))

    def _swarm(self, manifest: Manifest) -> Swarm:
        s = Swarm(manifest, self.make_topology(manifest.n_chunks), self.root_listen, self.clock,
                  max_peers=self.max_peers)
        s.endpoint.keyed, s.endpoint.probe_port = self.keyed, self.probe_port
        if self.member_timeout is not None:
            s.endpoint.member_timeout = self.member_timeout
        return s

    def _room(self, operator: bool = False) -> bool:
        """Whether a new swarm fits, evicting one if need be: the least lately used with no origin reader and no
        complete member (live members or not), else the least lately used with no live member; an operator's
        swarm makes room only for the operator."""
        if len(self.swarms) < self.max_swarms:
            return True
        mine = [(s.used, mid) for mid, s in self.swarms.items() if operator or not self.opened[mid].operator]
        unproven = [x for x in mine if not self._proven(self.swarms[x[1]])]
        idle = [x for x in mine if not self.swarms[x[1]].live]
        if not (unproven or idle):
            return False
        mid = min(unproven or idle)[1]
        log.warning("model %s (opened from %s) evicted: room for another", mid[:16], self.opened[mid].source)
        del self.swarms[mid], self.opened[mid]
        self.dirty = True
        self.urls = {u: kept for u, cs in self.urls.items() if (kept := [c for c in cs if c.model_id != mid])}
        self.conns = {i: m for i, m in self.conns.items() if m != mid}  # its members are told to introduce again
        return True

    @staticmethod
    def _proven(s: Swarm) -> bool:
        """Whether swarm ``s`` has an origin reader or a member holding the whole model."""
        return bool(s.shares.readers) or any(m.done and not m.left for m in s.tracker.members.values())

    def lookup(self, ident: bytes, f: dict) -> bool:
        """LOOKUP: the swarm of a model id (a 64-hex ``url``, or ``model_id``), else candidate ``index`` of those
        published for ``url`` (MANIFEST, with their ``count``); or an ERROR saying none is."""
        url, want = f["url"], f.get("model_id") or None
        if is_model_id(url):
            want = url
        if want is not None:
            mid = want.lower()
            if mid not in self.swarms and is_model_id_prefix(mid):  # a prefix pins one swarm, if only one has it
                named = [m for m in self.swarms if m.startswith(mid)]
                mid = named[0] if len(named) == 1 else mid
            picked = next((c for c in self.candidates(url) if c.model_id == mid), Candidate(mid, ""))
            index, count = 0, 1
        else:
            cands, index = self.candidates(url), f.get("index") or 0
            picked, count = (cands[index] if index < len(cands) else None), len(cands)
        if picked is None or picked.model_id not in self.swarms:
            self._send(ident, protocol.control(Msg.ERROR, message=(
                f"no manifest published for {url}" + (f" of model {want[:64]}" if want else "") +
                (f" past the {count} there are" if index and count else ""))))
        else:
            self._send(ident, protocol.control(Msg.MANIFEST, url=url, model_id=picked.model_id, index=index,
                                               count=count, confirmed=picked.confirmed or picked.operator),
                       self.swarms[picked.model_id].endpoint.manifest_frame)
        return False  # answered: the asker holds no state here

    # ----- kept across a restart (``statedir``) ---------------------------------

    def kept(self) -> tuple[dict, dict, dict]:
        """(manifests by model id, each URL's candidates, each swarm's opener), as ``statedir`` writes them."""
        urls = {u: [{"model_id": c.model_id, "source": c.source, "operator": c.operator, "confirmed": c.confirmed}
                    for c in cs] for u, cs in self.urls.items()}
        opened = {m: {"source": c.source, "operator": c.operator} for m, c in self.opened.items()}
        return {m: s.endpoint.manifest for m, s in self.swarms.items()}, urls, opened

    def restore(self, manifests: dict[str, Manifest], urls: dict[str, list[dict]], opened: dict[str, dict]) -> None:
        """Open the swarm of each kept manifest (checked already, at most ``max_swarms``) and bind its URLs."""
        for mid, manifest in list(manifests.items())[:self.max_swarms]:
            who = opened.get(mid, {"source": "state", "operator": False})
            self.swarms[mid], self.opened[mid] = self._swarm(manifest), Candidate(mid, who["source"], who["operator"])
        for url, cands in urls.items():
            kept = [Candidate(c["model_id"], c["source"], c["operator"], c["confirmed"]) for c in cands
                    if c["model_id"] in self.swarms]
            if kept:
                self.urls[url] = kept
        if self.swarms:
            log.info("%d models and %d URLs kept from the state folder: their swarms are open", len(self.swarms),
                     len(self.urls))

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
        self.joins += 1
        s.used = self.clock()
        rank = s.endpoint.members[ident]
        if f.get("pulls") is False:
            s.tracker.pulls_nothing(rank)
        if f.get("origin") is True:  # a reader of the origin joined: every URL naming this model confirms it
            for c in (c for cs in self.urls.values() for c in cs if c.model_id == mid and not c.confirmed):
                c.confirmed = self.dirty = True
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
        named = {(u, c.model_id) for u, cs in self.urls.items() for c in cs}
        swarms = [{"model_id": m, "urls": sorted(u for u, x in named if x == m),
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
