#!/usr/bin/env python3
"""Write docs/cli.md from the ``p2pw`` command line's own argparse parser.

    python docs/gen_cli.py            # rewrite docs/cli.md
    python docs/gen_cli.py --check    # exit 1 if docs/cli.md is not what the parser says

Only ``p2pweights.cli`` is imported (its ``parser()`` and ``cmd_simulate``); the page is built
from the parsers' actions, not from ``format_help``, so it reads the same on every Python version
and terminal width.  ``tests/test_docs.py`` checks that the committed page is current.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "cli.md"

HEAD = """# `p2pw` command reference

Generated from the parser by `python docs/gen_cli.py`; do not edit by hand (`tests/test_docs.py` checks
that it is current). What the commands are for, and how to deploy them: [operators.md](operators.md).

Every error a user can cause (a missing or unreadable path, a truncated safetensors file, a wrong model
id, nobody listening at the parent, too little disk space) ends as one `p2pw: error: ...` line and exit
status 1.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        try:
            text = text % {**vars(action), "prog": "p2pw"}
        except (KeyError, TypeError, ValueError):
            pass
    return _cell(text)


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest.upper()
        return f"`{name}`" + (" (optional)" if action.nargs == "?" else "")
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    if action.choices:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        value = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    return f"`{names} {value}`"


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d is argparse.SUPPRESS or d in ([], "", False):
        return ""
    return f"`{d}`"


def _options(p: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        note = " (required)" if a.required and a.option_strings else ""
        rows.append(f"| {_flag(a)}{note} | {_default(a)} | {_help(a)} |")
    if not rows:
        return []
    return ["| argument | default | meaning |", "| --- | --- | --- |", *rows]


def _subcommands(ap: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    return [(name, helps.get(name, ""), p) for name, p in sub.choices.items()]


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _simulate_parser() -> argparse.ArgumentParser | None:
    """``p2pw simulate`` parses its own arguments: catch the parser it builds as it starts parsing."""
    def capture(self, *args, **kw):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        from p2pweights.cli.demo import cmd_simulate

        cmd_simulate(argparse.Namespace(), ["--help"])
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    return None


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from p2pweights import cli

    ap = cli.parser()
    lines = [HEAD, "## Global options", "", "Given before the command: `p2pw [-v] [--log-format text|json] COMMAND ...`.",
             "", *_options(ap), "", "## Commands", ""]
    commands = _subcommands(ap)
    lines += [f"- [`p2pw {name}`](#p2pw-{name}): {_cell(h)}" for name, h, _ in commands]
    for name, h, p in commands:
        h = _cell(h)
        lines += ["", f"## p2pw {name}", "", h[:1].upper() + h[1:] + ".", ""]
        if name == "simulate":
            sim = _simulate_parser()
            if sim is not None:
                if sim.description:
                    lines += [_cell(sim.description), ""]
                p = sim
        lines += _options(p)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in args:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
