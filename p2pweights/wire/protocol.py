"""Protocol: the wire messages of p2pweights and the per-connection state machine.

Everything that decides what a frame means lives here, as pure functions: no
sockets, no clocks, no sleeping (sans-IO, like h11).  The node feeds received
frames in and gets ``Event``s out, or a ``ProtocolError`` that names the peer's
state and the offending message; the node logs it and keeps serving others.

Frames.  Every message starts with a header frame:
``b"P2W" | version:u8 | type:u8 | body``.  Control messages carry a JSON object
as body; REQUEST carries ``u32`` chunk indices; CHUNK carries one ``u32``
index and the chunk bytes as a second frame (sent and received without
copies); WELCOME carries the manifest JSON as a second frame.

Theory of operation.  A joiner sends HELLO to any node.  The seeder (which
runs the tracker) answers WELCOME with the manifest, the joiner's rank and its
parent per stripe; any other node answers REDIRECT to the tracker.  The peer
then ATTACHes to each partner (its planned parent per stripe and a few
more); the partner answers ATTACHED with the bitfield of what it holds and
then streams batched HAVEs.  The peer pulls chunks from any partner that holds
them with REQUESTs, never more than that link's credit window outstanding: a
partner sends only what was asked for, so a slow link slows nobody else.  A
peer may open more connections to a partner that ATTACHED says takes them:
each says LANE with the same ticket, and the partner spreads the chunks it
sends that peer over them (``swarm.node.lanes``).  An endgame duplicate that
lost the race is withdrawn with CANCEL.  Peers report DONE to the tracker
and ask to LEAVE; the tracker lets a peer go once the peers that depend on
it are done.  Anyone may ask the tracker for the fleet with STATUS on a
fresh connection (no join); it answers STATUS_REPLY with its latest
snapshot (any other node answers REDIRECT to the tracker).

A standalone tracker (``p2pw tracker``) serves one swarm per model id on one
port.  Its manifests come from PUBLISH (the origin's URL and the manifest's
canonical bytes); LOOKUP asks for one of those published for a URL (MANIFEST:
candidate ``index`` of ``count``) or for a model id, and a HELLO names the
swarm by its full ``model_id``.  A member that can read the origin says
``origin`` in its HELLO: the tracker hands it SHARE after SHARE of the chunks
nobody holds yet, disjoint from every other reader's, and the reader
reports with READ what it holds of them, so the origin is read about once.

Trust.  Every field a message carries is checked here before any handler sees
it (``FIELD_CHECKS``): each address (HELLO's listen, REDIRECT's and WELCOME's
tracker, every plan entry's addr) must be ``HOST:PORT``, so no peer can make
another connect to a malformed or non-TCP endpoint.  WELCOME hands the joiner a
``secret``; a re-introduction to the same tracker proves itself with it (a peer
id proves nothing), and it keys the ``ticket`` in each plan entry, which the
joiner shows in ATTACH: a node serves only peers the tracker placed with it
(``swarm.tracker.membership``).
"""
from __future__ import annotations

import json
import re
import struct
from enum import IntEnum

from .chunkset import bitset

MAGIC = b"P2W"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<3sBB")
INDEX = struct.Struct("<I")
MAX_CONTROL_BODY = 64 << 10  # a control header larger than this is hostile
MAX_REQUEST = 256  # chunk indices in one REQUEST
MAX_NAME = 256  # longest peer id or listen address a HELLO or ATTACH may carry
YOUNG = 2.0  # seconds after a join in which the peer reports twice as often, and the tracker reviews rates
#              twice as often: a slow first joiner stops being a stripe's root at about 0.75 s, not 1.0


MAX_URL = 1024  # characters of an origin's URL
MAX_SECRET = 64  # hex digits of a member's secret or a ticket
HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]")  # a name, an IPv4 address, or an IPv6 one in brackets


