"""Partner handlers: what a partner we pull from sends us, on its link or on one of its lanes.

ATTACHED (what it holds, and how many lanes it takes), HAVE, BYE, ERROR and
CHUNK, each decoded by ``protocol`` and checked against that connection's
state table (``CLIENT_TRANSITIONS`` on a link, ``LANE_TRANSITIONS`` on a
lane); a bad one is counted and logged, and the link stays.  A chunk goes to
the intake only if we asked that partner for it.  Loop thread only.
"""
from __future__ import annotations

import logging

import zmq

from ...wire import protocol
from ...wire.protocol import Msg, ProtocolError
from ..tracker.admission import NOT_PLACED

log = logging.getLogger("p2pw")

NOBLOCK = int(zmq.NOBLOCK)  # a plain int: no enum arithmetic per frame (pyzmq ORs SNDMORE into sends' flags)


class PartnerHandlers:
    """Message handlers for the partners ``node`` pulls from."""

    def __init__(self, node):
        self.node = node

    def on_link(self, link, lane, first) -> None:
        """A message from a partner we pull from, on its link or on one of its lanes (``lane``, else None),
        ``first`` its first frame (the header)."""
        n = self.node
        sock, conn = (link.socket, link.conn) if lane is None else (lane.socket, lane.conn)
        link.last_heard = n.clock()
        last = first  # the last frame read of this message: its ``more`` says whether frames are left
        try:
            event = protocol.decode_header(first.bytes)
            if event.type == Msg.CHUNK:
                if not first.more:
                    raise ProtocolError("CHUNK without its payload frame")
                conn.receive(event)
                self.on_chunk(link, event.indices[0], sock, 0 if lane is None else lane.number)
                return
            rest = rest_of(sock, first)
            last = rest[-1] if rest else first
            conn.receive(event)
            if lane is None:
                self.on_link_control(link, event, rest)
            else:
                self.on_lane_control(link, lane, event)
        except ProtocolError as e:
            discard_after(sock, last)
            n.stats.malformed += 1
            log.warning("partner rank %d (%s) sent a bad message%s: %s", link.rank, link.addr,
                        "" if lane is None else f" on lane {lane.number}", e)

    def on_link_control(self, link, event, payload: list) -> None:
        n = self.node
        if event.type == Msg.ATTACHED:
            bits = bytes(payload[0].buffer) if payload else b""
            size = n.manifest.n_chunks
            if event.fields["n_chunks"] != size or len(bits) != (size + 7) // 8:
                raise ProtocolError(f"ATTACHED bitfield of {len(bits)} bytes for {event.fields['n_chunks']} "
                                    f"chunks; the blob has {size}")
            n.pull.ready(link.rank, protocol.unpack_bits(bits, size))
            if event.fields.get("lanes"):  # it takes that many connections from us: open our other lanes
                n.partners.open_lanes(link, event.fields["lanes"])
        elif event.type == Msg.BYE:  # it is leaving: its requests are asked elsewhere now, not after a timeout
            n.partners.give_up(link.rank, "it left", level=logging.INFO)
        elif event.type == Msg.HAVE:
            if max(event.indices) >= n.manifest.n_chunks:
                raise ProtocolError(f"HAVE names chunk {max(event.indices)}; the blob has {n.manifest.n_chunks}")
            n.pull.has(link.rank, event.indices)
        elif event.type == Msg.ERROR and str(event.fields.get("message")).startswith(NOT_PLACED):
            n.partners.refused(link.rank, str(event.fields.get("message")))  # a stale ticket: ask for a new plan
        elif event.type == Msg.ERROR and event.fields.get("fatal"):
            why = str(event.fields.get("message"))
            if "model id" in why or (n.member is None and len(n.partners.links) <= 1):  # nobody else to ask
                n._fail(f"partner {link.addr} refused us: {why}")
            else:  # full, or it refuses us for now: the other sources, and the tracker's next plan
                n.partners.refused(link.rank, why)
        elif event.type == Msg.ERROR:  # it lost our state (restarted?): attach again, ask again
            log.warning("partner %s: %s; attaching again", link.addr, event.fields.get("message"))
            n.partners.close(link.rank)
            n.partners.open(link.rank, link.addr)

    def on_lane_control(self, link, lane, event) -> None:
        """LANE_OK, a heartbeat or an ERROR on one of ``link``'s lanes (chunks are ``on_chunk``'s)."""
        if event.type == Msg.LANE_OK and event.fields["lane"] != lane.number:
            raise ProtocolError(f"LANE_OK for lane {event.fields['lane']} on lane {lane.number}")
        if event.type == Msg.ERROR:  # refused (or its state lost): the link and its other lanes carry on
            log.info("partner rank %d: lane %d closed: %s", link.rank, lane.number, event.fields.get("message"))
            self.node.partners.close_lane(link, lane)

    def on_chunk(self, link, index: int, sock, lane: int = 0) -> None:
        """A chunk arrived on ``sock`` (``link``'s own connection, or its lane number ``lane``), its payload the
        next frame: hand it to the intake (verified there, and only then written and published), or drop it if
        we did not ask for it."""
        n = self.node
        frame = sock.recv(NOBLOCK, copy=False)  # ZeroMQ's buffer: the workers verify and copy from it
        if frame.more:
            discard_after(sock, frame)
        if index >= n.manifest.n_chunks or not n.pull.expects(link.rank, index):
            if index < n.manifest.n_chunks and n.store.has(index):  # an endgame loser, a stall re-request
                n.stats.duplicates += 1
            else:
                n.stats.malformed += 1
                log.warning("partner rank %d sent chunk %d, which we did not ask it for: dropped", link.rank, index)
            return
        link.last_chunk = n.clock()
        n.stats.chunks_received += 1
        n.stats.bytes_received += len(frame)
        n.stats.lane_chunks[lane] += 1
        if n.faults is not None:
            n.faults.received()
        n.intake.arrived(link.rank, index, frame)


def rest_of(sock, frame) -> list:
    """The frames after ``frame`` of the message being read from ``sock`` (ZeroMQ frames, no copy)."""
    rest = []
    while frame.more:
        frame = sock.recv(NOBLOCK, copy=False)
        rest.append(frame)
    return rest


def discard_after(sock, frame) -> None:
    """Drop the frames after ``frame`` of the message being read from ``sock``."""
    rest_of(sock, frame)
