"""Console: what every command shares with its terminal and its process: lines said (text or JSON), the one
error line, JSON reports, the fleet key and the model cache its flags name, probes, serving until signalled."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading

from ..errors import UserError

log = logging.getLogger("p2pw")
events = logging.getLogger("p2pw.events")  # what the CLI tells its user: stdout lines, or JSON log lines


def human(n: float) -> str:
    from ..ops.progress import human as _human

    return _human(n)


LOG = {"format": "text"}


context = None  # ops.LogContext of this process, once logging is configured


def say(event: str, text: str, **fields) -> None:
    """One line for the user: printed on stdout, or with --log-format json one JSON log line."""
    if LOG["format"] == "json":
        events.info(text.removeprefix("p2pw: "), extra={"event": event, **fields})
    else:
        print(text, flush=True)


def start_ops(args, starting: str):
    """The --http server, listening before anything else happens (None without --http)."""
    if not getattr(args, "http", None):
        return None
    from ..ops.http import OpsServer

    server = OpsServer(args.http)
    server.readiness.starting = starting
    events.info("serving /healthz /readyz /metrics on %s", server.addr,
                extra={"event": "http", "addr": server.addr, "port": server.port})
    return server


def bind(server, handle) -> None:
    """The node exists: probes, metrics and log lines read it from now on."""
    if server is not None:
        server.bind(handle)
    if context is not None:
        context.handle = handle


def error(message: str) -> None:
    """The one error line: ``p2pw: error: ...`` on stderr (a JSON log line with --log-format json)."""
    if LOG["format"] == "json":
        events.error(message, extra={"event": "error"})
    else:
        print(f"p2pw: error: {message}", file=sys.stderr)


def write_json(path: str | None, doc: dict) -> None:
    if path:
        from ..storage.cache import write_text_atomically
        write_text_atomically(path, json.dumps(doc, indent=1))


def serve_until_signalled(finished=lambda: False, every: float = 0.1) -> None:
    """Block until SIGINT or SIGTERM (ending cleanly, not with a traceback) or until ``finished()``."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(every) and not finished():
        pass


def serve_until_fatal(owner, finished=lambda: False, every: float = 0.1) -> int:
    """Serve until a signal, ``finished()`` or the node's fatal error, then close ``owner`` (a seeder, tracker or
    download); 1 with that error said once, else 0."""
    try:
        serve_until_signalled(lambda: owner.node.fatal is not None or finished(), every)
    finally:
        owner.close()
    if owner.node.fatal is not None:
        error(owner.node.fatal)
        return 1
    return 0


def load_key(directory: str | None):
    """The fleet key in ``directory``, or None when links stay unencrypted."""
    from ..wire.keys import load

    return load(directory) if directory is not None else None


def tell_path(path: str) -> None:
    """The copy's directory as the last line on stdout, for scripts (with --log-format json, an event)."""
    if LOG["format"] == "json":
        say("path", f"p2pw: the copy is in {path}", path=path)
    else:
        print(path, flush=True)


def model_cache(args, needed: bool = True):
    """The node's model cache; where its folder cannot be written, None for a join that writes elsewhere
    (--out, --hf-cache: it just is not remembered), else one error line."""
    from ..storage.modelcache import ModelCache

    cache = ModelCache(size=args.cache_size)
    try:
        os.makedirs(cache.root, exist_ok=True)
        writable = os.access(cache.root, os.W_OK)
    except OSError:
        writable = False
    if writable:
        return cache
    if needed:
        raise UserError(f"cannot write the model cache {cache.root}: set P2PW_CACHE_DIR, or give --out DIR "
                        "(or --no-cache to keep the copy in memory)")
    log.warning("cannot write the model cache %s: this copy is not remembered there", cache.root)
    return None
