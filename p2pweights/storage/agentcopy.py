"""A copy kept by the node agent, as a local client reads it.

``through_agent`` asks the agent (``wire.local``) for a model; the agent answers with the
folder of its copy once it writes or holds it, and the client attaches to that folder
(``localcopy``): it maps the files read-only and uses each chunk once the agent verified
it, so tensors are usable before the last chunk lands.  ``link_tree`` puts a complete
copy's files in another folder: hard links, copies only across filesystems (or where
the kernel refuses a link to another user's file).
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import time

from ..errors import P2PError
from ..wire import local
from .cache import copy_paths
from .localcopy import Attached, WriterGone, attach, complete_copy, writer_active

log = logging.getLogger("p2pw")

RETRIES = 3  # times a client asks again when the agent's writer stopped short (the agent resumes the copy)


def through_agent(agent: str, model: str, model_id: str | None = None, device: str | None = None,
                  timeout: float | None = None) -> Attached:
    """Ask the agent at ``agent`` for ``model`` (a URL or a model id) and attach to its copy."""
    for tries_left in reversed(range(RETRIES)):
        answer = local.ask(agent, {"op": "get", "model": model}, timeout)
        if not isinstance(answer.get("path"), str) or not isinstance(answer.get("model_id"), str):
            raise local.AgentError(f"the p2pw agent at {agent} answered without a path and a model id")
        if model_id is not None and not answer["model_id"].startswith(model_id.lower()):
            raise P2PError(f"the p2pw agent at {agent} holds model {answer['model_id'][:16]} for {model}, "
                           f"not {model_id[:16]}")
        try:
            return attach(answer["path"], answer["model_id"], device)
        except (WriterGone, P2PError):
            if not tries_left:
                raise
            log.warning("the agent's copy of %s in %s is not there yet: asking again", model, answer["path"])
    raise AssertionError("unreachable")


def wait_through_agent(agent: str, model: str, model_id: str | None = None, timeout: float | None = None) -> Attached:
    """``through_agent``, then wait for every chunk; asked again if the agent's writer stopped short."""
    for tries_left in reversed(range(RETRIES)):
        dl = through_agent(agent, model, model_id, timeout=timeout)
        try:
            dl.wait()
            _final(dl)
            return dl
        except WriterGone:
            dl.close()
            if not tries_left:
                raise
            log.warning("the agent stopped writing %s: asking again", model)
        except BaseException:
            dl.close()
            raise
    raise AssertionError("unreachable")


def _final(dl: Attached, every: float = 0.02) -> None:
    """Return once the copy's files are under their final names and its marker is written (every chunk verified is
    not yet every file renamed); WriterGone if the writer stopped before."""
    while complete_copy(dl.path, dl.model_id) is None:
        if not writer_active(dl.path) and complete_copy(dl.path, dl.model_id) is None:
            raise WriterGone(f"the process writing {dl.path} stopped before its files were final")
        time.sleep(every)


def link_tree(manifest, src: str, dst: str) -> dict:
    """The copy's files from ``src`` into ``dst`` under their names: hard links, else copies.  Counts of each."""
    done = {"linked": 0, "copied": 0}
    for f, a, b in zip(manifest.files, copy_paths(manifest, src), copy_paths(manifest, dst)):
        os.makedirs(os.path.dirname(b), exist_ok=True)
        tmp = f"{b}.p2pw-link"
        if os.path.lexists(tmp):
            os.remove(tmp)
        try:
            os.link(a, tmp)
            done["linked"] += 1
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK):
                raise P2PError(f"cannot link {a} to {b}: {e.strerror or e}") from None
            shutil.copyfile(a, tmp)
            done["copied"] += 1
        os.replace(tmp, b)
    if done["copied"]:
        log.warning("copied %d of %d files into %s (another filesystem, or links refused there)",
                    done["copied"], len(manifest.files), dst)
    return done
