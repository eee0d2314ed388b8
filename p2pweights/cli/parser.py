"""Parser: the command line, each command's parser added only when named (a join's start-up is on the clock)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys


class HelpLayout(argparse.HelpFormatter):
    """argparse's help layout at the terminal's width, found as ``shutil.get_terminal_size`` finds it but
    without importing shutil, which argparse does for it (with bz2 and lzma: 2 ms of every join's start-up,
    paid by every host of a broadcast at the same moment)."""

    def __init__(self, prog: str, **kw):
        kw.setdefault("width", _columns() - 2)
        super().__init__(prog, **kw)


def _columns() -> int:
    """$COLUMNS, else the width of the terminal on stdout, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
        if columns > 0:
            return columns
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return 80


class CommandLine(argparse.ArgumentParser):
    """An ArgumentParser (its subcommands' too) that lays its help out with ``HelpLayout``."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpLayout)
        super().__init__(*args, **kw)


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; given ``argv``, with only the subcommand it names (each join builds
    its own parser, eight at once on two cores: the others' would cost it about 8 ms of start-up)."""
    ap = CommandLine(prog="p2pw", description="Broadcast model weights to many hosts over a peer tree.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log every peer event")
    ap.add_argument("--log-format", choices=("text", "json"), default="text",
                    help="json: one JSON object per log line (ts, level, event, model_id, rank, ...)")
    sub = ap.add_subparsers(dest="command", required=True)
    named = _command_in(argv) if argv is not None else None
    for name, (module, add) in COMMANDS.items():
        if named is None or name == named:
            getattr(importlib.import_module(f".{module}", __package__), add)(sub)
    return ap


def _command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names, if it is one (else None: the parser lists every one)."""
    args = iter(argv)
    for a in args:
        if a == "--log-format":
            next(args, None)
        elif not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


# each command's parser, by the module that holds it and its function (imported only when its command is named)
COMMANDS = {"seed": ("seed", "seed_parser"), "join": ("join", "join_parser"), "tracker": ("tracker", "tracker_parser"),
            "get": ("join", "get_parser"), "agent": ("agent", "agent_parser"),
            "status": ("inspection", "status_parser"), "cache": ("inspection", "cache_parser"),
            "pack": ("seed", "pack_parser"), "keygen": ("seed", "keygen_parser"), "manifest": ("seed", "manifest_parser"),
            "verify": ("inspection", "verify_parser"), "demo": ("demo", "demo_parser"),
            "simulate": ("demo", "simulate_parser")}  # in --help's order
