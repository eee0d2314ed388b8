"""Tracker server: the event loop of ``p2pw tracker``, a standalone tracker for any number of swarms.

One thread owns the ROUTER; it decodes each message (``protocol``), checks it
against its connection's state table, and hands it to the ``registry``, which
routes it to the swarm of its model id.  Every half second it heartbeats
every member, reviews each swarm's rates and publishes its fleet snapshot.
A malformed message costs its sender one ERROR (after 32, it is ignored),
never the loop; connections per address are capped (``admission``), and a
PUBLISH from an address ``publishers`` does not list gets one ERROR.  A
member's report from a connection that is no member here (a restarted
tracker's: what the member queued while it was away) is a stray: counted,
dropped, and answered with one ``NOT_A_MEMBER`` a connection every
``STRAY_TELL_EVERY`` seconds.  With a state folder (``statedir``) the
registry's manifests and URL bindings are written after each change.  It moves
no chunk bytes: its memory is the swarms' manifests and membership.
"""
from __future__ import annotations

import logging
import threading
import time

import zmq

from ...sources.manifest import MAX_MANIFEST_BYTES
from ...wire import protocol
from ...wire.protocol import SERVER_TRANSITIONS, Connection, Msg, ProtocolError
from ..tracker.admission import MAX_PER_HOST, Admission
from .handlers import MAX_BAD_MESSAGES, _peer_address
from .node import HEARTBEAT_INTERVAL, IDLE_FORGET, TIMER_INTERVAL
from ..tracker.publishers import Publishers
from ..tracker.registry import NOT_A_MEMBER

MAX_MESSAGE = MAX_MANIFEST_BYTES + (64 << 10)  # the tracker's ROUTER takes a PUBLISH of the largest manifest
MEMBER_REPORTS = frozenset({Msg.HEARTBEAT, Msg.READ, Msg.DONE, Msg.LEAVE, Msg.ORPHAN, Msg.PROBE})
STRAY_TELL_EVERY = 10.0  # seconds between NOT_A_MEMBER answers to one connection's strays

log = logging.getLogger("p2pw")


