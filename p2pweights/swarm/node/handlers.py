"""Handlers: what each incoming message does to a node, one small named handler per message.

``Handlers.dispatch`` drains one ready socket of the node's loop: the ROUTER
(partners pulling from us, joiners, the tracker's members), a DEALER to a
partner we pull from or one of its lanes (``pulled``), the tracker link, or
the inbox of other threads.  Each message is decoded by ``protocol`` and
checked against its connection's state table; a bad one is counted and
logged, and the node keeps serving everyone else.
"""
from __future__ import annotations

import logging
import struct

import zmq

from ...wire import protocol
from ...wire.protocol import MAX_NAME, SERVER_TRANSITIONS, Connection, Msg, ProtocolError
from ..tracker.admission import NOT_PLACED, attach_refusal, placed_refusal
from .intake import MAX_BAD_FROM_PARENT  # noqa: F401  (part of the node's limits)
from .originread import landed
from .pulled import NOBLOCK, PartnerHandlers, rest_of

log = logging.getLogger("p2pw")

MAX_BAD_MESSAGES = 32  # malformed messages before a connection is ignored
DRAIN = 64  # messages taken from one socket per poll
DRAIN_SECONDS = 0.02  # and at most this long, so timers (heartbeats) keep their pace under load
READY = struct.Struct("<I?")  # read-ahead -> loop: chunk index, matched the manifest


