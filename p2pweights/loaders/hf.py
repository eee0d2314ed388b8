"""HF: a ready transformers model straight from a broadcast, its weights views of the received buffer.

``from_pretrained(parent)`` joins, waits only for ``config.json`` (read from the
store's buffer, where the manifest's file table puts it), builds the
architecture on the meta device the way ``transformers`` does, and binds every
parameter and buffer the checkpoint holds to its tensor in the download's
device buffer (no copy on CPU, where that buffer is the store's; the device
buffer on CUDA).  Non-persistent buffers (rotary ``inv_freq``, BERT
``position_ids``) are not in checkpoints: they are computed by the model's own
``_init_weights`` on a shadow of their module, so nothing received is ever
written.  Tied weights share one parameter.  Anything left without a value is
one error naming it.

With ``stream=True`` the model is returned as soon as it is built: every
tensor is already bound to its place in the buffer, and each module that owns
tensors gets a one-shot forward pre-hook that waits for them
(``Download.wait_tensor``), so a forward pass starts on layer 0 while later
layers are still arriving.

Imports transformers (and torch): only a caller of this module pays for them.
"""
from __future__ import annotations

import copy
import json
import re

import torch
from torch import nn

from ..api import Download, P2PError, join

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# Keys transformers itself drops from old checkpoints (see PreTrainedModel._adjust_missing_and_unexpected_keys).
LEGACY_UNEXPECTED = (r"rotary_emb\.inv_freq$", r"(^|\.)position_ids$")


def from_pretrained(parent: str, auto_class=None, *, model_id: str | None = None, device: str = "cpu",
                    dtype=None, key=None, stream: bool = False, timeout: float | None = None,
                    **join_kwargs):
    """Join the broadcast at ``parent`` and return ``(model, download)``: a transformers model in eval mode.

    ``auto_class``: ``transformers.AutoModelForCausalLM`` (or any auto or model class, or its name);
    default: the class the config's ``architectures`` names.  ``dtype``: cast floating tensors to it
    (a copy; default: keep the checkpoint's dtypes, views only).  ``stream``: return before the
    weights arrive; each module waits for its own tensors when it first runs.  ``timeout`` bounds
    each wait (config, a tensor).  Other keywords go to ``p2pweights.join`` (``out``, ``port``, ...).
    The weights are the node's store, served to other peers: treat them as read-only (they are
    ``requires_grad=False``); clone before training.
    """
    dl = join(parent, model_id=model_id, device=device, key=key, **join_kwargs)
    try:
        model = build(dl, auto_class, dtype=dtype, stream=stream, timeout=timeout)
    except BaseException:
        dl.close()
        raise
    return model, dl


def read_file(dl: Download, name: str, timeout: float | None = None) -> bytes:
    """The bytes of checkpoint file ``name``, from the blob, once its chunks are verified."""
    entry = next((f for f in dl.manifest.files if f["name"] == name), None)
    if entry is None:
        raise P2PError(f"model {dl.model_id[:16]} has no {name} (files: "
                       f"{', '.join(f['name'] for f in dl.manifest.files[:8])})")
    lo = entry["offset"]
    dl.wait_range(lo, lo + entry["size"], timeout)
    return bytes(dl.store.view[lo:lo + entry["size"]])


def build(dl: Download, auto_class=None, *, dtype=None, stream: bool = False, timeout: float | None = None):
    """The model of download ``dl`` (joined with a device), its tensors bound to the download's buffer."""
    import transformers

    if dl.loader is None:
        raise P2PError("a model needs a device: join(..., device='cpu' or 'cuda:N')")
    config = _config(dl, timeout)
    cls = _model_class(transformers, config, auto_class)
    dtype = _dtype(dtype)
    model = _skeleton(transformers, cls, config, dtype or _checkpoint_dtype(dl))
    plan = _plan(transformers, model, dl)
    if stream:
        _bind_streaming(model, dl, plan, dtype, timeout)
    else:
        _bind_all(model, dl, plan, dtype, timeout)
    _rebuild_non_persistent(transformers, model, dl.loader.device)
    _check_materialised(model)
    _generation_config(transformers, model, dl, timeout)
    return model.eval()


