"""Handlers: what each incoming message does to a node, one small named handler per message.

``Handlers.dispatch`` drains one ready socket of the node's loop: the ROUTER
(partners pulling from us, joiners, the tracker's members), a DEALER to a
partner we pull from, the tracker link, or the inbox of other threads.  Each
message is decoded by ``protocol`` and checked against its connection's state
table; a bad one is counted and logged, and the node keeps serving everyone else.
"""
from __future__ import annotations

import logging
import struct

import zmq

from ..wire import protocol
from ..wire.protocol import MAX_NAME, SERVER_TRANSITIONS, Connection, Msg, ProtocolError
from .admission import NOT_PLACED, attach_refusal
from .intake import MAX_BAD_FROM_PARENT  # noqa: F401  (part of the node's limits)
from .originread import landed

log = logging.getLogger("p2pw")

MAX_BAD_MESSAGES = 32  # malformed messages before a connection is ignored
DRAIN = 64  # messages taken from one socket per poll
DRAIN_SECONDS = 0.02  # and at most this long, so timers (heartbeats) keep their pace under load
READY = struct.Struct("<I?")  # read-ahead -> loop: chunk index, matched the manifest
# pyzmq's constants are enums; as ints they cost no enum arithmetic on every message and frame (the node's
# sends use NOBLOCK too: pyzmq ORs SNDMORE into the flags per frame)
EVENTS, POLLIN, RCVMORE, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE), int(zmq.NOBLOCK)


