"""The vLLM load format's options: ``--model-loader-extra-config`` JSON, else the ``P2PW_*`` environment, each
checked for its type and range before anything opens (no vLLM needed).

Each option is one rule: a name, the variable that may give it, what it takes, and a parser from the given
value (a JSON value, or the variable's text) to the typed one; a value the parser refuses is one
``LoaderOptionError`` naming the option, the value and what it takes.
"""
from __future__ import annotations

import json
import math
import os

from .. import api
from ..errors import LoaderOptionError
from ..sources.manifest import MIN_MODEL_ID, ManifestError, check_model_id

DEFAULT_TIMEOUT = 600.0
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _text(value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError
    return value


def _parent(value) -> str:
    try:
        api.parse_addr(_text(value))
    except api.P2PError:
        raise ValueError from None
    return value


def _model_id(value) -> str:
    try:
        return check_model_id(_text(value))
    except ManifestError:
        raise ValueError from None


def _flag(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ValueError


def _seconds(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    seconds = float(value)  # ValueError for text that is no number
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError
    return seconds


# name -> (variable, what it takes, parser)
OPTIONS = {
    "parent": ("P2PW_PARENT", "HOST:PORT of the seeder or any peer", _parent),
    "model_id": ("P2PW_MODEL_ID", f"a model id (64 hex digits, or at least its first {MIN_MODEL_ID})", _model_id),
    "out": ("P2PW_OUT", "a folder path", _text),
    "key": ("P2PW_KEY", "the fleet key's folder path", _text),
    "linger": ("P2PW_LINGER", "true or false (1/0, yes/no, on/off)", _flag),
    "timeout": ("P2PW_TIMEOUT", "seconds, a finite number above 0", _seconds),
    "agent": ("P2PW_AGENT", "the node agent's cache folder path", _text),
    "model": ("P2PW_MODEL", "the model's URL or id", _text),
}
DEFAULTS = {"linger": False, "timeout": DEFAULT_TIMEOUT}


def _extra(extra) -> dict:
    if isinstance(extra, str):
        try:
            extra = json.loads(extra) if extra.strip() else {}
        except ValueError as e:
            raise LoaderOptionError(f"--model-loader-extra-config is not JSON: {e}") from None
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise LoaderOptionError(f"--model-loader-extra-config must be a JSON object of p2pweights options, not "
                                f"{str(extra)[:80]!r}")
    unknown = sorted(str(k) for k in set(extra) - set(OPTIONS))
    if unknown:
        raise LoaderOptionError(f"unknown p2pweights option {unknown[0]!r} in --model-loader-extra-config: "
                                f"expected {', '.join(OPTIONS)}")
    return extra


def options(extra: dict | str | None, model_dir: str, env=os.environ) -> dict:
    """The loader's options: ``extra`` (dict or JSON) first, then ``P2PW_*``; ``out`` defaults to ``model_dir``.
    LoaderOptionError for an option of the wrong type or out of range."""
    extra = _extra(extra)
    opts = {}
    for name, (variable, takes, parse) in OPTIONS.items():
        given, where = extra.get(name), "in --model-loader-extra-config"
        if given is None or given == "":
            given, where = env.get(variable) or None, f"({variable})"
        if given is None:
            opts[name] = DEFAULTS.get(name)
            continue
        try:
            opts[name] = parse(given)
        except (ValueError, TypeError, OverflowError):
            raise LoaderOptionError(f"p2pweights option {name}={repr(given)[:80]} {where}: takes {takes}") from None
    opts["out"] = os.path.abspath(opts["out"] or model_dir)
    return opts