def _config(dl: Download, timeout):
    from transformers import CONFIG_MAPPING

    raw = read_file(dl, CONFIG, timeout)
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise P2PError(f"{CONFIG} of model {dl.model_id[:16]} is not valid JSON: {e}") from None
    kind = doc.get("model_type") if isinstance(doc, dict) else None
    if kind not in CONFIG_MAPPING:
        raise P2PError(f"{CONFIG} names model_type {kind!r}, which this transformers does not know"
                       + (" (custom code is not loaded)" if isinstance(doc, dict) and "auto_map" in doc else ""))
    return CONFIG_MAPPING[kind].from_dict(doc)


def _model_class(transformers, config, auto_class):
    if auto_class is None:
        names = getattr(config, "architectures", None) or []
        if not names:
            raise P2PError(f"{CONFIG} names no architectures: pass auto_class (e.g. transformers.AutoModel)")
        auto_class = names[0]
    if isinstance(auto_class, str):
        found = getattr(transformers, auto_class, None)
        if found is None:
            raise P2PError(f"transformers {transformers.__version__} has no class {auto_class!r}")
        auto_class = found
    if issubclass(auto_class, transformers.PreTrainedModel):
        return auto_class
    try:  # an auto class: the model class it maps this config to
        return auto_class._model_mapping[type(config)]
    except (AttributeError, KeyError):
        raise P2PError(f"{getattr(auto_class, '__name__', auto_class)} has no model for "
                       f"{type(config).__name__}") from None


def _dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise P2PError(f"dtype {dtype!r} is not a torch dtype")
    return found


def _checkpoint_dtype(dl: Download) -> torch.dtype:
    """The dtype most of the checkpoint's floating bytes have (what transformers' dtype='auto' picks)."""
    from ..storage.device import torch_dtype

    sizes: dict = {}
    for t in dl.manifest.tensors:
        d = torch_dtype(t["dtype"])
        if d.is_floating_point:
            sizes[d] = sizes.get(d, 0) + t["nbytes"]
    return max(sizes, key=sizes.get) if sizes else torch.float32


def _skeleton(transformers, cls, config, dtype):
    """``cls(config)`` on the meta device, built the way transformers' own from_pretrained builds it."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    try:
        contexts = cls.get_init_context(dtype, False, False, None)
    except (AttributeError, TypeError):  # another transformers: meta device and dtype are what matters
        from transformers.modeling_utils import local_torch_dtype

        contexts = [local_torch_dtype(dtype, cls.__name__), torch.device("meta")]
    from transformers.utils.generic import ContextManagers

    with ContextManagers(contexts):
        return cls(config)


def _plan(transformers, model, dl: Download) -> dict[str, str]:
    """Model state-dict key -> checkpoint tensor name, tied keys included; P2PError for a mismatch."""
    expected = model.state_dict()  # meta tensors: persistent parameters and buffers, untied
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # target key -> source key
    rename = _renamer(transformers, model, expected)
    ignore = re.compile("|".join([*LEGACY_UNEXPECTED, *(getattr(model, "_keys_to_ignore_on_load_unexpected",
                                                                None) or ())]))
    prefix = getattr(model, "base_model_prefix", "") or ""
    # a checkpoint of a model with a head (names under 'prefix.') loaded into its base model: the head's
    # tensors (lm_head, cls...) are left out, as transformers does
    head_left_out = bool(prefix) and not hasattr(model, prefix) and any(
        t["name"].startswith(prefix + ".") for t in dl.manifest.tensors)
    plan, unexpected = {}, []
    for t in dl.manifest.tensors:
        key = rename(t["name"])
        if key in expected:
            plan[key] = t["name"]
        elif ignore.search(t["name"]):
            continue
        elif head_left_out and not t["name"].startswith(prefix + "."):
            continue
        else:
            unexpected.append(t["name"])
    for target, source in tied.items():  # either side may be the one the checkpoint holds
        if target not in plan and source in plan:
            plan[target] = plan[source]
        elif source not in plan and target in plan:
            plan[source] = plan[target]
    missing = [k for k in expected if k not in plan]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing from the checkpoint ({_names(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} in the checkpoint but not in {type(model).__name__} "
                         f"({_names(unexpected)})")
        raise P2PError(f"model {dl.model_id[:16]} does not match {type(model).__name__}: tensors "
                       + "; ".join(parts))
    _check_shapes(model, expected, plan, dl)
    return plan


def _check_shapes(model, expected, plan, dl):
    shapes = {t["name"]: list(t["shape"]) for t in dl.manifest.tensors}
    wrong = [f"{key}: checkpoint {shapes[name]}, model {list(expected[key].shape)}"
             for key, name in plan.items() if shapes[name] != list(expected[key].shape)]
    if wrong:
        raise P2PError(f"model {dl.model_id[:16]} does not match {type(model).__name__}: "
                       f"{len(wrong)} tensors differ in shape ({'; '.join(wrong[:3])}"
                       f"{'; ...' if len(wrong) > 3 else ''})")


def _renamer(transformers, model, expected):
    """Checkpoint name -> model key: transformers' legacy renamings, then the base-model prefix."""
    renamings = []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [r for r in get_model_conversion_mapping(model) if isinstance(r, WeightRenaming)]
    except ImportError:
        pass
    prefix = getattr(model, "base_model_prefix", "") or ""

    def rename(name: str) -> str:
        for r in renamings:
            name, _ = r.rename_source_key(name)
        if name in expected or not prefix:
            return name
        if name.startswith(prefix + ".") and name[len(prefix) + 1:] in expected:
            return name[len(prefix) + 1:]  # a head checkpoint into its base model
        if f"{prefix}.{name}" in expected:
            return f"{prefix}.{name}"  # a base checkpoint into a model with a head
        return name
    return rename


