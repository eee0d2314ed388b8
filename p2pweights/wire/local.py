"""The node agent's local API: one JSON line each way on a Unix socket in the agent's cache directory.

A client (``p2pw get --agent DIR``, ``p2pweights.join(..., agent=DIR)``, the vLLM
loader with ``P2PW_AGENT``) connects to ``DIR/agent.sock``, sends one request
line and reads one answer line:

- ``{"op": "get", "model": URL_OR_ID}`` -> ``{"ok": true, "model_id", "path", "complete"}``
  once the agent writes (or holds) the copy at ``path``; the client then reads the
  copy's files through ``storage.localcopy`` as the agent verifies them.
- ``{"op": "status"}`` -> ``{"ok": true, "models": [{model_id, url, path, state, ...}]}``.
- anything refused -> ``{"ok": false, "error": "one line"}``.

The decisions are pure and tested alone: ``admit`` (who may speak: the agent's own
user, root, and members of the group the operator named), ``refusal`` (a request
the agent will not carry out: a model named by a local path outside its cache,
which the agent, often root, would otherwise read for any local user) and
``parse`` (a well-formed request).  ``ask`` is the client; ``ask_until`` asks again, with
``backoff``, while the agent is away (no socket, nothing accepting, the connection closed
before an answer: an agent restarting), for as long as the client's own wait.
"""
from __future__ import annotations

import errno
import json
import os
import re
import logging
import socket
import time

from ..errors import UserError

log = logging.getLogger("p2pw")

SOCKET = "agent.sock"
MAX_LINE = 4096  # bytes of one request or answer line, the newline included (a status answer may be longer)
MAX_ANSWER = 1 << 20
OPS = ("get", "status")
ENV = "P2PW_AGENT"
MODEL_ID = re.compile(r"[0-9a-f]{16,64}")
ANSWER_WAIT = 660.0  # seconds a request waits for its answer by default (the agent's own start wait, and some)
BACKOFF = 0.2  # seconds before asking an agent that is away again, doubling up to BACKOFF_MAX
BACKOFF_MAX = 5.0


class AgentError(UserError):
    """The agent cannot be reached, refused the request, or answered something this client cannot read."""


class AgentAway(AgentError):
    """Nobody answers on the agent's socket now (not started, stopped, restarting): worth asking again."""


def backoff(tries: int) -> float:
    """Seconds to wait before try ``tries + 1`` of an agent that is away: BACKOFF doubling up to BACKOFF_MAX."""
    return min(BACKOFF * 2 ** max(tries, 0), BACKOFF_MAX)