def is_model_id(text: str) -> bool:
    """Whether ``text`` spells a model id (64 hex digits): asked for, it names a model, never a URL."""
    return len(text) == 64 and re.fullmatch(r"[0-9a-fA-F]{64}", text) is not None


def is_model_id_prefix(text: str) -> bool:
    """Whether ``text`` is a model id or at least its first 16 hex digits (enough to pin one)."""
    return re.fullmatch(r"[0-9a-fA-F]{16,64}", text) is not None


def valid_host(host: str) -> bool:
    """Whether ``host`` can be a host name or address (a name is not looked up)."""
    return HOST.fullmatch(host) is not None


def valid_addr(addr) -> bool:
    """Whether ``addr`` is 'HOST:PORT' (PORT in 1-65535): the only form an address in a message may take."""
    if not isinstance(addr, str) or len(addr) > MAX_NAME:
        return False
    host, _, port = addr.rpartition(":")
    return valid_host(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536


class ProtocolError(ValueError):
    """A message that breaks the protocol; the message names what and where."""


class VersionMismatch(ProtocolError):
    """The other side speaks another protocol version."""


class Msg(IntEnum):
    HELLO = 1       # joiner -> any node: {peer_id, listen, model_id?, have?, rank?, secret?, origin?, pulls?}
    WELCOME = 2     # tracker -> joiner: {rank, parents, stripes, tracker, secret?, partners?} + manifest frame
    REDIRECT = 3    # node -> joiner: {tracker}
    ERROR = 4       # any -> any: {message, fatal}
    ATTACH = 5      # peer -> partner: {peer_id, rank, model_id, ticket?} (ticket: its plan entry's)
    ATTACHED = 6    # partner -> peer: {n_chunks, lanes?} + bitfield frame of what it holds (lanes: connections it takes)
    REQUEST = 7     # peer -> partner: u32 indices
    CHUNK = 8       # partner -> peer: u32 index + payload frame
    DONE = 9        # peer -> tracker: {rank, bytes, seconds}
    LEAVE = 10      # peer -> tracker: {rank, linger?}
    LEAVE_OK = 11   # tracker -> peer: {}
    LEAVE_WAIT = 12  # tracker -> peer: {waiting_for}
    HEARTBEAT = 13  # either way: {}; peer -> tracker adds {have, links, got: {rank: bytes/s}} (what it measures)
    REPARENT = 14   # tracker -> peer: {parents, partners?}: its plan changed
    BYE = 15        # peer -> tracker, and node -> the partners it serves: {rank}; it is leaving now
    ORPHAN = 16     # peer -> tracker: {rank, stripe, parent, reason, dead}; another parent in that stripe
    HAVE = 17       # partner -> peer: u32 indices it verified since the last HAVE
    CANCEL = 18     # peer -> partner: u32 indices no longer wanted (an endgame duplicate arrived)
    STATUS = 19     # anyone -> tracker, on a fresh connection, no join needed: {model_id?}
    STATUS_REPLY = 20  # tracker -> asker: {peers, shown} + fleet JSON frame (fleet.Fleet.to_doc), bounded
    PROBE = 21      # member -> tracker: {rate, took, alone}: its uplink, as its kernel timed the bytes WELCOME's
    #                 "uplink_probe" asked it to send the seeder's probe sink (``uplink``)
    SHARE = 22      # tracker -> origin reader: {chunks}: read these from the origin (nobody holds them yet)
    READ = 23       # origin reader -> tracker: {chunks}: of its share (or, once welcomed, of all) it holds now
    PUBLISH = 24    # anyone -> standalone tracker: {url} + manifest frame: the manifest of the origin at url
    PUBLISHED = 25  # tracker -> publisher: {model_id}
    LOOKUP = 26     # anyone -> standalone tracker, on a fresh connection: {url, model_id?, index?}
    MANIFEST = 27   # tracker -> asker: {url, model_id, index?, count?, confirmed?} + manifest frame (canonical bytes)
    LANE = 28       # peer -> partner, on another connection once ATTACHED: {peer_id, rank, model_id, ticket?, lane}:
    #                 carry chunks for my link here too (``swarm.node.lanes``)
    LANE_OK = 29    # partner -> peer, on that connection: {lane}


# Required JSON fields of each control message and their types.
SCHEMA: dict[Msg, dict[str, type | tuple]] = {
    Msg.HELLO: {"peer_id": str, "listen": str},
    Msg.WELCOME: {"rank": int, "parents": list, "stripes": int, "tracker": str},
    Msg.REDIRECT: {"tracker": str},
    Msg.ERROR: {"message": str},
    Msg.ATTACH: {"peer_id": str, "rank": int, "model_id": str},
    Msg.ATTACHED: {"n_chunks": int},
    Msg.DONE: {"rank": int},
    Msg.LEAVE: {"rank": int},
    Msg.LEAVE_OK: {},
    Msg.LEAVE_WAIT: {},
    Msg.HEARTBEAT: {},
    Msg.REPARENT: {"parents": list},
    Msg.BYE: {"rank": int},
    Msg.ORPHAN: {"rank": int, "stripe": int, "parent": int, "reason": str},
    Msg.STATUS: {},
    Msg.STATUS_REPLY: {"peers": int, "shown": int},
    Msg.PROBE: {"rate": (int, float), "took": (int, float)},
    Msg.SHARE: {"chunks": list},
    Msg.READ: {"chunks": list},
    Msg.PUBLISH: {"url": str},
    Msg.PUBLISHED: {"model_id": str},
    Msg.LOOKUP: {"url": str},
    Msg.MANIFEST: {"url": str, "model_id": str},
    Msg.LANE: {"peer_id": str, "rank": int, "model_id": str, "lane": int},
    Msg.LANE_OK: {"lane": int},
}


def _names(f: dict, *keys) -> None:
    for key in keys:
        v = f.get(key)
        if v is not None and (not isinstance(v, str) or len(v) > (MAX_SECRET if key in ("secret", "ticket")
                                                                  else MAX_NAME)):
            raise ProtocolError(f"{key!r} is not a string or is longer than {MAX_NAME} characters")


def _addr(what: str, addr, empty: bool = True) -> None:
    if not (empty and addr == "") and not valid_addr(addr):
        raise ProtocolError(f"{what} {str(addr)[:80]!r} is not HOST:PORT")


def _hello(f: dict) -> None:
    _names(f, "peer_id", "model_id", "secret")
    _addr("listen address", f["listen"], empty=False)
    for flag in ("origin", "pulls"):
        if flag in f and type(f[flag]) is not bool:
            raise ProtocolError(f"{flag!r} is not true or false")


def _chunks(f: dict) -> None:
    """SHARE's and READ's chunk indices: at most MAX_REQUEST whole numbers below 2**32 (the handler checks them
    against the blob's chunks)."""
    c = f["chunks"]
    if len(c) > MAX_REQUEST or not all(type(i) is int and 0 <= i < 1 << 32 for i in c):
        raise ProtocolError(f"'chunks' is not a list of at most {MAX_REQUEST} chunk indices")


MAX_CANDIDATES = 8  # manifests a standalone tracker keeps for one URL (LOOKUP's and MANIFEST's index below it)


def _candidate(f: dict) -> None:
    """LOOKUP's and MANIFEST's ``url``; the ``model_id`` asked for or answered; the candidate's ``index`` and the
    URL's ``count`` of them: whole numbers up to MAX_CANDIDATES; ``confirmed`` true or false."""
    _url(f)
    _names(f, "model_id")
    for key in ("index", "count"):
        v = f.get(key)
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_CANDIDATES):
            raise ProtocolError(f"{key!r} is not a whole number from 0 to {MAX_CANDIDATES}")
    if "confirmed" in f and type(f["confirmed"]) is not bool:
        raise ProtocolError("'confirmed' is not true or false")


