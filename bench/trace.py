"""Where a broadcast's time went, from its traced joins (``broadcast.py --trace --json FILE``).

    python bench/trace.py FILE [--case slow2] [--bin 2] [--late 20]

For every traced p2pw run in FILE (each receiver ran ``p2pw join --trace``,
so its report lists each verified chunk as [seconds since join, chunk, from
rank, planned rank]), prints, in bins of ``--bin`` seconds since launch:

- chunks each host received, per stripe (a stripe that runs below the
  others is the one a host waits on), with how many came from each source
  host and whether that was the planned one (P) or help;
- chunks each host sent (every receiver's arrivals by source): a host's
  uplink at full rate sends the same number per bin, so a short bin is
  uplink left idle;
- the last ``--late`` chunks of the host that finished last: when each
  arrived and from whom;
- hop lags: per host and stripe, how long after its source verified a chunk
  the host verified it (median over the first, middle and last thirds of the
  stripe), and how far behind the seeder's first copy the stripe's last
  chunks came: on a forwarder whose uplink has nothing to spare, a lag the
  start left stays to the end, and the deepest path's lags add up to the
  end phase;
- the seeder's log lines (demotions, re-placements), its ranks named as hosts;
- first, the phases (``phases``): the seeder's first and last chunk as its
  receivers verified them, the first and last peer done, the last exit;
  the end phase is the last peer done after the seeder's last chunk.

Host 0 ("S") is the seeder; hosts are the bed's, ranks the tracker's.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter
from pathlib import Path


def arrivals(run: dict) -> dict[str, list[tuple[float, int, str, bool]]]:
    """host -> [(seconds since launch, chunk, source host, planned?)] for each traced receiver."""
    reps = {h: r for h, r in run["reports"].items() if "chunks" in r}
    host_of = {r["rank"]: str(h) for h, r in reps.items()}
    host_of[0] = "S"
    return {h: [(r["started_at"] + t, i, host_of.get(src, f"r{src}"), src == planned)
                for t, i, src, planned in r["chunks"]] for h, r in reps.items()}


def phases(run: dict, got: dict | None = None) -> dict | None:
    """Seconds since launch: the seeder's first and last chunk (verified at its receivers; the last: when
    the last chunk to leave it arrived, its first copy, not a copy it sent again once lent to the last
    peers), the first and last peer done, the last exit; ``end``: the last peer done after the seeder's
    last chunk. None untraced.  ``got``: the run's ``arrivals``, where the caller has them."""
    seeded = list(seeder_copies(arrivals(run) if got is None else got).values())
    done = [r["done_at"] for r in run["reports"].values() if isinstance(r.get("done_at"), (int, float))]
    if not seeded or not done:
        return None
    p = {"seeder_first": min(seeded), "seeder_last": max(seeded), "done_first": min(done), "done_last": max(done),
         "exit": run["time"]}
    return {**p, "end": p["done_last"] - p["seeder_last"]}