class Handlers:
    """Message handlers of one node (its loop thread only)."""

    def __init__(self, node):
        self.node = node
        self.pulled = PartnerHandlers(node)  # what partners we pull from send us

    def dispatch(self, sock) -> None:
        n = self.node
        if sock is n.router:
            handler = self.on_router
        elif sock is n.tracker_link:
            handler = self.on_tracker
        elif sock is n.inbox:
            handler = self.on_inbox
        else:
            owned = n.partners.owner.get(sock)  # (link, lane): a link's own connection, or one of its lanes
            if owned is None:
                watched = next((lk for lk in n.partners.links.values() if lk.monitor is sock), None)
                if watched is not None:  # a partner's connection event
                    n.partners.dropped(watched)
                return  # else: closed earlier in this poll
            link, lane = owned
            handler = lambda s, first: self.pulled.on_link(link, lane, first)  # noqa: E731
        deadline = n.clock() + DRAIN_SECONDS
        for _ in range(DRAIN):
            if sock.closed:  # a handler may close it (partner given up)
                return
            try:  # the message's first frame; the handler reads the rest (``first.more``)
                first = sock.recv(NOBLOCK, copy=False)
            except zmq.Again:  # drained (one exception a drain costs less than asking EVENTS a message)
                return
            handler(sock, first)
            if n.clock() > deadline:
                return

    # ----- inbox: other threads ------------------------------------------

    def on_inbox(self, sock, first) -> None:
        verb, body = first.bytes, b"".join(f.bytes for f in rest_of(sock, first))
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

    # ----- tracker link (peers only) ---------------------------------------

    def on_tracker(self, sock, first) -> None:
        n = self.node
        try:
            frames = [first.bytes, *(f.bytes for f in rest_of(sock, first))]
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

    def on_router(self, sock, first) -> None:
        n = self.node
        if not first.more:  # the ROUTER's identity frame and nothing after it: not a message
            return
        ident = first.bytes
        conn = n.conns.get(ident)
        head = sock.recv(NOBLOCK, copy=False)  # the message's first frame: a new connection's says where it is from
        frames = [head.bytes, *(f.bytes for f in rest_of(sock, head))]
        n.seen[ident] = n.clock()
        if n.bad.get(ident, 0) >= MAX_BAD_MESSAGES:
            return
        if conn is None:
            if not n.admission.admit(ident, _peer_address(head)):
                n._send(ident, protocol.control(Msg.ERROR, fatal=True, message=(
                    f"too many connections from {_peer_address(head)} (at most {n.admission.max_per_host})")))
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
        elif kind == Msg.LANE:
            self.on_lane(ident, event.fields)
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
        elif kind == Msg.BYE and (ident in n.children or n.lanes.is_lane(ident)):  # a child (or its lane) is done
            n.forget(ident)  # with us: nothing more to send it, and its places under its address's cap are free
            n.drop_conn(ident)
        elif kind in (Msg.HELLO, Msg.STATUS) and n.endpoint is None:
            n._send(ident, protocol.control(Msg.REDIRECT, tracker=n.tracker_addr))
            n.drop_conn(ident)  # sent on: it holds no state here (nor a place under its address's cap)
        elif n.endpoint is not None and kind in n.endpoint.HANDLERS:
            if n.endpoint.HANDLERS[kind](n.endpoint, ident, event.fields) is False:
                n.drop_conn(ident)

    def on_attach(self, ident: bytes, f: dict) -> None:
        n = self.node
        why, older = attach_refusal(f, n.model_id, n.secret, n.children, ident, n.max_children, n.admission)
        if why is not None:
            if why.startswith(NOT_PLACED):
                log.warning("%s: ATTACH refused: %s", self._who(ident), why)
            n._send(ident, protocol.control(Msg.ERROR, message=why, fatal=True))
            n.forget(ident)
            n.drop_conn(ident)
            return
        if older is not None:  # one child per rank: the newer ticket's holder takes its place
            log.info("%s: replaced by a newer ATTACH as its rank", self._who(older))
            n._send(older, protocol.control(Msg.ERROR, fatal=True, message=(
                f"{NOT_PLACED}: another connection attached as rank {f['rank']} with its ticket")))
            n.forget(older)
            n.drop_conn(older)
        n.children[ident] = _child(f)
        n.serve.attach(ident)
        bits = protocol.pack_bits(n.store.have if n.reader is None else  # a seeder reading on demand
                                  b"\x01" * n.manifest.n_chunks)  # can serve any chunk
        n._send(ident, protocol.control(Msg.ATTACHED, n_chunks=n.manifest.n_chunks, lanes=n.lanes.max_lanes), bits)

    def on_lane(self, ident: bytes, f: dict) -> None:
        """LANE: connection ``ident`` carries chunks for a child attached from the same address with the same
        rank, peer id and ticket (``lanes``); anything else is refused, one error to that connection."""
        n = self.node
        why = placed_refusal(f, n.model_id, n.secret)
        if why is None:
            link = n.lanes.child_of(n.children, f["rank"], f["peer_id"])
            if link is not None and n.secret is not None and n.children[link].ticket != f.get("ticket"):
                link = None  # attached with another ticket: not that child's lane
            same = link is not None and n.admission.host.get(ident) == n.admission.host.get(link)
            why = n.lanes.refusal(link, f["lane"], same)
        if why is not None:
            log.info("%s: LANE refused: %s", self._who(ident), why)
            n._send(ident, protocol.control(Msg.ERROR, message=why, fatal=True))
            n.drop_conn(ident)
            return
        n.lanes.add(link, ident)
        n._send(ident, protocol.control(Msg.LANE_OK, lane=f["lane"]))

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
        child = n.children.get(n.lanes.child.get(ident, ident))  # a lane: the child it carries chunks for
        if child is not None:
            return f"peer {child.peer_id} (rank {child.rank})"
        member = n.endpoint.who(ident) if n.endpoint is not None else None
        return member or f"unknown peer {ident.hex()[:10]}"


class Child:
    """A partner attached to this node to pull from it."""

    __slots__ = ("peer_id", "rank", "ticket")

    def __init__(self, peer_id: str, rank: int, ticket: str | None = None):
        self.peer_id, self.rank, self.ticket = peer_id, rank, ticket


def _child(f: dict) -> Child:
    return Child(f["peer_id"][:MAX_NAME], f["rank"], f.get("ticket"))


def _peer_address(frame) -> str:
    """The address a frame came from (its ZeroMQ metadata), or "local" where it has none (inproc)."""
    try:
        return frame.get("Peer-Address") or "local"
    except (zmq.ZMQError, AttributeError):
        return "local"
