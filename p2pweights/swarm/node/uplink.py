"""Uplink probe: a joiner times its uplink by sending the seeder bytes the seeder throws away.

The joiner's kernel does the timing (``TCP_INFO``: the bytes acknowledged over
the time data was in flight, less any time the seeder's receive window held it
back), so neither the seeder's loop, which reads the probe whenever it gets to
it, nor the joiner's, on a busy machine, is in the measurement.  Timed by the
seeder's loop as it read, probes of 50 MB/s uplinks read 13-175 MB/s and
quarter-rate ones 11-28 on the bench's bed; timed this way, 52-65 and 14-15.

The seeder's ``ProbeSink`` listens on a port of its own (WELCOME names it),
drains what arrives and keeps nothing: a connection that sends more than
``MAX_PROBE_BYTES``, or stays silent ``PROBE_IDLE`` seconds, is closed, and
beyond ``PROBE_CONNECTIONS`` at once new ones are closed unread.  The
joiner's side (``time_uplink``) runs on a thread of its own, off the loop.
"""
from __future__ import annotations

import _socket
import logging
import struct
import threading
import time
from collections import namedtuple

from ...errors import P2PError

log = logging.getLogger("p2pw")

PROBE_CONNECTIONS = 64  # probes the sink drains at once; more are closed unread (their joiners time nothing)
PROBE_IDLE = 5.0  # seconds a probe connection may stay silent before the sink closes it
MAX_PROBE_BYTES = 4 << 20  # the sink closes a connection that sends more than this
PROBE_TIMEOUT = 10.0  # seconds a joiner gives its probe (connecting, sending, every byte acknowledged)
_TCP_INFO_LEN = 192  # through tcpi_rwnd_limited (Linux 4.10+); an older kernel returns less
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")  # TCP_INFO's fields, at their offsets below


UplinkTiming = namedtuple("UplinkTiming", "rate took after", defaults=(0.0,))  # a probe: bytes/s over seconds
#   of sending; ``after``: seconds from its start (connecting) to its last byte acknowledged (a join imports no
#   dataclasses: see tests/test_loader.py)


def timing_from(info: bytes, size: int, wall: float) -> UplinkTiming:
    """The timing of ``size`` bytes sent, from the socket's ``TCP_INFO`` once all were acknowledged:
    bytes acknowledged over the kernel's busy time (data in flight) less its receive-window-limited
    time (the receiver not reading), in jiffies, so to 1-4 ms; ``wall``, the sender's own clock
    from the first byte to the last acknowledgement, where the kernel says less."""
    if len(info) >= _TCP_INFO_LEN:
        acked, busy, rwnd_limited = (_U64.unpack_from(info, at)[0] for at in (120, 168, 176))
        took = (busy - rwnd_limited) / 1e6
        if acked >= size and took > 0:
            return UplinkTiming(acked / took, took)
    return UplinkTiming(size / wall, wall)


def split_host_port(addr: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' (a ``tcp://`` prefix allowed) -> (host, port); ValueError if not."""
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def time_uplink(host: str, port: int, size: int, timeout: float = PROBE_TIMEOUT, began: float | None = None
                ) -> UplinkTiming:
    """Send ``size`` zero bytes to a ``ProbeSink`` at host:port and time them (blocks; OSError,
    TimeoutError on failure); ``began``: when the probe was started (``time.monotonic``; default now).
    Through ``_socket``: a join does not import ``socket`` (see ``api.local_ip_towards``)."""
    began = time.monotonic() if began is None else began
    deadline = time.monotonic() + timeout
    # an ASCII name as bytes: given a str, getaddrinfo imports the idna codec (3 ms of every join's start)
    name = host.encode() if host.isascii() else host
    family, kind, proto, _, where = _socket.getaddrinfo(name, port, 0, _socket.SOCK_STREAM)[0]
    s = _socket.socket(family, kind, proto)
    try:
        s.settimeout(timeout)
        # room for every byte at once: one send() hands the kernel the whole probe, which then goes out
        # at the uplink's pace whether or not this thread gets the GIL or a core back in time (refilled
        # in pieces, a starting join's main thread kept it waiting and fast uplinks read 19-20 MB/s)
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDBUF, size)
        s.connect(where)
        start = time.monotonic()
        s.sendall(bytes(size))
        while True:
            info = s.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) < 148 or not (_U32.unpack_from(info, 24)[0] or _U32.unpack_from(info, 144)[0]):  # unacked,
                #                                                                     not sent: all acknowledged
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe bytes to {host}:{port} unacknowledged after {timeout:g} s")
            time.sleep(0.001)
        end = time.monotonic()
        return timing_from(info, size, end - start)._replace(after=end - began)
    finally:
        s.close()