def hop_lags(got: dict, stripes: int, tail: int = 20) -> list[tuple[str, int, str, list[float], float | None]]:
    """[(host, stripe, its main source, [median lag behind that source in the stripe's first, middle and
    last third, seconds], median lag behind the seeder's first copy over the stripe's last ``tail``
    chunks)]: when a host verified a chunk less when its source did (the seeder's copies: when their
    first receiver verified them)."""
    at = {h: {i: t for t, i, *_ in a} for h, a in got.items()}
    at["S"] = seeder_copies(got)
    rows = []
    for h in sorted(got, key=int):
        for s in range(stripes):
            mine = sorted((i, t, src) for t, i, src, _ in got[h] if i % stripes == s)
            if not mine:
                continue
            main = Counter(src for _, _, src in mine).most_common(1)[0][0]
            thirds = [mine[k * len(mine) // 3:(k + 1) * len(mine) // 3] for k in range(3)]
            lags = [_median([t - at[src][i] for i, t, src in part if i in at.get(src, {})]) for part in thirds]
            behind = [t - at["S"][i] for i, t, _ in mine[-tail:] if i in at["S"]]
            rows.append((h, s, main, lags, _median(behind)))
    return rows


def seeder_copies(got: dict) -> dict[int, float]:
    """chunk -> when its first copy from the seeder verified at a receiver (``arrivals``)."""
    first: dict[int, float] = {}
    for a in got.values():
        for t, i, src, _ in a:
            if src == "S" and t < first.get(i, float("inf")):
                first[i] = t
    return first


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def row(counts: Counter, bins: int) -> str:
    return " ".join(f"{counts[b]:3d}" for b in range(bins))


def report(run: dict, width: float, late: int) -> str:
    got = arrivals(run)
    if not got:
        return "  (no traced receivers: run broadcast.py with --trace)\n"
    stripes = max(len(r.get("plan", [])) for r in run["reports"].values()) or 1
    bins = int(max(t for a in got.values() for t, *_ in a) // width) + 1
    p = phases(run, got)
    out = [f"  phases: the seeder's chunks {p['seeder_first']:.2f}-{p['seeder_last']:.2f} s, peers done "
           f"{p['done_first']:.2f}-{p['done_last']:.2f} s (end phase {p['end']:.2f} s), last exit {p['exit']:.2f} s"
           ] if p else []
    out.append(f"  bins of {width:g} s since launch: " + " ".join(f"{b * width:3.0f}" for b in range(bins)))
    sent: dict[str, Counter] = {}
    for h in sorted(got, key=int):
        slow = run["rates"][h] != run["rates"]["0"]  # JSON keys: host numbers as strings
        done = run["reports"][h]["done_at"]
        for s in range(stripes):
            counts = Counter(int(t // width) for t, i, *_ in got[h] if i % stripes == s)
            out.append(f"  h{h:<2} s{s} {'slow' if slow else '    '} {row(counts, bins)}" +
                       (f"   done {done:5.1f} s" if s == 0 else ""))
        by_source = Counter((src, planned) for _, _, src, planned in got[h])
        out.append("          from " + ", ".join(f"h{src}{' P' if p else ''}: {k}"
                                              for (src, p), k in sorted(by_source.items())))
        for t, _, src, _ in got[h]:
            sent.setdefault(src, Counter())[int(t // width)] += 1
    out.append("  sent per bin:")
    for src in sorted(sent, key=lambda x: (x != "S", x)):
        out.append(f"  h{src:<2}         {row(sent[src], bins)}   {sum(sent[src].values())} chunks")
    out.append("  hop lags, ms (behind the source: the stripe's first, middle, last third; behind the seeder at "
               "the end):")
    for h, s, src, lags, behind in hop_lags(got, stripes):
        out.append(f"  h{h:<2} s{s} from h{src:<2} " + " ".join(_ms(x) for x in lags) + f"   {_ms(behind)}")
    last = max(got, key=lambda h: run["reports"][h]["done_at"])
    out.append(f"  the last {late} chunks of h{last} (finished last):")
    for t, i, src, planned in sorted(got[last])[-late:]:
        out.append(f"    {t:6.2f} s  chunk {i:5d} (stripe {i % stripes})  from h{src}{'' if planned else '  (help)'}")
    events = run.get("seed_events") or []
    if events:
        out.append("  the seeder's log:")
        host_of = {r["rank"]: h for h, r in run["reports"].items()}
        for t, msg in events:
            named = re.sub(r"\brank (\d+)", lambda m: f"rank {m[1]} (h{host_of.get(int(m[1]), '?')})", msg)
            out.append(f"    {t:6.2f} s  {named}")
    return "\n".join(out) + "\n"


def _ms(x: float | None) -> str:
    return "  n/a" if x is None else f"{x * 1000:5.0f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="broadcast.py --json output of a --trace run")
    ap.add_argument("--case", help="only runs of this case (equal, slow1, slow2, kill)")
    ap.add_argument("--bin", type=float, default=2.0, help="seconds per bin (2)")
    ap.add_argument("--late", type=int, default=20, help="how many of the last host's final chunks to list (20)")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    for run in doc["runs"]:
        if run.get("tool") != "p2pw" or (args.case and run.get("case") != args.case):
            continue
        print(f"{run.get('case')} N={run['n']} {run.get('variant')} run {run.get('rep')}: {run['time']:.2f} s")
        print(report(run, args.bin, args.late))


if __name__ == "__main__":
    main()