def _url(f: dict) -> None:
    """An origin's URL (s3://..., a path, ORG/NAME[@REVISION]): printable, at most MAX_URL characters."""
    url = f["url"]
    if not url or len(url) > MAX_URL or not url.isprintable():
        raise ProtocolError(f"'url' is empty, longer than {MAX_URL} characters or not printable")


MAX_LINGER = 1e9  # seconds: LEAVE's linger, a finite number of seconds up to about 30 years


def _leave(f: dict) -> None:
    """LEAVE's ``linger``, if any: seconds, a number from 0 to MAX_LINGER."""
    v = f.get("linger")
    if v is not None and (type(v) not in (int, float) or not 0 <= v <= MAX_LINGER):
        raise ProtocolError(f"'linger' is not a number of seconds from 0 to {MAX_LINGER:g}")


def _plan(f: dict) -> None:
    """WELCOME's and REPARENT's entries: each address HOST:PORT, or empty (the tracker's, as dialled)."""
    _addr("tracker address", f.get("tracker", ""))
    _names(f, "secret")
    for key in ("parents", "partners"):
        for p in f.get(key) or ():
            if isinstance(p, dict):
                _addr(f"{key} address", p.get("addr", ""))
                _names(p, "ticket")


MAX_LANE = 255  # the largest lane number or count a message may carry (a node takes far fewer: ``swarm.node.lanes``)


