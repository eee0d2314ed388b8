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
from ..sources.manifest import check_model_id
from ..wire import local
from .cache import copy_paths
from .localcopy import Attached, WriterGone, attach, complete_copy, writer_active

log = logging.getLogger("p2pw")

AGENT_WAIT = 30.0  # seconds a client waits, by default, for an agent that is away (restarting) to come back
STALL = 300.0  # seconds a client waits on the agent's copy, by default, with no chunk verified, before giving up


def through_agent(agent: str, model: str, model_id: str | None = None, device: str | None = None,
                  timeout: float | None = None, wait: float = AGENT_WAIT) -> Attached:
    """Ask the agent at ``agent`` for ``model`` (a URL or a model id) and attach to its copy.  While the agent is
    away, or its copy's writer stopped short (an agent restarting resumes it), asked again with backoff for up to
    ``wait`` seconds; ``timeout``: seconds for each answer (``local.ask``)."""
    if model_id is not None:
        model_id = check_model_id(model_id)
    deadline, tries = time.monotonic() + wait, 0
    while True:
        answer = local.ask_until(agent, {"op": "get", "model": model}, max(deadline - time.monotonic(), 0.0),
                                 timeout)
        if not isinstance(answer.get("path"), str) or not isinstance(answer.get("model_id"), str):
            raise local.AgentError(f"the p2pw agent at {agent} answered without a path and a model id")
        if model_id is not None and not answer["model_id"].startswith(model_id.lower()):
            raise P2PError(f"the p2pw agent at {agent} holds model {answer['model_id'][:16]} for {model}, "
                           f"not {model_id[:16]}")
        try:
            return attach(answer["path"], answer["model_id"], device)
        except (WriterGone, P2PError) as e:
            pause = local.backoff(tries)
            if time.monotonic() + pause > deadline:
                raise
            if not tries:
                log.warning("the agent's copy of %s in %s is not there yet (%s): asking again for up to %.0f s",
                            model, answer["path"], e, wait)
            tries += 1
            time.sleep(pause)


def wait_through_agent(agent: str, model: str, model_id: str | None = None, timeout: float | None = None,
                       wait: float = AGENT_WAIT, stall: float = STALL) -> Attached:
    """``through_agent``, then wait for every chunk: asked again (``wait`` seconds for the agent to come back)
    each time the agent's writer stops short; P2PError once ``stall`` seconds pass with no chunk verified."""
    while True:
        dl = through_agent(agent, model, model_id, timeout=timeout, wait=wait)
        try:
            _verified(dl, stall)
            _final(dl)
            return dl
        except WriterGone:
            dl.close()
            log.warning("the agent stopped writing %s: asking again", model)
        except BaseException:
            dl.close()
            raise


def _verified(dl: Attached, stall: float, every: float = 1.0) -> None:
    """``dl.wait()``, given up (one line) once ``stall`` seconds pass with no chunk verified."""
    seen, since = -1, time.monotonic()
    while True:
        try:
            dl.wait(every)
            return
        except TimeoutError:
            if dl.store.count != seen:
                seen, since = dl.store.count, time.monotonic()
            elif time.monotonic() - since > stall:
                raise P2PError(f"no chunk of {dl.path} verified in {stall:g} s ({seen} of "
                               f"{dl.manifest.n_chunks}): the agent writing it is stuck") from None


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