def _names(keys, n: int = 4) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f", ... {len(keys) - n} more" if len(keys) > n else "")


def _owner(model, key: str):
    module_name, _, leaf = key.rpartition(".")
    return model.get_submodule(module_name), leaf


def _bind(model, plan: dict[str, str], values: dict[str, torch.Tensor]) -> None:
    """Set every key of ``plan`` whose tensor is in ``values``; keys sharing a tensor share one Parameter."""
    shared: dict[str, nn.Parameter] = {}
    for key, name in plan.items():
        if name not in values:
            continue
        module, leaf = _owner(model, key)
        if leaf in module._parameters:
            p = shared.get(name)
            if p is None:
                p = shared[name] = nn.Parameter(values[name], requires_grad=False)
                p._is_hf_initialized = True
            module._parameters[leaf] = p
        else:
            module._buffers[leaf] = values[name]


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _bind_all(model, dl: Download, plan, dtype, timeout) -> None:
    """Wait for every tensor (in the order they complete) and bind the model to them."""
    wanted = set(plan.values())
    values = {}
    for name, t in dl.iter_tensors(timeout):
        if name in wanted:
            values[name] = _cast(t, dtype)
    _bind(model, plan, values)


def _bind_streaming(model, dl: Download, plan, dtype, timeout) -> None:
    """Bind every tensor to its place now; each owning module waits for its own tensors before it runs."""
    values = {}
    for name in set(plan.values()):
        place = dl.tensor_place(name)
        values[name] = place if dtype is None or not place.is_floating_point() or place.dtype == dtype else \
            torch.empty(place.shape, dtype=dtype, device=place.device)  # filled from the place on arrival
    _bind(model, plan, values)
    by_module: dict[str, list[tuple[str, str]]] = {}
    for key, name in plan.items():
        module_name, _, leaf = key.rpartition(".")
        by_module.setdefault(module_name, []).append((leaf, name))
    for module_name, tensors in by_module.items():
        module = model.get_submodule(module_name)
        handle = module.register_forward_pre_hook(_arrival_hook(dl, module, tensors, timeout))
        module._p2pw_wait = handle