def _lanes(f: dict, key: str) -> None:
    """ATTACHED's ``lanes`` (how many connections the partner takes from us), LANE's and LANE_OK's ``lane``: a
    whole number from 1 to MAX_LANE, where present."""
    v = f.get(key)
    if v is not None and (type(v) is not int or not 1 <= v <= MAX_LANE):
        raise ProtocolError(f"{key!r} is not a whole number from 1 to {MAX_LANE}")


# Field checks beyond the types (SCHEMA), by message: names bounded, addresses HOST:PORT.
FIELD_CHECKS = {
    Msg.HELLO: _hello,
    Msg.ATTACH: lambda f: _names(f, "peer_id", "model_id", "ticket"),
    Msg.ATTACHED: lambda f: _lanes(f, "lanes"),
    Msg.LANE: lambda f: (_names(f, "peer_id", "model_id", "ticket"), _lanes(f, "lane")),
    Msg.LANE_OK: lambda f: _lanes(f, "lane"),
    Msg.REDIRECT: lambda f: _addr("redirect target", f["tracker"]),
    Msg.WELCOME: _plan,
    Msg.REPARENT: _plan,
    Msg.ORPHAN: lambda f: _names(f, "reason"),
    Msg.LEAVE: _leave,
    Msg.SHARE: _chunks,
    Msg.READ: _chunks,
    Msg.PUBLISH: _url,
    Msg.LOOKUP: _candidate,
    Msg.MANIFEST: _candidate,
    Msg.PUBLISHED: lambda f: _names(f, "model_id"),
    Msg.STATUS: lambda f: _names(f, "model_id"),
}
# ATTACHED: the bitfield (packbits)
PAYLOAD_FRAMES = {Msg.WELCOME: 1, Msg.CHUNK: 1, Msg.ATTACHED: 1, Msg.STATUS_REPLY: 1, Msg.PUBLISH: 1,
                  Msg.MANIFEST: 1}
INDEX_LISTS = (Msg.REQUEST, Msg.HAVE, Msg.CANCEL)  # bodies of u32 chunk indices


class Event:
    """One decoded message: its type, JSON fields (or chunk indices), and payload frame if any."""

    __slots__ = ("type", "fields", "indices", "payload")

    def __init__(self, type: Msg, fields: dict | None = None, indices: list[int] | None = None, payload=None):
        self.type = type
        self.fields = {} if fields is None else fields
        self.indices = [] if indices is None else indices
        self.payload = payload


