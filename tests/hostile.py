"""Hostile peers for tests: a stranger speaking the real wire protocol over a real ZeroMQ socket.

``Stranger`` is a DEALER that sends whatever HELLO, ATTACH, ORPHAN, STATUS or
raw frame a test builds to a node's port and reads what comes back.
``Redirector`` is a fake node that answers every HELLO and STATUS with a
REDIRECT to a target of the test's choosing.  Both end their sockets (and the
redirector its thread) on ``close``.
"""
from __future__ import annotations

import threading

import zmq

from p2pweights.wire import protocol
from p2pweights.wire.protocol import Msg, ProtocolError


class Stranger:
    """One connection to a node at 127.0.0.1:``port``, as anyone on the network may open."""

    def __init__(self, port: int, ctx: zmq.Context | None = None, source: str | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{f'{source}:0;' if source else ''}127.0.0.1:{port}")  # source: another loopback

    def send(self, kind: Msg, **fields) -> None:
        self.sock.send(protocol.control(kind, **fields))

    def raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def answer(self, timeout: float = 5.0, skip=(Msg.HEARTBEAT,)) -> protocol.Event | None:
        """The next message (heartbeats skipped), or None if nothing came within ``timeout`` seconds."""
        while self.sock.poll(int(timeout * 1000)):
            event = protocol.decode(self.sock.recv_multipart())
            if event.type not in skip:
                return event
        return None

    def ask(self, kind: Msg, timeout: float = 5.0, **fields) -> protocol.Event | None:
        self.send(kind, **fields)
        return self.answer(timeout)

    def close(self) -> None:
        self.sock.close(0)


class Redirector:
    """A fake node on 127.0.0.1 that answers HELLO and STATUS with ``REDIRECT tracker=target``.

    The target goes out as given, past this side's own field checks: the real protocol's header, any body."""

    def __init__(self, target: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.target, self.asked = target, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            try:
                kind = protocol.decode(frames).type
            except ProtocolError:
                continue
            if kind in (Msg.HELLO, Msg.STATUS):
                self.asked += 1
                self.sock.send_multipart([ident, protocol.control(Msg.REDIRECT, tracker=self.target)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def publish(port: int, url: str, manifest, source: str | None = None, hello: bool = False,
            ctx: zmq.Context | None = None) -> tuple[protocol.Event | None, Stranger]:
    """A stranger (from loopback address ``source``) publishes ``manifest`` for ``url`` at the tracker on ``port``;
    with ``hello``, it then joins that model's swarm as a member that heartbeats nothing.  The answer (to the
    HELLO where asked, else to the PUBLISH) and the open connection, for the test to close."""
    s = Stranger(port, ctx, source)
    s.raw(protocol.control(Msg.PUBLISH, url=url), manifest.wire_bytes())
    answer = s.answer(10)
    if hello and answer is not None and answer.type == Msg.PUBLISHED:
        answer = s.ask(Msg.HELLO, 10, peer_id=f"stranger-{manifest.model_id[:8]}", listen="127.0.0.1:9",
                       model_id=manifest.model_id)
    return answer, s
