"""Handshake: the addresses a node is named by, the HELLO that joins it (following REDIRECTs to the tracker,
checking the WELCOME), and STATUS; what the library, the origin and ``p2pw status`` share to reach a node."""
from __future__ import annotations

import json
import logging
import time

import zmq

from ..errors import P2PError
from ..sources.manifest import Manifest, ManifestError, MAX_MANIFEST_BYTES
from ..swarm.node.member import WAIT_REPORT
from ..swarm.node.node import tcp
from ..wire import keys, protocol
from ..wire.protocol import Msg, ProtocolError, valid_host

log = logging.getLogger("p2pw")


DEFAULT_PORT = 7420


MAX_REDIRECTS = 4


MAX_STRIPES = 64  # parents a WELCOME may name (one link each)


MAX_STATUS_BYTES = 8 << 20  # a STATUS_REPLY larger than this is refused


def parse_addr(addr: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """'HOST[:PORT]' -> (host, port)."""
    addr = addr.removeprefix("tcp://")
    host, sep, port = addr.rpartition(":")
    if not sep or host.count("[") != host.count("]"):  # no port (an IPv6 address's colons are in brackets)
        host, port = addr, default_port
    try:
        port = int(port)
    except ValueError:
        port = -1
    if not valid_host(host) or not 0 < port < 65536:
        raise P2PError(f"bad address {addr!r}: expected HOST[:PORT], PORT in 1-65535")
    return host, port


def local_ip_towards(host: str) -> str:
    """The address of this host on the route to ``host`` (no packet is sent).

    Through ``_socket``, the C module under ``socket``: importing ``socket`` itself builds its enums, 2 ms
    of every join's start-up, paid by every host of a broadcast at once."""
    import _socket

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        s.connect((host, 9))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def status(addr: str, *, key: keys.FleetKey | None = None, timeout: float = 5.0, model_id: str | None = None) -> dict:
    """The fleet as the tracker at ``addr`` (or any peer: it redirects) sees it, slowest first:
    ``{"model_id", "n_chunks", "total_size", "count", "peers": [{"rank", "addr", "sources", "progress",
    "rate", "state", ...}]}``.  Needs no join; ``key`` when the fleet's links are keyed."""
    host, port = parse_addr(addr)
    addr = f"{host}:{port}"
    ctx = zmq.Context()
    try:
        for _ in range(MAX_REDIRECTS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES)
            keys.secure_client(sock, key)
            ask = protocol.control(Msg.STATUS, **({"model_id": model_id} if model_id else {}))
            if not _send_and_wait(sock, addr, ask, timeout, key):
                raise P2PError(no_answer(addr, timeout, " (with --key if the fleet is keyed)"))
            try:
                event = protocol.decode(sock.recv_multipart())
            except ProtocolError as e:
                raise P2PError(f"{addr} is not a compatible p2pw node: {e}") from None
            finally:
                sock.close(0)
            if event.type == Msg.REDIRECT and event.fields["tracker"]:
                addr = event.fields["tracker"]
                continue
            if event.type == Msg.ERROR:
                raise P2PError(f"{addr} refused the status request: {event.fields['message']}")
            if event.type != Msg.STATUS_REPLY:
                raise P2PError(f"{addr} answered STATUS with {event.type.name}")
            try:
                doc = json.loads(bytes(event.payload))
            except ValueError:
                raise P2PError(f"{addr} sent a status reply that is not JSON") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("peers"), list):
                raise P2PError(f"{addr} sent a malformed status reply")
            return doc
        raise P2PError(f"too many redirects asking {addr} for the status")
    finally:
        ctx.destroy(0)


def handshake(ctx, addr: str, hello: dict, model_id: str | None, timeout: float, key=None):
    """HELLO the node at ``addr``, following REDIRECTs to the tracker; returns (socket, addr, welcome, manifest)."""
    for _ in range(MAX_REDIRECTS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MANIFEST_BYTES)
        keys.secure_client(sock, key)
        try:
            event = _hello(sock, addr, hello, timeout, key)
            if event.type == Msg.REDIRECT:
                sock.close(0)
                addr = event.fields["tracker"] or addr
                continue
            return sock, addr, event.fields, _welcome_manifest(event, addr, model_id)
        except BaseException as e:
            sock.close(0)
            if isinstance(e, P2PError):
                e.answered_by = addr  # the node whose answer ended the join: a refusal is remembered for it
            raise
    raise P2PError(f"too many redirects joining through {addr}")


def _send_and_wait(sock, addr: str, frame: bytes, timeout: float, key) -> bool:
    """Connect ``sock`` to ``addr``, send ``frame``, wait for an answer; P2PError if the link is refused."""
    watch = keys.LinkWatch(sock, addr, key)
    sock.connect(tcp(addr))
    sock.send(frame)
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > WAIT_REPORT:  # a line every WAIT_REPORT s while we wait
            if watch.wait(WAIT_REPORT):
                return True
            log.warning("no answer from %s yet: trying for %g s more", addr,
                        round(max(0.0, deadline - time.monotonic()), 1))
        return watch.wait(max(0.0, left))
    except keys.LinkRefused as e:
        raise P2PError(str(e)) from None
    finally:
        watch.close()


def no_answer(addr: str, timeout: float, hint: str = "") -> str:
    """Why ``addr`` said nothing: a name that does not resolve (ZeroMQ retries one silently: it may come up,
    as a Kubernetes service's does), else nobody there."""
    import socket  # only once nothing answered: a join's start-up never looks a name up itself

    host = addr.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        return f"no answer from {addr} within {timeout:g} s: the name {host!r} does not resolve ({e})"
    return f"no answer from {addr} within {timeout:g} s: is a p2pw seeder or peer running there{hint}?"


def _hello(sock, addr: str, hello: dict, timeout: float, key):
    """Send HELLO on ``sock`` to ``addr`` and return the answer: WELCOME or REDIRECT, else P2PError."""
    if not _send_and_wait(sock, addr, protocol.control(Msg.HELLO, **hello), timeout, key):
        raise P2PError(no_answer(addr, timeout))
    try:
        event = protocol.decode(sock.recv_multipart())
    except ProtocolError as e:
        raise P2PError(f"{addr} is not a compatible p2pw node: {e}") from None
    if event.type == Msg.ERROR:
        raise P2PError(f"{addr} refused us: {event.fields['message']}")
    if event.type not in (Msg.WELCOME, Msg.REDIRECT):
        raise P2PError(f"{addr} answered HELLO with {event.type.name}")
    return event


def _welcome_manifest(event, addr: str, model_id: str | None) -> Manifest:
    """Check a WELCOME's tree fields and return its manifest (pinned to ``model_id`` if given)."""
    stripes, parents = event.fields["stripes"], event.fields["parents"]
    if not 1 <= stripes <= MAX_STRIPES or len(parents) > stripes or not all(
            isinstance(p, dict) and isinstance(p.get("addr"), str) and p.get("stripe") in range(stripes)
            and isinstance(p.get("rank"), int) for p in parents):
        raise P2PError(f"{addr} sent a malformed WELCOME: {stripes} stripes, parents {str(parents)[:200]}")
    try:
        return Manifest.from_wire(bytes(event.payload), expect_id=model_id)
    except ManifestError as e:
        raise P2PError(str(e)) from None