def encode(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict:
    """One JSON object, or AgentError."""
    try:
        doc = json.loads(line.decode())
    except (UnicodeDecodeError, ValueError):
        raise AgentError("not a JSON line") from None
    if not isinstance(doc, dict):
        raise AgentError("not a JSON object")
    return doc


def parse(doc: dict) -> tuple[str, str | None]:
    """``(op, model)`` of a well-formed request, or AgentError saying what is wrong."""
    op = doc.get("op")
    if op not in OPS:
        raise AgentError(f"unknown op {op!r}: expected one of {', '.join(OPS)}")
    model = doc.get("model")
    if op == "get" and (not isinstance(model, str) or not model.strip() or len(model) > 2048 or "\0" in model):
        raise AgentError("get needs \"model\": a URL or a model id")
    return op, model.strip() if op == "get" else None


def inside(root: str, path: str) -> bool:
    """Whether ``path`` resolves (symlinks followed) to ``root`` or below it."""
    root, path = os.path.realpath(root), os.path.realpath(path)
    return path == root or path.startswith(root.rstrip("/") + "/")


def is_local_path(model: str) -> bool:
    """Whether a model is named by a local path rather than by an id, ``s3://`` URL or ``ORG/NAME`` repo."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..") or os.path.isabs(model)


def refusal(model: str, cache_root: str) -> str | None:
    """Why the agent refuses to fetch ``model`` for a local client, or None.  A local path outside the cache is
    refused: the agent, often root, would read those files as the origin for any local user; list such
    origins in the operator's --prewarm file instead."""
    if is_local_path(model) and not inside(cache_root, model):
        return (f"{model} is a path outside the agent's cache {cache_root}: the agent reads local origins only "
                "from its --prewarm file")
    return None


def admit(uid: int, gid: int, groups, agent_uid: int, group: int | None) -> str | None:
    """Why a client (its uid, primary gid and supplementary groups, from SO_PEERCRED and /proc) is refused, or
    None: the agent's own user and root may speak, and members of ``group`` where the operator named one."""
    if uid in (agent_uid, 0):
        return None
    if group is not None and (gid == group or group in set(groups)):
        return None
    return f"uid {uid} may not use this agent (its own user, root{', and group %d' % group if group is not None else ''})"


def socket_path(agent_dir: str) -> str:
    return os.path.join(os.path.abspath(agent_dir), SOCKET)


def agent_dir(given: str | None, env=os.environ) -> str | None:
    """The agent's directory: ``given`` (--agent), else ``P2PW_AGENT``, else None."""
    return given or env.get(ENV) or None


def read_line(sock: socket.socket, limit: int) -> bytes:
    """Bytes up to the first newline (AgentError past ``limit`` bytes or at EOF before one)."""
    buf = bytearray()
    while b"\n" not in buf:
        part = sock.recv(65536)
        if not part:
            raise AgentAway("the connection closed before a whole line")
        buf += part
        if len(buf) > limit:
            raise AgentError(f"a line longer than {limit} bytes")
    return bytes(buf[:buf.index(b"\n")])


def ask(agent: str, request: dict, timeout: float | None = None) -> dict:
    """Send ``request`` to the agent whose directory is ``agent``; its answer (AgentError if it refused,
    AgentAway if nobody answers there now).  ``timeout``: seconds for the answer (default ANSWER_WAIT)."""
    timeout = ANSWER_WAIT if timeout is None else timeout
    path = socket_path(agent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise AgentAway(f"no p2pw agent at {agent} (no {path}): start p2pw agent --cache {agent}") from None
        except ConnectionRefusedError:
            raise AgentAway(f"the p2pw agent at {agent} is not running ({path} accepts nothing)") from None
        except PermissionError:
            raise AgentError(f"not allowed to use the p2pw agent's socket {path} (it admits its own user, root, "
                             "and the group given with --socket-group)") from None
        try:
            sock.sendall(encode(request))
        except OSError as e:  # a refusal may be answered and the socket closed before the request is read:
            if e.errno not in (errno.ECONNRESET, errno.EPIPE):  # the answer waits in our receive buffer
                raise
        try:
            line = read_line(sock, MAX_ANSWER)
        except socket.timeout:
            raise AgentError(f"the p2pw agent at {agent} did not answer in {timeout:g} s") from None
        except AgentAway:
            raise AgentAway(f"the p2pw agent at {agent} closed the connection before answering") from None
        except OSError as e:
            if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                raise
            raise AgentAway(f"the p2pw agent at {agent} closed the connection") from None
        answer = decode(line)
    finally:
        sock.close()
    if not answer.get("ok"):
        raise AgentError(f"the p2pw agent at {agent}: {answer.get('error') or 'refused'}")
    return answer


def ask_until(agent: str, request: dict, wait: float, timeout: float | None = None, clock=time.monotonic,
              sleep=time.sleep) -> dict:
    """``ask``, asked again after ``backoff`` while the agent is away, for up to ``wait`` seconds (then the last
    AgentAway, its line saying how long it waited)."""
    deadline, tries = clock() + wait, 0
    while True:
        try:
            return ask(agent, request, timeout)
        except AgentAway as e:
            pause = backoff(tries)
            if clock() + pause > deadline:
                raise AgentAway(f"{e} (waited {wait:g} s)") from None
            if not tries:
                log.warning("%s: asking again for up to %.0f s", e, wait)
            tries += 1
            sleep(pause)
