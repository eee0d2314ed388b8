#!/usr/bin/env python3
"""Per-host completion curves of a broadcast, p2pw beside libtorrent, from ``bench/broadcast.py --json``.

    sudo .venv/bin/python bench/broadcast.py --cases equal,slow2 --json /tmp/broadcast.json
    python docs/plot_broadcast.py /tmp/broadcast.json [--case equal] [--peers 8] [-o docs/broadcast.png]

Each curve is one run: the share of receivers that have exited 0 with a verified copy, against
seconds since launch (each host's ``exits`` entry); the dashed line is the floor, S / B.  Needs
matplotlib (``pip install -e '.[bench]'``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLORS = {"libtorrent": "tab:orange"}


def curves(doc: dict, case: str, n: int | None) -> dict[str, list[list[float]]]:
    """{variant: [sorted exit seconds of one run, ...]} for the runs of ``case`` (and N = ``n``)."""
    out: dict[str, list[list[float]]] = {}
    for run in doc.get("runs", []):
        if run.get("case") != case or "error" in run or (n is not None and run.get("n") != n):
            continue
        out.setdefault(run["variant"], []).append(sorted(float(s) for s in run["exits"].values()))
    return out


def floor_of(doc: dict, case: str, n: int | None) -> float | None:
    for s in doc.get("summaries", []):
        if s.get("case") == case and (n is None or s.get("n") == n) and s.get("floor"):
            return float(s["floor"])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a file written by bench/broadcast.py --json")
    ap.add_argument("--case", default="equal", help="equal, slow1, slow2 or kill (equal)")
    ap.add_argument("--peers", type=int, help="N, where the file holds several")
    ap.add_argument("-o", "--output", default=str(Path(__file__).with_name("broadcast.png")))
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_broadcast: needs matplotlib (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    doc = json.loads(Path(args.json).read_text())
    found = curves(doc, args.case, args.peers)
    if not found:
        print(f"plot_broadcast: no run of case {args.case!r} in {args.json}", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, runs in sorted(found.items()):
        color = COLORS.get(variant, "tab:blue")
        label = variant if variant == "libtorrent" else f"p2pw ({variant})"
        for i, exits in enumerate(runs):
            share = [(k + 1) / len(exits) for k in range(len(exits))]
            ax.step([0.0, *exits], [0.0, *share], where="post", color=color, alpha=0.85,
                    label=label if i == 0 else None)
    floor = floor_of(doc, args.case, args.peers)
    if floor:
        ax.axvline(floor, color="gray", linestyle="--", linewidth=1, label="floor (S / B)")
    n = args.peers or next(iter(r.get("n") for r in doc["runs"] if r.get("case") == args.case), "?")
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("receivers done (verified copy, exit 0)")
    ax.set_title(f"Broadcast to N = {n} hosts, case {args.case}")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"plot_broadcast: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
