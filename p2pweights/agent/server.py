"""The agent's local API on ``CACHE/agent.sock`` (``wire.local``): a thread per connection, at most ``MAX_CLIENTS``.

The socket is made with mode 0600 (0660 and the operator's group with ``--socket-group``);
every client is checked again by its credentials (``SO_PEERCRED``), so a socket whose
mode was widened still admits only the agent's user, root and that group.
"""
from __future__ import annotations

import grp
import logging
import os
import socket
import stat
import struct
import threading

from ..errors import UserError
from ..wire import local

log = logging.getLogger("p2pw")

MAX_CLIENTS = 64
READ_TIMEOUT = 10.0  # seconds a client has to send its request line


class SocketError(UserError):
    """The agent's socket cannot be made where it belongs."""


def group_id(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise SocketError(f"--socket-group {name}: no such group") from None


def peer(conn: socket.socket) -> tuple[int, int, int, list[int]]:
    """``(pid, uid, gid, supplementary groups)`` of the process at the other end."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    groups = []
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups = [int(g) for g in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return pid, uid, gid, groups


def bind(root: str, group: int | None) -> tuple[socket.socket, str]:
    """A listening socket at ``root/agent.sock``, mode 0600 (0660, group ``group``); a stale one is replaced."""
    path = local.socket_path(root)
    if not local.inside(root, os.path.dirname(path)) or os.path.islink(path):
        raise SocketError(f"{path} is not inside the cache {root}")
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SocketError(f"{path} exists and is not a socket: remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise SocketError(f"another p2pw agent serves {root} ({path} answers)")
        except (ConnectionRefusedError, FileNotFoundError):
            os.remove(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
        os.chmod(path, 0o660)
    sock.listen(64)
    return sock, path


class LocalServer:
    """Answers ``get`` and ``status`` for ``keeper`` on the socket in ``root``."""

    def __init__(self, root: str, keeper, group: str | None = None, status=lambda: {}):
        self.root, self.keeper, self.status = root, keeper, status
        self.group = group_id(group)
        self.sock, self.path = bind(root, self.group)
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.refused = 0
        self.thread = threading.Thread(target=self._accept, name="p2pw-agent-sock", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            if not self.slots.acquire(blocking=False):
                self._say(conn, {"ok": False, "error": f"busy: {MAX_CLIENTS} clients already"})
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="p2pw-agent-client", daemon=True).start()

    @staticmethod
    def _say(conn, doc: dict) -> None:
        try:
            conn.sendall(local.encode(doc))
        except OSError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            _, uid, gid, groups = peer(conn)
            why = local.admit(uid, gid, groups, os.geteuid(), self.group)
            if why is not None:
                self.refused += 1
                log.warning("agent socket: refused a client: %s", why)
                return self._say(conn, {"ok": False, "error": why})
            conn.settimeout(READ_TIMEOUT)
            try:
                request = local.decode(local.read_line(conn, local.MAX_LINE))
            except (OSError, local.AgentError) as e:
                return self._say(conn, {"ok": False, "error": f"bad request: {e}"})
            conn.settimeout(None)
            self._say(conn, self.answer(request))
        finally:
            conn.close()
            self.slots.release()

    def answer(self, request: dict) -> dict:
        """The answer to one request (every refusal is one line in ``error``)."""
        try:
            op, model = local.parse(request)
            if op == "status":
                return {"ok": True, "models": self.keeper.models(), **self.status()}
            why = local.refusal(model, self.keeper.cache.root)
            if why is not None:
                self.refused += 1
                return {"ok": False, "error": why}
            h = self.keeper.get(model)
            return {"ok": True, "model_id": h.model_id, "path": h.path, "complete": h.state == "ready"}
        except (UserError, OSError) as e:
            return {"ok": False, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
