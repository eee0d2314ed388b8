"""CLI: ``p2pw pack | keygen | seed | join | tracker | get | agent | cache | status | manifest | verify | demo |
simulate``.

Thin: every command is a call into the library plus printing, one module per family of commands (``seed``,
``join``, ``tracker``, ``agent``, ``inspection``, ``demo``); ``parser`` builds the command line from them,
``flags`` and ``console`` hold what they share.  Errors a user can cause end as one ``p2pw: error: ...`` line
and exit status 1, never a traceback.
"""
from __future__ import annotations

import logging
import os
import sys

from . import console
from .console import error, human  # noqa: F401 (human: part of the CLI's surface, for the benchmarks)
from .flags import size  # noqa: F401 (the one size syntax of every flag, for the benchmarks)
from .parser import parser


def main(argv: list[str] | None = None) -> int:
    from ..errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    # no command does linear algebra; numpy's OpenBLAS pool would otherwise start a thread per core that
    # spins at startup (measured: about 5 % of a join's CPU)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ap = parser(argv)
    args, rest = ap.parse_known_args(argv)
    if args.command != "simulate" and rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    from ..ops.logs import LogContext, configure_logging

    context = console.context = LogContext()
    console.LOG["format"] = args.log_format
    configure_logging(args.log_format,
                      logging.INFO if args.verbose or args.command in ("seed", "tracker") else logging.WARNING,
                      context)
    try:
        return args.func(args, rest) if args.command == "simulate" else args.func(args)
    except (UserError, OSError) as e:  # OSError: a path, a port, a disk the user named
        msg = str(e) if not isinstance(e, OSError) or not e.strerror else f"{e.strerror}: {e.filename or ''}"
        error(msg)
        return 1
    except KeyboardInterrupt:
        print("p2pw: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The console entry point: ``main``, then exit without tearing the interpreter down.

    Every command has closed what it opened (files fsynced and renamed, reports written, links
    closed) when ``main`` returns; the teardown after it only frees memory, and measured 0.1 CPU s
    a join, paid by every host of a broadcast at the same moment."""
    rc = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(0 if rc is None else rc if isinstance(rc, int) else 1)


if __name__ == "__main__":
    run()
