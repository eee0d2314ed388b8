"""``p2pw status``, ``p2pw cache``, ``p2pw verify``: looking at a fleet, the model cache and a copy."""
from __future__ import annotations

import json
import sys
import time

from ..errors import UserError
from .console import human, load_key, model_cache
from .flags import seconds, size


def cmd_status(args) -> int:
    from ..api import status

    doc = status(args.addr, key=load_key(args.key), timeout=args.timeout, model_id=args.model_id)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    if "swarms" in doc:  # a standalone tracker serving several models: one line each
        print(f"p2pw: {len(doc['swarms'])} models (p2pw status {args.addr} --model-id ID for one)")
        for w in doc["swarms"]:
            print(f"{w.get('model_id')}  {w.get('peers')} peers ({w.get('done')} done), "
                  f"{human(w.get('total_size') or 0)}  {' '.join(map(str, w.get('urls', [])))}".rstrip())
        return 0
    peers = doc["peers"]
    done = sum(float(p.get("progress", 0)) >= 1.0 for p in peers)
    print(f"p2pw: model {doc.get('model_id')}: {doc.get('count', len(peers))} peers ({done} done), "
          f"{human(doc.get('total_size') or 0)}; slowest first")
    rows = [("RANK", "ADDR", "SOURCES", "PROGRESS", "RATE", "STATE")]
    for p in peers:
        sources = ",".join(str(r) for r in p.get("sources", [])) or "-"
        state = p.get("state", "?") + (" (demoted)" if p.get("demoted") else "")
        rows.append((str(p.get("rank")), str(p.get("addr")), sources, f"{100 * float(p.get('progress', 0)):.1f}%",
                     f"{float(p.get('rate', 0)) / 1e6:.1f} MB/s", state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i in (0, 3, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
              .rstrip())
    if doc.get("count", len(peers)) > len(peers):
        print(f"p2pw: ... and {doc['count'] - len(peers)} more (the fastest) not listed")
    return 0


def cmd_cache(args) -> int:
    if args.model is not None and args.action != "rm":
        raise UserError(f"p2pw cache {args.action} takes no MODEL (got {args.model!r}): "
                        "p2pw cache rm MODEL removes one")
    cache = model_cache(args)
    if args.action == "ls":
        entries = cache.entries()
        print(f"p2pw: model cache {cache.root}: {len(entries)} cop{'y' if len(entries) == 1 else 'ies'}, "
              f"{human(sum(e.bytes for e in entries if e.owned))} owned" +
              (f" of {human(cache.size)} (--cache-size)" if cache.size is not None else ", no size limit"))
        if entries:
            print(f"{'model':<17} {'size':>10} {'uses':>4} {'last used':>19} {'fetch s':>8} {'score':>9}  state  path")
        for e in sorted(entries, key=lambda e: -cache.eviction.score(e)):
            last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(e.uses))) if e.uses else "-"
            state = ("in use" if e.in_use else "ok" if e.complete else "partial") + (
                "" if e.owned else ", --hf-cache" if e.layout == "hf" else ", --out")
            fetch = f"{e.fetch_seconds:.2f}" if e.fetch_seconds is not None else "-"
            print(f"{e.model_id[:16]:<17} {human(e.bytes):>10} {len(e.uses):>4} {last:>19} {fetch:>8} "
                  f"{cache.eviction.score(e):9.3g}  {state}  {e.path}" + (f"  ({e.name})" if e.name else ""))
        for key, rec in cache.failed.records():
            if cache.failures.blocks(rec):
                until = time.strftime("%H:%M:%S", time.localtime(cache.failures.until(rec)))
                print(f"p2pw: not retried until {until}: "
                      f"{key[:16]}: {rec['reason']}")
    elif args.action == "rm":
        if not args.model:
            raise UserError("p2pw cache rm needs the MODEL (an id, a prefix of at least 4 hex digits, or ORG/NAME)")
        removed = cache.remove(args.model)
        for path in removed:
            print(f"p2pw: removed {path}")
        if not removed:  # a record of no copy (torn, hand-edited): forgotten
            print(f"p2pw: forgot {args.model}: the cache kept no copy of it")
    else:
        r = cache.gc()
        for path in r["forgotten"]:
            print(f"p2pw: forgot {path} (gone)")
        for path in r["unreadable"]:
            print(f"p2pw: dropped the unreadable record {path}")
        for path in r["incomplete"]:
            print(f"p2pw: removed incomplete {path}")
        for e in r["evicted"]:
            print(f"p2pw: evicted {e.model_id[:16]} ({human(e.bytes)}) {e.path}")
        print(f"p2pw: gc done: {len(r['evicted'])} evicted, {len(r['incomplete'])} incomplete removed, "
              f"{len(r['forgotten'])} forgotten, {len(r['unreadable'])} unreadable records and {r['failures']} expired "
              "failures dropped")
    return 0


def cmd_verify(args) -> int:
    from ..sources.manifest import Manifest
    from ..sources.source import verify_copy

    try:
        with open(args.manifest, "rb") as f:
            m = Manifest.from_json(f.read())
    except OSError as e:
        raise SystemExit(f"p2pw: error: cannot read manifest {args.manifest}: {e.strerror}")
    checked, problem = verify_copy(args.dir, m)
    if problem:
        print(f"p2pw: error: {args.dir}: {problem}", file=sys.stderr)
        return 1
    print(f"p2pw: {args.dir}: all {checked} chunks match model {m.model_id[:16]}")
    return 0


def status_parser(sub) -> None:
    st = sub.add_parser("status", help="ask the tracker for the fleet: each peer's rank, address, sources, "
                                       "progress, rate and state, the slowest first")
    st.add_argument("addr", metavar="HOST:PORT", help="the seeder (or any peer: it points to the tracker)")
    st.add_argument("--json", action="store_true", help="print the fleet as JSON")
    st.add_argument("--key", metavar="DIR", help="fleet key directory, when the fleet's links are keyed")
    st.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for the answer")
    st.add_argument("--model-id", help="a standalone tracker's swarm of this model (its id or a prefix)")
    st.set_defaults(func=cmd_status)


def cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="show and manage the model cache ($P2PW_CACHE_DIR)")
    c.add_argument("action", choices=("ls", "rm", "gc"), help="ls: list; rm MODEL: remove one; gc: clean up, "
                                                              "evict down to --cache-size")
    c.add_argument("model", nargs="?", help="for rm: a model id (or a prefix of 4+ hex digits) or ORG/NAME")
    c.add_argument("--cache-size", type=size, metavar="BYTES", help="the size to keep (default: P2PW_CACHE_SIZE)")
    c.set_defaults(func=cmd_cache)


def verify_parser(sub) -> None:
    v = sub.add_parser("verify", help="check a local copy against a manifest")
    v.add_argument("dir")
    v.add_argument("--manifest", required=True)
    v.set_defaults(func=cmd_verify)