def _arrival_hook(dl: Download, module, tensors: list[tuple[str, str]], timeout):
    """A pre-hook that waits once for ``tensors`` (leaf, checkpoint name) of ``module``, then removes itself."""
    def pre(mod, args):
        with torch.no_grad():
            for leaf, name in tensors:
                arrived = dl.wait_tensor(name, timeout)
                current = mod._parameters.get(leaf, mod._buffers.get(leaf))
                if current is not None and current.data_ptr() != arrived.data_ptr():
                    current.copy_(arrived)  # a dtype cast: the bound tensor is a separate copy
        mod._p2pw_wait.remove()
        del mod._p2pw_wait
    return pre


@torch.no_grad()
def _rebuild_non_persistent(transformers, model, device) -> None:
    """Compute each non-persistent buffer on ``device`` with the model's own ``_init_weights``.

    It runs on a shadow of the buffer's module whose other tensors are meta placeholders, so no
    received tensor can be written; a buffer that ``_init_weights`` leaves unset is an error.
    """
    owners: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        for leaf in module._non_persistent_buffers_set:
            if module._buffers.get(leaf) is not None and module._buffers[leaf].is_meta:
                owners.setdefault(name, []).append(leaf)
    unset = []
    for name, leaves in owners.items():
        module = model.get_submodule(name)
        shadow = _shadow(module, device, set(leaves))
        init_owner = _init_owner(transformers, model, name)
        init_owner._init_weights(shadow)
        for leaf in leaves:
            value = shadow._buffers[leaf]
            if _untouched(value):
                unset.append(f"{name}.{leaf}" if name else leaf)
            module._buffers[leaf] = value
    if unset:
        raise P2PError(f"{type(model).__name__}._init_weights does not compute the non-persistent buffers "
                       f"{_names(unset)}: they cannot be rebuilt without the model's __init__")


SENTINEL_FLOAT = float("nan")


def _sentinel(like: torch.Tensor, device) -> torch.Tensor:
    if like.dtype.is_floating_point or like.dtype.is_complex:
        return torch.full(like.shape, SENTINEL_FLOAT, dtype=like.dtype, device=device)
    if like.dtype == torch.bool:
        return torch.zeros(like.shape, dtype=like.dtype, device=device)
    return torch.full(like.shape, torch.iinfo(like.dtype).max, dtype=like.dtype, device=device)


def _untouched(t: torch.Tensor) -> bool:
    """True if ``t`` still holds its sentinel everywhere (bool buffers cannot tell: never)."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).max).all())


def _shadow(module, device, real: set[str]):
    """A copy of ``module`` (same class and attributes) whose tensors are meta, except buffers ``real``."""
    s = copy.copy(module)
    s._parameters = {k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                     for k, p in module._parameters.items()}
    s._buffers = {k: None if b is None else _sentinel(b, device) if k in real else torch.empty_like(b, device="meta")
                  for k, b in module._buffers.items()}
    s._modules = {k: None if c is None else _shadow(c, device, set()) for k, c in module._modules.items()}
    return s


def _init_owner(transformers, model, module_name: str):
    """The innermost PreTrainedModel holding module ``module_name``: its ``_init_weights`` applies."""
    parts = module_name.split(".") if module_name else []
    for n in range(len(parts), -1, -1):
        candidate = model.get_submodule(".".join(parts[:n]))
        if isinstance(candidate, transformers.PreTrainedModel):
            return candidate
    return model


def _check_materialised(model) -> None:
    left = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    left += [n for n, b in model.named_buffers(remove_duplicate=False) if b is not None and b.is_meta]
    if left:
        raise P2PError(f"{type(model).__name__}: {len(left)} tensors have no value after loading "
                       f"(still on the meta device): {_names(left)}")


def _generation_config(transformers, model, dl: Download, timeout) -> None:
    if not model.can_generate() or not any(f["name"] == GENERATION_CONFIG for f in dl.manifest.files):
        return
    try:
        doc = json.loads(read_file(dl, GENERATION_CONFIG, timeout))
        model.generation_config = transformers.GenerationConfig.from_dict(doc)
    except ValueError as e:
        raise P2PError(f"{GENERATION_CONFIG} of model {dl.model_id[:16]} is unusable: {e}") from None