class TrackerServer:
    """Serves the ``registry``'s swarms on ``router`` (bound by ``node.bind_router``) from a thread of its own."""

    def __init__(self, router: zmq.Socket, registry, max_per_host: int = MAX_PER_HOST, clock=time.monotonic,
                 publishers: Publishers | None = None, state=None):
        self.router, self.registry, self.clock, self.state = router, registry, clock, state
        self.publishers = publishers or Publishers()
        self.admission = Admission(max_per_host)
        self.conns: dict[bytes, Connection] = {}
        self.bad: dict[bytes, int] = {}
        self.seen: dict[bytes, float] = {}
        self.malformed = 0
        self.strays = 0  # member reports from connections that are no member here, dropped
        self.told: dict[bytes, float] = {}  # connection -> when it was last told NOT_A_MEMBER
        self.save_failed = False
        self.next_beat = self.next_timers = self.next_prune = 0.0
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.fatal: str | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="p2pw-tracker", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                if poller.poll(50):
                    for _ in range(256):
                        if not self.router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            break
                        self._receive()
                self._save()  # before the answers: a publisher told PUBLISHED has its manifest on disk
                self._flush()  # before the timers: a joiner hears WELCOME before any heartbeat
                self._tick(self.clock())
                self._save()
                self._flush()
        except Exception as e:  # a bug: end loudly rather than serve nobody
            log.exception("tracker loop crashed")
            self.fatal = f"internal error: {e!r}"
        finally:
            self.router.close(0)

    def _receive(self) -> None:
        ident, *frames = self.router.recv_multipart(copy=False)
        ident = ident.bytes
        self.seen[ident] = self.clock()
        if self.bad.get(ident, 0) >= MAX_BAD_MESSAGES:
            return
        conn = self.conns.get(ident)
        if conn is None:
            where = _peer_address(frames[0]) if frames else "local"
            if not self.admission.admit(ident, where):
                self._send(ident, protocol.control(Msg.ERROR, fatal=True, message=(
                    f"too many connections from {where} (at most {self.admission.max_per_host})")))
                return
            conn = self.conns[ident] = Connection(SERVER_TRANSITIONS, "new")
        try:
            msg = protocol.decode([f.bytes for f in frames])
            if msg.type in MEMBER_REPORTS and ident not in self.registry.conns:
                return self._stray(ident)
            event = conn.receive(msg)
            if event.type == Msg.ERROR:
                return
            self._handle(ident, event)
        except ProtocolError as e:
            self._reject(ident, str(e), isinstance(e, protocol.VersionMismatch))
        except Exception as e:  # never let one peer take the tracker down
            log.exception("handling a message")
            self._reject(ident, f"could not handle its message: {e!r}", False)

    def _handle(self, ident: bytes, event) -> None:
        reg, kind = self.registry, event.type
        if kind == Msg.PUBLISH:
            where = self.admission.host.get(ident, "local")
            if not self.publishers.allows(where):
                keep = reg.refuse(ident, f"{where} may not publish here (this tracker takes manifests from its "
                                         "--publish-from addresses only)")
            else:
                keep = reg.publish(ident, event.fields, event.payload, where, self.publishers.operator(where))
        elif kind in reg.HANDLERS:
            keep = reg.HANDLERS[kind](reg, ident, event.fields)
        else:
            keep = reg.route(ident, kind, event.fields)
        if keep is False and ident not in reg.conns:
            self._drop(ident)

    def _stray(self, ident: bytes) -> None:
        """A member's report on a connection that is no member here: dropped, counted; the sender is told to
        introduce itself, once a ``STRAY_TELL_EVERY``."""
        self.strays += 1
        now = self.clock()
        if now - self.told.get(ident, -STRAY_TELL_EVERY) >= STRAY_TELL_EVERY:
            self.told[ident] = now
            self._send(ident, protocol.control(Msg.ERROR, message=NOT_A_MEMBER))

    def _save(self) -> None:
        """The registry's manifests and bindings written to the state folder, if they changed; a failure is
        one log line (tried again at the next change), never the loop."""
        if not self.registry.dirty or self.state is None:
            return
        self.registry.dirty = False
        try:
            self.state.save(*self.registry.kept())
            self.save_failed = False
        except OSError as e:
            if not self.save_failed:
                log.error("state %s not written: %s (a restart forgets what changed since)", self.state.path, e)
            self.save_failed = True

    def _reject(self, ident: bytes, reason: str, tell: bool) -> None:
        self.bad[ident] = self.bad.get(ident, 0) + 1
        self.malformed += 1
        who = self.registry.who(ident) or f"unknown peer {ident.hex()[:10]}"
        log.warning("%s: %s", who, reason)
        if tell or self.bad[ident] == 1:
            self._send(ident, protocol.control(Msg.ERROR, message=reason))
        if self.bad[ident] >= MAX_BAD_MESSAGES:
            log.warning("%s: %d bad messages, ignoring it from now on", who, self.bad[ident])
            self.registry.forget(ident)

    def _drop(self, ident: bytes) -> None:
        """Keep no state for connection ``ident`` (it no longer counts against its address's cap)."""
        self.conns.pop(ident, None)
        self.admission.release(ident)

    def _send(self, ident: bytes, *frames) -> None:
        try:
            self.router.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.registry.forget(ident)
            self._drop(ident)

    def _flush(self) -> None:
        for ident, frames in self.registry.take():
            self._send(ident, *frames)

    def _tick(self, now: float) -> None:
        if now < self.next_timers:
            return
        self.next_timers = now + TIMER_INTERVAL
        self.registry.review(now)
        if now >= self.next_beat:
            self.next_beat = now + HEARTBEAT_INTERVAL
            beat = protocol.control(Msg.HEARTBEAT)
            for ident in self.registry.members():
                self._send(ident, beat)
        if now >= self.next_prune:  # strangers and askers that went quiet hold nothing here
            self.next_prune = now + IDLE_FORGET / 2
            for ident in [i for i, t in self.seen.items() if now - t > IDLE_FORGET and i not in self.registry.conns]:
                del self.seen[ident]
                self.bad.pop(ident, None)
                self.told.pop(ident, None)
                self._drop(ident)