class Handlers:
    """Message handlers of one node (its loop thread only)."""

    def __init__(self, node):
        self.node = node

    def dispatch(self, sock) -> None:
        n = self.node
        if sock is n.router:
            handler = self.on_router
        elif sock is n.tracker_link:
            handler = self.on_tracker
        elif sock is n.inbox:
            handler = self.on_inbox
        else:
            link = next((lk for lk in n.partners.links.values() if lk.socket is sock), None)
            if link is None:
                watched = next((lk for lk in n.partners.links.values() if lk.monitor is sock), None)
                if watched is not None:  # a partner's connection event
                    n.partners.dropped(watched)
                return  # else: closed earlier in this poll
            handler = lambda s, link=link: self.on_link(link)  # noqa: E731
        deadline = n.clock() + DRAIN_SECONDS
        for _ in range(DRAIN):
            if sock.closed or not sock.getsockopt(EVENTS) & POLLIN:  # a handler may close it (partner given up)
                return
            handler(sock)
            if n.clock() > deadline:
                return

    # ----- inbox: other threads ------------------------------------------

    def on_inbox(self, sock) -> None:
        verb, body = sock.recv_multipart()
        n = self.node
        if verb == b"ready":
            index, ok = READY.unpack(body)
            if ok:
                n.publish(index)
            else:
                log.error("chunk %d read from storage does not match the manifest: the checkpoint changed under "
                          "the seeder (or cannot be read); not serving it (restart the seeder to rescan)", index)
        elif verb == b"checked":  # the workers have verdicts
            n.intake.checked()
        elif verb == b"origin":
            landed(n, *READY.unpack(body))
        elif verb == b"urgent":
            n.pull.prioritize(struct.unpack(f"<{len(body) // 4}I", body))
        elif verb == b"fail":
            n._fail(body.decode(errors="replace"))
        elif verb == b"stop":
            n.stop_event.set()
        elif verb == b"uplink" and n.member is not None:  # our probe's result, from its thread
            n.member.timed(body)
        elif verb in (b"leave", b"wake"):  # the timers run at the end of this pass (DONE, LEAVE), not in 50 ms
            n.leave_when_done = n.leave_when_done or verb == b"leave"
            n.next_timers = 0.0

    # ----- partners we pull from -----------------------------------------

    def on_link(self, link) -> None:
        n = self.node
        sock = link.socket
        link.last_heard = n.clock()
        try:
            event = protocol.decode_header(sock.recv(NOBLOCK))
            if event.type == Msg.CHUNK:
                if not sock.getsockopt(RCVMORE):
                    raise ProtocolError("CHUNK without its payload frame")
                link.conn.receive(event)
                self.on_chunk(link, event.indices[0])
                return
            frames = [event, *self._rest(sock)]
            link.conn.receive(event)
            self.on_link_control(link, event, frames[1:])
        except ProtocolError as e:
            _discard_rest(sock)
            n.stats.malformed += 1
            log.warning("partner rank %d (%s) sent a bad message: %s", link.rank, link.addr, e)

    @staticmethod
    def _rest_bytes(sock) -> list:
        rest = []
        while sock.getsockopt(RCVMORE):
            rest.append(sock.recv())
        return rest

    @staticmethod
    def _rest(sock) -> list:
        rest = []
        while sock.getsockopt(RCVMORE):
            rest.append(sock.recv(copy=False))
        return rest

    def on_link_control(self, link, event, payload: list) -> None:
        n = self.node
        if event.type == Msg.ATTACHED:
            bits = bytes(payload[0].buffer) if payload else b""
            size = n.manifest.n_chunks
            if event.fields["n_chunks"] != size or len(bits) != (size + 7) // 8:
                raise ProtocolError(f"ATTACHED bitfield of {len(bits)} bytes for {event.fields['n_chunks']} "
                                    f"chunks; the blob has {size}")
            n.pull.ready(link.rank, protocol.unpack_bits(bits, size))
        elif event.type == Msg.BYE:  # it is leaving: its requests are asked elsewhere now, not after a timeout
            n.partners.give_up(link.rank, "it left", level=logging.INFO)
        elif event.type == Msg.HAVE:
            if max(event.indices) >= n.manifest.n_chunks:
                raise ProtocolError(f"HAVE names chunk {max(event.indices)}; the blob has {n.manifest.n_chunks}")
            n.pull.has(link.rank, event.indices)
        elif event.type == Msg.ERROR and str(event.fields.get("message")).startswith(NOT_PLACED):
            n.partners.refused(link.rank)  # our ticket is stale (a restarted tracker): ask for a new plan
        elif event.type == Msg.ERROR and event.fields.get("fatal"):
            if "model id" in str(event.fields.get("message")) or len(n.partners.links) <= 1:  # nobody else to ask
                n._fail(f"partner {link.addr} refused us: {event.fields.get('message')}")
            else:
                n.partners.give_up(link.rank, f"refused us: {event.fields.get('message')}")
        elif event.type == Msg.ERROR:  # it lost our state (restarted?): attach again, ask again
            log.warning("partner %s: %s; attaching again", link.addr, event.fields.get("message"))
            n.partners.close(link.rank)
            n.partners.open(link.rank, link.addr)

    def on_chunk(self, link, index: int) -> None:
        """A chunk arrived: hand it to the intake (verified there, and only then written and published), or
        drop it if we did not ask for it."""
        n = self.node
        sock = link.socket
        if index >= n.manifest.n_chunks or not n.pull.expects(link.rank, index):
            _discard_rest(sock)
            if index < n.manifest.n_chunks and n.store.has(index):  # an endgame loser, a stall re-request
                n.stats.duplicates += 1
            else:
                n.stats.malformed += 1
                log.warning("partner rank %d sent chunk %d, which we did not ask it for: dropped", link.rank, index)
            return
        link.last_chunk = n.clock()
        frame = sock.recv(NOBLOCK, copy=False)  # ZeroMQ's buffer: the workers verify and copy from it
        _discard_rest(sock)
        n.stats.chunks_received += 1
        n.stats.bytes_received += len(frame)
        if n.faults is not None:
            n.faults.received()
        n.intake.arrived(link.rank, index, frame)

    # ----- tracker link (peers only) ---------------------------------------

    def on_tracker(self, sock) -> None:
        n = self.node
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            event = n.member.conn.receive(protocol.decode(frames))
        except ProtocolError as e:
            n.stats.malformed += 1
            log.warning("tracker %s sent a bad message: %s", n.tracker_addr, e)
            return
        n.member.heard_from(n.clock())
        f = event.fields
        if event.type == Msg.WELCOME:  # a restarted tracker took us back
            n.member.welcomed_again(f["rank"], f.get("uplink_probe"))
            n.rank, n.secret = f["rank"], f.get("secret")
            self._plan(f)
        elif event.type == Msg.LEAVE_OK:
            n.left.set()
            n.stop_event.set()
        elif event.type == Msg.REPARENT:
            self._plan(f)
        elif event.type == Msg.SHARE:
            n.member.shared(f["chunks"])
        elif event.type == Msg.ERROR:  # it does not know us (restarted): introduce ourselves at once
            log.warning("tracker: %s", f.get("message"))
            if n.clock() - n.member.hello_sent > 1.0:
                n.member.reintroduce(n.clock())

    def _plan(self, f: dict) -> None:
        n = self.node
        parents, partners = f.get("parents"), f.get("partners", [])
        if not isinstance(parents, list) or not isinstance(partners, list):
            n.stats.malformed += 1
            log.warning("tracker sent a plan that is not lists: ignored")
            return
        old = {p["rank"] for p in n.partners.plan}
        n.partners.set_plan(parents, partners)
        new = {p["rank"] for p in n.partners.plan}
        if new - old:
            log.info("new planned source(s) %s", ", ".join(f"rank {r}" for r in sorted(new - old)))

    # ----- router: partners, joiners, members ------------------------------

    def on_router(self, sock) -> None:
        n = self.node
        ident = sock.recv(NOBLOCK)
        conn = n.conns.get(ident)
        first = sock.recv(NOBLOCK, copy=conn is not None)  # a new connection's frame says where it is from
        frames = [first if conn is not None else first.bytes, *self._rest_bytes(sock)]
        n.seen[ident] = n.clock()
        if n.bad.get(ident, 0) >= MAX_BAD_MESSAGES:
            return
        if conn is None:
            if not n.admission.admit(ident, _peer_address(first)):
                n._send(ident, protocol.control(Msg.ERROR, fatal=True, message=(
                    f"too many connections from {_peer_address(first)} (at most {n.admission.max_per_host})")))
                return
            conn = n.conns[ident] = Connection(SERVER_TRANSITIONS, "new")
        try:
            event = conn.receive(protocol.decode(frames))
            self.on_served(ident, event)
        except ProtocolError as e:
            self._reject(ident, str(e), isinstance(e, protocol.VersionMismatch))
        except Exception as e:  # never let one peer take the node down
            self._reject(ident, f"could not handle its message: {e!r}", False)

    def on_served(self, ident: bytes, event) -> None:
        n = self.node
        kind = event.type
        if kind == Msg.ATTACH:
            self.on_attach(ident, event.fields)
        elif kind == Msg.REQUEST and not n.serve.attached(ident):
            # it attached, then a send to it found its connection gone (``forget``): what it asked
            # before that is still in our queue, or it reconnected; not a bad message
            log.info("%s: a request on a connection dropped earlier; telling it to attach again", self._who(ident))
            n._send(ident, protocol.control(Msg.ERROR, message="not attached (the connection dropped): attach again"))
        elif kind == Msg.REQUEST:
            absent = n.serve.request(ident, event.indices)
            if n.reader is not None:
                for index in absent:
                    n.reader.want(index)
            elif n.pull is not None:
                n.pull.awaited(absent)
        elif kind == Msg.CANCEL:
            n.serve.cancel(ident, event.indices)
        elif kind in (Msg.HELLO, Msg.STATUS) and n.endpoint is None:
            n._send(ident, protocol.control(Msg.REDIRECT, tracker=n.tracker_addr))
            n.drop_conn(ident)  # sent on: it holds no state here (nor a place under its address's cap)
        elif n.endpoint is not None and kind in n.endpoint.HANDLERS:
            if n.endpoint.HANDLERS[kind](n.endpoint, ident, event.fields) is False:
                n.drop_conn(ident)

    def on_attach(self, ident: bytes, f: dict) -> None:
        n = self.node
        why = attach_refusal(f, n.model_id, n.secret, n.children, ident, n.max_children)
        if why is not None:
            if why.startswith(NOT_PLACED):
                log.warning("%s: ATTACH refused: %s", self._who(ident), why)
            n._send(ident, protocol.control(Msg.ERROR, message=why, fatal=True))
            n.forget(ident)
            n.drop_conn(ident)
            return
        n.children[ident] = _child(f)
        n.serve.attach(ident)
        bits = protocol.pack_bits(n.store.have if n.reader is None else  # a seeder reading on demand
                                  b"\x01" * n.manifest.n_chunks)  # can serve any chunk
        n._send(ident, protocol.control(Msg.ATTACHED, n_chunks=n.manifest.n_chunks), bits)

    def _reject(self, ident: bytes, reason: str, tell: bool) -> None:
        n = self.node
        n.bad[ident] = n.bad.get(ident, 0) + 1
        n.stats.malformed += 1
        log.warning("%s: %s", self._who(ident), reason)
        if tell or n.bad[ident] == 1:
            n._send(ident, protocol.control(Msg.ERROR, message=reason))
        if n.bad[ident] >= MAX_BAD_MESSAGES:
            log.warning("%s: %d bad messages, ignoring it from now on", self._who(ident), n.bad[ident])
            n.forget(ident)

    def _who(self, ident: bytes) -> str:
        n = self.node
        child = n.children.get(ident)
        if child is not None:
            return f"peer {child.peer_id} (rank {child.rank})"
        member = n.endpoint.who(ident) if n.endpoint is not None else None
        return member or f"unknown peer {ident.hex()[:10]}"


class Child:
    """A partner attached to this node to pull from it."""

    __slots__ = ("peer_id", "rank")

    def __init__(self, peer_id: str, rank: int):
        self.peer_id, self.rank = peer_id, rank


def _child(f: dict) -> Child:
    return Child(f["peer_id"][:MAX_NAME], f["rank"])


def _peer_address(frame) -> str:
    """The address a frame came from (its ZeroMQ metadata), or "local" where it has none (inproc)."""
    try:
        return frame.get("Peer-Address") or "local"
    except (zmq.ZMQError, AttributeError):
        return "local"


def _discard_rest(sock) -> None:
    while sock.getsockopt(RCVMORE):
        sock.recv_into(bytearray())
