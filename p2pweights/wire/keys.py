"""Keys: the fleet key, ZeroMQ CURVE on every link, and who may connect.

Key model.  One fleet key pair, made once with ``p2pw keygen DIR`` and copied
to every host of the fleet (seeder and peers) like any deploy secret.  Every
ROUTER (seeder, every peer) is a CURVE server with the fleet secret key;
every DEALER (joiner -> tracker, child -> parent) is a CURVE client that
expects that server key and presents the fleet key pair as its own.  A ZAP
handler on each node admits a client only if its public key is on the
allow-list: every ``*.key`` public key in DIR (so ``fleet.key``; dropping more
public keys there admits them too).  CURVE without ZAP would admit any client
that knows the server's public key, so the ROUTER enforces its ZAP domain: no
handler, no connection.

A host without the fleet secret cannot complete the handshake with any node,
so it never sees a WELCOME (manifest, tree) or a chunk, and every byte on the
wire is encrypted and authenticated.  Any holder of the fleet key is trusted
equally; to revoke one, make a new key and re-seed.  Forged chunks from an
authorized but compromised host are a separate threat: see strong chunk
hashes (``p2pw seed --hash sha256``) in docs/security.md.
"""
from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import struct

import zmq
from ..errors import UserError

KEY_NAME = "fleet"
ZAP_DOMAIN = "p2pw"


class KeyFileError(UserError, ValueError):
    """A key directory that cannot be made or used; the message says why."""


class LinkRefused(ConnectionError):
    """The other side refused this link at the ZeroMQ (CURVE) handshake."""


class FleetKey(NamedTuple):
    """The fleet key pair (z85) and the public keys allowed to connect."""

    public: bytes
    secret: bytes
    allowed: frozenset
    dir: str


def keygen(directory: str) -> FleetKey:
    """Write a new fleet key pair to ``directory`` (created 0700; the secret file 0600); never overwrites one."""
    directory = _key_dir(directory)
    for name in (f"{KEY_NAME}.key", f"{KEY_NAME}.key_secret"):
        if os.path.exists(os.path.join(directory, name)):
            raise KeyFileError(f"{directory} already holds a fleet key ({name}): not overwriting it")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        import zmq.auth  # only for keys: it costs a join without --key nothing

        _, secret_file = zmq.auth.create_certificates(directory, KEY_NAME)
        os.chmod(secret_file, 0o600)
    except OSError as e:
        raise KeyFileError(f"cannot write a key to {directory}: {e.strerror}") from None
    return load(directory)


def _key_dir(directory: str) -> str:
    """``directory`` made absolute; an empty name (an unset shell variable) is an error, not the current one."""
    if not directory.strip():
        raise KeyFileError("the key directory name is empty: give the directory p2pw keygen wrote (--key DIR)")
    return os.path.abspath(directory)


def load(directory: str) -> FleetKey:
    """The fleet key in ``directory`` (as written by ``keygen``) and its allow-list."""
    directory = _key_dir(directory)
    secret_file = os.path.join(directory, f"{KEY_NAME}.key_secret")
    if not os.path.isfile(secret_file):
        raise KeyFileError(f"{directory} holds no fleet key ({KEY_NAME}.key_secret): make one with p2pw keygen")
    try:
        import zmq.auth

        public, secret = zmq.auth.load_certificate(secret_file)
        allowed = set(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read the fleet key in {directory}: {e}") from None
    if not public or not secret or len(public) != 40 or len(secret) != 40:
        raise KeyFileError(f"{secret_file} is not a CURVE key pair")
    return FleetKey(public, secret, frozenset(allowed | {public}), directory)


def secure_server(sock: zmq.Socket, key: FleetKey | None) -> None:
    """Make ``sock`` (before bind) a CURVE server that admits only allowed keys; no-op without a key."""
    if key is None:
        return
    sock.curve_server = True
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket, key: FleetKey | None) -> None:
    """Make ``sock`` (before connect) a CURVE client of a fleet node; no-op without a key."""
    if key is None:
        return
    sock.curve_serverkey = key.public
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret


class _AllowList:
    def __init__(self, key: FleetKey):
        self.allowed = key.allowed

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key in self.allowed


class Gate:
    """The ZAP handler of one ZeroMQ context: admits allow-listed CURVE clients.  ``stop()`` before ``ctx.term()``."""

    def __init__(self, ctx: zmq.Context, key: FleetKey):
        from zmq.auth.thread import ThreadAuthenticator

        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("p2pw.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, _AllowList(key))

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


def gate(ctx: zmq.Context, key: FleetKey | None) -> Gate | None:
    """Start the ZAP handler for ``ctx`` when links are keyed (call before binding a ROUTER)."""
    return Gate(ctx, key) if key is not None else None


class LinkWatch:
    """Watches one DEALER's handshakes, so a refused link fails at once instead of timing out."""

    def __init__(self, sock: zmq.Socket, addr: str, key: FleetKey | None):
        self.sock, self.addr, self.key = sock, addr, key
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                               | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def wait(self, timeout: float) -> bool:
        """True once ``sock`` is readable, False after ``timeout`` s; LinkRefused if the handshake failed."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self.sock in ready:
                return True
            if self.monitor in ready:
                raise LinkRefused(self._reason(monitor_event(self.monitor)))
        return False

    def _reason(self, event: int) -> str:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"{self.addr} refused our key: it is not on that node's allow-list"
        if self.key is None:
            return f"{self.addr} requires encrypted links: join with --key DIR holding the fleet key"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return f"{self.addr} does not use encrypted links (seeded without --key?) or is not a p2pw node"
        return (f"{self.addr} refused our encryption handshake: it does not hold the fleet key in {self.key.dir} "
                f"(another fleet's key, or seeded without --key)")

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)


def monitor_event(sock: zmq.Socket) -> int:
    """The event number of the next socket-monitor message (its first frame starts with a u16).

    Read by hand: ``zmq.utils.monitor`` imports asyncio, 20 ms of every join's start."""
    frames = sock.recv_multipart()
    return struct.unpack_from("=H", frames[0])[0]