def _header(kind: Msg) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind)


def control(kind: Msg, **fields) -> bytes:
    """The header frame of a control message."""
    return _header(kind) + json.dumps(fields, separators=(",", ":")).encode()


def request(indices) -> bytes:
    """REQUEST header for chunk ``indices``."""
    return chunk_list(Msg.REQUEST, indices)


def chunk_list(kind: Msg, chunks) -> bytes:
    """REQUEST, HAVE or CANCEL header for chunk indices ``chunks`` (at most MAX_REQUEST of them)."""
    return _header(kind) + struct.pack(f"<{len(chunks)}I", *chunks)


_REVERSED = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))  # each byte's bits in the other order


def pack_bits(flags) -> bytes:
    """ATTACHED's bitfield of a bytes-like of 0/1 per chunk: chunk 0 is the first byte's highest bit."""
    return bitset(flags).to_bytes((len(flags) + 7) // 8, "little").translate(_REVERSED)


def unpack_bits(bits: bytes, n: int) -> int:
    """The chunks an ATTACHED bitfield of ``n`` chunks sets, as a ``chunkset`` bitset."""
    return int.from_bytes(bytes(bits).translate(_REVERSED), "little") & ((1 << n) - 1)


def batches(chunks, size: int = MAX_REQUEST):
    """``chunks`` cut into lists of at most ``size`` (one message each)."""
    chunks = list(chunks)
    return [chunks[i:i + size] for i in range(0, len(chunks), size)]


def chunk_header(index: int) -> bytes:
    """CHUNK header for chunk ``index`` (the payload is the next frame)."""
    return _header(Msg.CHUNK) + INDEX.pack(index)


MSG_OF = {int(m): m for m in Msg}  # a dict lookup: ``Msg(value)`` costs microseconds a message


def decode_header(frame: bytes) -> Event:
    """Decode a header frame into an Event (payload not attached); ProtocolError if malformed."""
    if len(frame) < HEADER.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is too short for a header")
    magic, version, kind = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a p2pweights peer")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version} is not supported (this p2pw speaks {PROTOCOL_VERSION})")
    kind = MSG_OF.get(kind, kind)
    if not isinstance(kind, Msg):
        raise ProtocolError(f"unknown message type {kind}")
    body = memoryview(frame)[HEADER.size:]
    if kind in INDEX_LISTS:
        if len(body) % 4 or not body or len(body) // 4 > MAX_REQUEST:
            raise ProtocolError(f"{kind.name} body of {len(body)} bytes is not 1..{MAX_REQUEST} u32 indices")
        return Event(kind, indices=list(struct.unpack(f"<{len(body) // 4}I", body)))
    if kind == Msg.CHUNK:
        if len(body) != INDEX.size:
            raise ProtocolError(f"CHUNK header body of {len(body)} bytes, expected {INDEX.size}")
        return Event(kind, indices=[INDEX.unpack(body)[0]])
    if len(body) > MAX_CONTROL_BODY:
        raise ProtocolError(f"{kind.name} body of {len(body)} bytes exceeds {MAX_CONTROL_BODY}")
    try:
        fields = json.loads(bytes(body)) if body else {}
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: "[[[[..." (found by fuzzing)
        raise ProtocolError(f"{kind.name} body is not JSON") from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"{kind.name} body is not a JSON object")
    for name, typ in SCHEMA[kind].items():
        if not isinstance(fields.get(name), typ) or isinstance(fields.get(name), bool):
            kinds = typ if isinstance(typ, tuple) else (typ,)
            raise ProtocolError(f"{kind.name} lacks field {name!r} of type {' or '.join(t.__name__ for t in kinds)}")
    check = FIELD_CHECKS.get(kind)
    if check is not None:
        try:
            check(fields)
        except ProtocolError as e:
            raise ProtocolError(f"{kind.name}: {e}") from None
    return Event(kind, fields=fields)


