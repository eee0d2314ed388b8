"""``p2pw demo`` and ``p2pw simulate``: a local broadcast, and a fleet's predicted one."""
from __future__ import annotations

from .flags import CHUNK_SIZE_HELP, size


def cmd_demo(args) -> int:
    from ..demo import run_demo
    from ..errors import P2PError

    try:
        return run_demo(peers=args.peers, size_mb=args.size_mb, workdir=args.workdir, chunk_size=args.chunk_size)
    except (ValueError, RuntimeError) as e:  # a model size the demo cannot build, a peer that failed
        raise P2PError(f"demo: {e}") from None


def cmd_simulate(args, rest) -> int:
    from ..swarm.simulate import main as simulate_main

    return simulate_main(rest) or 0


def demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="local broadcast of a generated model to N peer processes")
    d.add_argument("--peers", type=int, default=4)
    d.add_argument("--size-mb", type=float, default=256)
    d.add_argument("--chunk-size", type=size, default=None,
                   help=CHUNK_SIZE_HELP)
    d.add_argument("--workdir", help="keep the model and copies here (default: a temporary directory)")
    d.set_defaults(func=cmd_demo)


def simulate_parser(sub) -> None:
    sim = sub.add_parser("simulate", help="predict broadcast time for a fleet (see p2pw simulate --help)",
                         add_help=False)
    sim.set_defaults(func=cmd_simulate)
