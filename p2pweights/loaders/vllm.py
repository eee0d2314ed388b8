"""vLLM: ``--load-format p2pweights`` loads the engine's weights straight from the swarm.

Registered through the ``vllm.general_plugins`` entry point (``register``, run in
every vLLM process). ``load_weights`` runs in each worker: it joins the swarm
into the copy's folder, or attaches to the download another local process
(another tensor-parallel rank, a pre-warm peer) is writing there, or reads the
complete copy at once, and feeds ``model.load_weights`` the ``(name, tensor)``
pairs in the order their bytes are verified, so the engine copies each tensor
into its parameters while the rest is still arriving.

vLLM builds the model from the config before it loads weights: ``MODEL`` is a
folder that holds the config and tokenizer files (a pre-warmed copy, a hub
snapshot, or any folder with them); the weights need not be there.

Options (``--model-loader-extra-config`` JSON, else the environment; checked by ``loadoptions``):

- ``parent`` (``P2PW_PARENT``): HOST:PORT of the seeder or any peer; needed unless the copy is complete
- ``model_id`` (``P2PW_MODEL_ID``): refuse any other checkpoint
- ``out`` (``P2PW_OUT``): the copy's folder (default: ``MODEL`` itself)
- ``key`` (``P2PW_KEY``): the fleet key directory, when links are keyed
- ``linger`` (``P2PW_LINGER``, true/false, 1/0): keep serving the model to the swarm after loading
- ``timeout`` (``P2PW_TIMEOUT``, seconds above 0, finite, default 600): the longest wait for any one tensor
- ``agent`` (``P2PW_AGENT``): the node agent's cache directory; the weights come from the agent's copy of
  ``model`` (``P2PW_MODEL``: its URL or id; default ``model_id``), which it fetches once for the host
"""
from __future__ import annotations

import logging
import time

from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from .. import api
from ..errors import LoaderOptionError
from .loadoptions import DEFAULT_TIMEOUT, OPTIONS, options  # noqa: F401  (the load format's options)

log = logging.getLogger("vllm.p2pweights")

LOAD_FORMAT = "p2pweights"
WRITER_RETRIES = 3  # times a worker takes over a copy whose local writer stopped short
_kept: list = []  # downloads lingering to serve the swarm after loading, for the life of the worker


def open_weights(opts: dict):
    """The copy's tensors: attached to this host's copy (complete, or written by another local process), else a
    join of the swarm into ``out`` (``api.join``; it attaches itself if another process claimed meanwhile); with
    ``agent``, the node agent's copy."""
    if opts["agent"]:
        if not (opts["model"] or opts["model_id"]):
            raise LoaderOptionError("with agent (P2PW_AGENT), name the model: model (P2PW_MODEL, its URL or id) or "
                                    "model_id (P2PW_MODEL_ID)")
        return api.join(opts["model"] or opts["model_id"], agent=opts["agent"], model_id=opts["model_id"],
                        device="cpu")
    try:
        return api.attach(opts["out"], opts["model_id"], device="cpu")
    except api.WriterGone:
        pass  # its writer stopped short: resume it ourselves
    except api.P2PError:
        if not opts["parent"]:
            raise LoaderOptionError(f"{opts['out']} holds no complete copy and no parent is given: set \"parent\" "
                                    "in --model-loader-extra-config or P2PW_PARENT") from None
    key = None
    if opts["key"]:
        from ..wire import keys  # what api's join takes for key=

        key = keys.load(opts["key"])
    return api.join(opts["parent"], out=opts["out"], model_id=opts["model_id"], device="cpu", key=key)


def feed(model, source, timeout: float) -> set[str]:
    """``model.load_weights`` over the source's tensors as they are verified; the names it loaded."""
    return model.load_weights(iter(source.iter_tensors(timeout)))


def check_loaded(model, loaded, source) -> None:
    """A parameter no tensor set, or a checkpoint tensor the model did not take: an error naming it."""
    if loaded is None:
        return
    loaded = set(loaded)
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        raise ValueError(f"Following weights were not initialized from checkpoint {source.model_id[:16]}: "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")


@register_model_loader(LOAD_FORMAT)
class P2PWeightsLoader(BaseModelLoader):
    """Weights from a p2pweights swarm, tensor by tensor as they are verified."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.extra = load_config.model_loader_extra_config

    def download_model(self, model_config) -> None:
        pass  # the weights stream in load_weights; the config is already in MODEL

    def load_weights(self, model, model_config) -> None:
        opts = options(self.extra, model_config.model)
        t0 = time.monotonic()
        for tries_left in reversed(range(WRITER_RETRIES)):
            source = open_weights(opts)
            try:
                loaded = feed(model, source, opts["timeout"])
                check_loaded(model, loaded, source)
                report = source.stage_report()
                break
            except api.WriterGone as e:  # the local process writing the copy stopped: take it over
                source.close()
                if not tries_left:
                    raise
                log.warning("p2pweights: %s; resuming the copy here", e)
            except BaseException:
                source.close()
                raise
        how = "attached to this host's copy" if getattr(source, "attached", False) else "joined the swarm"
        log.info("p2pweights: model %s from %s (%s): %d tensors, %.1f MB in %.2f s; fetch %.2f s, verify %.2f s, "
                 "h2d %.2f s, first tensor %s s, last tensor %s s", source.model_id[:16], opts["out"], how,
                 report["tensors"], report["bytes"] / 1e6, time.monotonic() - t0, report["fetch"]["seconds"],
                 report["verify"]["seconds"], report["h2d"]["seconds"], report["first_tensor_usable_s"],
                 report["last_tensor_usable_s"])
        if opts["linger"] and not getattr(source, "attached", False):
            _kept.append(source)  # its node keeps serving chunks to the swarm from the worker
        else:
            source.close()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: importing this module registered the load format (again in
    every vLLM process; registering twice only replaces the class with itself)."""