def probe_in_background(host: str, port: int, size: int, report) -> threading.Thread:
    """Run ``time_uplink`` on a daemon thread; ``report(timing)`` gets its result, or None if it failed
    (its ``after`` counts from this call)."""
    began = time.monotonic()

    def run():
        try:
            timing = time_uplink(host, port, size, began=began)
        except (OSError, ValueError) as e:  # the sink unreachable (a firewall, NAT): the rate reviews judge us
            log.debug("uplink probe to %s:%d failed: %s", host, port, e)
            timing = None
        report(timing)

    t = threading.Thread(target=run, name="p2pw-probe", daemon=True)
    t.start()
    return t


class ProbeSink:
    """The seeder's end of the probes: accepts on ``host`` (``port`` 0: any free one), reads and
    discards, on a thread of its own.  ``port`` is where it listens."""

    def __init__(self, host: str, port: int = 0, *, connections: int = PROBE_CONNECTIONS,
                 max_bytes: int = MAX_PROBE_BYTES, idle: float = PROBE_IDLE, clock=time.monotonic):
        bind = "" if host in ("*", "0.0.0.0") else host
        family = _socket.AF_INET6 if ":" in bind else _socket.AF_INET
        self.listener = _socket.socket(family, _socket.SOCK_STREAM)
        self.listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        # a receive window for a whole probe from its first byte (accepted sockets inherit it, the window
        # scale is set at the handshake): the sender never waits on this thread, which shares the GIL with
        # the seeder's loop (left to autotuning, windows grew only as it read, and fast uplinks read 37-52)
        self.listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, max_bytes)
        try:
            self.listener.bind((bind, port))
            self.listener.listen(connections)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.connections, self.max_bytes, self.idle, self.clock = connections, max_bytes, idle, clock
        self.drained = 0  # bytes read and thrown away, all connections together
        self._open: dict = {}  # socket -> [bytes read, last read]
        import selectors  # not on a join's way to ``join()``

        self._selector = selectors.DefaultSelector()
        self._read_event = selectors.EVENT_READ
        self._selector.register(self.listener, self._read_event)
        self._wake_r, self._wake_w = _socket.socketpair()
        self._selector.register(self._wake_r, self._read_event)
        self._stop = threading.Event()
        self._buffer = bytearray(256 << 10)
        self.thread = threading.Thread(target=self._run, name="p2pw-probe-sink", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5)
        for sock in [*self._open, self.listener, self._wake_r, self._wake_w]:
            sock.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is not self._wake_r:
                    self._read(key.fileobj)
            now = self.clock()
            for sock in [s for s, (_, last) in self._open.items() if now - last > self.idle]:
                self._drop(sock)

    def _accept(self) -> None:
        try:
            fd, _ = self.listener._accept()
        except OSError:  # the joiner gave up before we got to it
            return
        sock = _socket.socket(fileno=fd)
        if len(self._open) >= self.connections:
            sock.close()
            return
        sock.setblocking(False)
        self._open[sock] = [0, self.clock()]
        self._selector.register(sock, self._read_event)

    def _read(self, sock) -> None:
        try:
            n = sock.recv_into(self._buffer)
        except BlockingIOError:
            return
        except OSError:
            n = 0
        if not n:
            self._drop(sock)
            return
        self.drained += n
        seen = self._open[sock]
        seen[0] += n
        seen[1] = self.clock()
        if seen[0] > self.max_bytes:
            self._drop(sock)

    def _drop(self, sock) -> None:
        self._selector.unregister(sock)
        del self._open[sock]
        sock.close()


PROBE_PORT_OFFSET = 2  # the probe sink beside the tracker's port: 7422 for 7420 (7421 is the fleet's peers')


def probe_port_for(port: int, probe_port: int | None) -> int:
    """The probe sink's port: ``probe_port`` where given (0: any free one), else the tracker's ``port`` +
    PROBE_PORT_OFFSET, fixed for a firewall; any free one where the tracker itself took any (``port`` 0)."""
    if probe_port is not None:
        return probe_port
    return port + PROBE_PORT_OFFSET if port and port + PROBE_PORT_OFFSET <= 65535 else 0


def probe_sink(host: str, port: int) -> ProbeSink | None:
    """The seeder's (or a standalone tracker's) ``ProbeSink`` on host:port; with port 0 any free one, or None
    where none can listen (joiners then go unprobed, and the rate reviews find slow hosts)."""
    try:
        return ProbeSink(host, port)
    except OSError as e:
        if port:
            raise P2PError(f"cannot listen on {host}:{port} for uplink probes (--probe-port): {e}") from None
        log.warning("no uplink probe sink on %s (%s): slow hosts are found by their rates alone", host, e)
        return None
