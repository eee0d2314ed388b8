"""Command line for the emulated-host testbed.

    python bench/netbed/netbed.py check --hosts 3 --rate 400 [--seconds 2]

creates a testbed, measures h0's capped uplink with one TCP flow and with two
at once (check_cap), prints expected against measured, and the CPU use during
each run so a reader can tell whether the cap or the CPU was the limit; then
tears everything down.

    python bench/netbed/netbed.py available

says whether namespaces can be created here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from testbed import Testbed, check_cap  # noqa: E402


def _cpu(busy: list[float]) -> str:
    return f"avg {100 * sum(busy) / len(busy):3.0f}%  max {100 * max(busy):3.0f}%"


def cmd_check(args) -> int:
    ok, why = Testbed.available()
    if not ok:
        print(f"netbed: cannot create namespaces here: {why}", file=sys.stderr)
        return 2
    with Testbed(args.hosts, rate_mbit=args.rate) as tb:
        print(f"testbed {tb.run_id}: {args.hosts} hosts, uplink cap {args.rate:g} Mbit/s "
              f"(htb), congctl {tb.congctl}")
        res = check_cap(tb, seconds=args.seconds)
    exp = res["expected_mbit"]
    print(f"expected TCP goodput = rate x 1448/1514 = {exp:.1f} Mbit/s")
    print()
    head = (f"{'run':<22}{'expected':>10}{'measured':>10}{'ratio':>7}"
            f"{'/rate':>7}  {'per flow':<16}{'h0 tx MB':>9}  cpu (all {len(res['single']['cpu_busy'])})")
    print(head)
    print("-" * len(head))
    rows = [("1 flow  h0->h1", res["single"])]
    if res["dual"]:
        rows.append(("2 flows h0->h1,h2", res["dual"]))
    for name, r in rows:
        per = "+".join(f"{m:.0f}" for m in r["per_flow_mbit"])
        print(f"{name:<22}{exp:>10.1f}{r['mbit']:>10.1f}{r['mbit'] / exp:>7.3f}"
              f"{r['mbit'] / args.rate:>7.3f}  {per:<16}{r['tx_bytes'] / 1e6:>9.1f}  "
              f"{_cpu(r['cpu_busy'])}")
    print()
    print("Mbit/s; ratio = measured/expected; cpu = /proc/stat busy share over the run "
          "(a CPU near 100% means the CPU, not the cap, may be the limit)")
    return 0


def cmd_available(args) -> int:
    ok, why = Testbed.available()
    print("yes" if ok else f"no: {why}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="netbed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="measure the uplink cap on a fresh testbed")
    c.add_argument("--hosts", type=int, default=3)
    c.add_argument("--rate", type=float, default=400, help="uplink cap, Mbit/s")
    c.add_argument("--seconds", type=float, default=2.0, help="length of each run")
    c.set_defaults(fn=cmd_check)
    a = sub.add_parser("available", help="can namespaces be created here?")
    a.set_defaults(fn=cmd_available)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