def decode(frames: list) -> Event:
    """Decode a whole multipart message (header plus payload frames)."""
    if not frames:
        raise ProtocolError("empty message")
    event = decode_header(bytes(frames[0]))
    want = PAYLOAD_FRAMES.get(event.type, 0)
    if len(frames) - 1 != want:
        raise ProtocolError(f"{event.type.name} with {len(frames) - 1} payload frames, expected {want}")
    if want:
        event.payload = frames[1]
    return event


# What a serving node accepts on one incoming connection, by state.
# Anything not listed is a ProtocolError naming the state and the message.
SERVER_TRANSITIONS: dict[tuple[str, Msg], str] = {
    ("new", Msg.HELLO): "member",
    ("new", Msg.ATTACH): "child",
    ("new", Msg.LANE): "lane",
    ("new", Msg.HEARTBEAT): "new",
    ("new", Msg.STATUS): "new",
    ("new", Msg.PUBLISH): "new",
    ("new", Msg.LOOKUP): "new",
    ("member", Msg.HELLO): "member",
    ("member", Msg.READ): "member",
    ("member", Msg.PUBLISH): "member",
    ("member", Msg.DONE): "member",
    ("member", Msg.LEAVE): "member",
    ("member", Msg.HEARTBEAT): "member",
    ("member", Msg.BYE): "new",
    ("member", Msg.ORPHAN): "member",
    ("member", Msg.PROBE): "member",
    ("child", Msg.REQUEST): "child",
    ("child", Msg.HEARTBEAT): "child",
    ("child", Msg.ATTACH): "child",
    ("child", Msg.CANCEL): "child",
    ("child", Msg.BYE): "new",  # it is done with us: its state here goes (``Handlers.on_served``)
    ("lane", Msg.HEARTBEAT): "lane",  # a lane carries chunks to the peer; it asks for nothing on one
    ("lane", Msg.BYE): "new",
}

# What a peer accepts from its tracker and from a parent, by state.
CLIENT_TRANSITIONS: dict[tuple[str, Msg], str] = {
    ("hello", Msg.WELCOME): "member",
    ("hello", Msg.REDIRECT): "redirected",
    ("member", Msg.LEAVE_OK): "left",
    ("member", Msg.LEAVE_WAIT): "member",
    ("member", Msg.REPARENT): "member",
    ("member", Msg.HEARTBEAT): "member",
    ("member", Msg.WELCOME): "member",
    ("member", Msg.SHARE): "member",
    ("member", Msg.PUBLISHED): "member",
    ("attaching", Msg.ATTACHED): "attached",
    ("attaching", Msg.HEARTBEAT): "attaching",
    ("attaching", Msg.BYE): "closed",
    ("attached", Msg.BYE): "closed",
    ("attached", Msg.CHUNK): "attached",
    ("attached", Msg.HEARTBEAT): "attached",
    ("attached", Msg.HAVE): "attached",
}

# What a peer accepts on a lane to a partner (``swarm.node.lanes``): the partner's LANE_OK, then chunks.
LANE_TRANSITIONS: dict[tuple[str, Msg], str] = {
    ("attaching", Msg.LANE_OK): "open",
    ("attaching", Msg.HEARTBEAT): "attaching",
    ("open", Msg.CHUNK): "open",
    ("open", Msg.HEARTBEAT): "open",
}


class Connection:
    """State of one connection as seen from this side; ``receive`` applies a transition."""

    def __init__(self, table: dict, state: str):
        self.table = table
        self.state = state

    def receive(self, event: Event) -> Event:
        if event.type == Msg.ERROR:
            return event
        nxt = self.table.get((self.state, event.type))
        if nxt is None:
            raise ProtocolError(f"unexpected {event.type.name} in state {self.state}")
        self.state = nxt
        return event
