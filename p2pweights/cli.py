"""CLI: ``p2pw pack | keygen | seed | join | tracker | get | cache | status | manifest | verify | demo | simulate``.

Thin: every command is a call into the library plus printing.  Errors a user
can cause end as one ``p2pw: error: ...`` line and exit status 1, never a
traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time

from .errors import UserError
from .swarm.tracker.admission import CHILD_TIMEOUT, MAX_PER_HOST, MEMBER_TIMEOUT
from .swarm.policy.pull import DEFAULT_WINDOW

log = logging.getLogger("p2pw")

CHUNK_SIZE_HELP = "chunk size (default: 4 MiB, halved down to 512 KiB while the checkpoint has under 512 chunks)"
FIRST_WINDOW = DEFAULT_WINDOW  # the scheduler's (pull imports no numpy: parsing stays cheap)
WINDOW_HELP = "first credit window of a link, until its rate is measured (then 0.25 s of it, 2-32 chunks)"


def size(text: str) -> int:
    """'4MiB', '4M', '4194304' -> bytes (an argparse type)."""
    from .errors import UserError
    from .storage.sizes import parse_size

    try:
        return parse_size(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free one) (an argparse type)."""
    n = int(text) if text.strip().isdigit() else -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"bad port {text!r}: give 0-65535 (0: any free one)")
    return n


def at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""
    def whole(text: str) -> int:
        if not text.strip().isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
        return int(text)
    return whole


positive, count = at_least(1), at_least(0)


def seconds(text: str, zero: bool = False) -> float:
    """A finite number of seconds > 0 (>= 0 with ``zero``; an argparse type)."""
    try:
        t = float(text)
    except ValueError:
        t = math.nan
    if not (0 <= t if zero else 0 < t) or not t < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds {'>=' if zero else '>'} 0")
    return t


def nonnegative_seconds(text: str) -> float:
    """A finite number of seconds >= 0 (an argparse type)."""
    return seconds(text, zero=True)


def output_path(text: str) -> str:
    """A file written later (an argparse type): its folder must exist and be writable now, not only once
    the work it reports on is done."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is no folder this user can write to")
    return text


def human(n: float) -> str:
    from .ops import human as _human

    return _human(n)


events = logging.getLogger("p2pw.events")  # what the CLI tells its user: stdout lines, or JSON log lines
LOG = {"format": "text"}
context = None  # ops.LogContext of this process, once logging is configured


def say(event: str, text: str, **fields) -> None:
    """One line for the user: printed on stdout, or with --log-format json one JSON log line."""
    if LOG["format"] == "json":
        events.info(text.removeprefix("p2pw: "), extra={"event": event, **fields})
    else:
        print(text, flush=True)


def start_ops(args, starting: str):
    """The --http server, listening before anything else happens (None without --http)."""
    if not getattr(args, "http", None):
        return None
    from .ops import OpsServer

    server = OpsServer(args.http)
    server.readiness.starting = starting
    events.info("serving /healthz /readyz /metrics on %s", server.addr,
                extra={"event": "http", "addr": server.addr, "port": server.port})
    return server


def bind(server, handle) -> None:
    """The node exists: probes, metrics and log lines read it from now on."""
    if server is not None:
        server.bind(handle)
    if context is not None:
        context.handle = handle


def error(message: str) -> None:
    """The one error line: ``p2pw: error: ...`` on stderr (a JSON log line with --log-format json)."""
    if LOG["format"] == "json":
        events.error(message, extra={"event": "error"})
    else:
        print(f"p2pw: error: {message}", file=sys.stderr)


def write_json(path: str | None, doc: dict) -> None:
    if path:
        from .storage.cache import write_text_atomically
        write_text_atomically(path, json.dumps(doc, indent=1))


def serve_until_signalled(finished=lambda: False, every: float = 0.1) -> None:
    """Block until SIGINT or SIGTERM (ending cleanly, not with a traceback) or until ``finished()``."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(every) and not finished():
        pass


def serve_until_fatal(owner, finished=lambda: False, every: float = 0.1) -> int:
    """Serve until a signal, ``finished()`` or the node's fatal error, then close ``owner`` (a seeder, tracker or
    download); 1 with that error said once, else 0."""
    try:
        serve_until_signalled(lambda: owner.node.fatal is not None or finished(), every)
    finally:
        owner.close()
    if owner.node.fatal is not None:
        error(owner.node.fatal)
        return 1
    return 0


def cmd_seed(args) -> int:
    from .api import DEFAULT_PLAN, seed
    from .sources.formats import SKIPPED_DIRS

    http = start_ops(args, starting="loading")
    key = load_key(args.key)
    args.topology = args.topology or DEFAULT_PLAN
    if args.topology.strip().lower() == "auto" and args.expect:
        args.topology = f"auto:{args.expect}"
    s = seed(args.path, port=args.port, host=args.host, chunk_size=args.chunk_size, topology=args.topology,
             advertise=args.advertise, window=args.window, hash=args.hash, key=key, max_peers=args.max_peers,
             manifest=args.manifest, exclude=args.exclude, s3_concurrency=args.s3_concurrency,
             s3_range_size=args.s3_range_size, probe_port=args.probe_port, member_timeout=args.member_timeout,
             tracker=args.tracker, **limits(args))
    bind(http, s)
    if args.tracker:
        return origin_seeder(s, args)
    m = s.manifest
    if m.origin:
        o = m.origin
        say("origin", f"p2pw: {o['repo']}" + (f"@{o['revision']}" if o.get("revision") else "") +
            f" is commit {o['commit']}, snapshot {s.path}", origin=o, snapshot=s.path)
    say("serving", f"p2pw: serving {args.path}: {human(m.total_size)} in {m.n_chunks} chunks of "
        f"{human(m.chunk_size)}, {len(m.files)} files, {len(m.tensors)} tensors " + (
            "(manifest known: reading chunks from storage as peers ask)" if s.source is not None
            else f"(read {human(s.bytes_read)} from storage in {s.scan_seconds:.2f} s)"),
        path=args.path, total_size=m.total_size, n_chunks=m.n_chunks, port=s.port)
    if s.skipped:
        say("skipped", f"p2pw: not served: {', '.join(s.skipped)} ({' '.join(d + '/' for d in SKIPPED_DIRS)} are "
            "always skipped; --exclude GLOB skips more)", skipped=s.skipped)
    say("model_id", f"p2pw: model id {s.model_id}")
    if key is None:
        say("unencrypted", "p2pw: WARNING: links are NOT encrypted or authenticated: anyone who can reach this "
            "port can fetch the model (use --key DIR from p2pw keygen)")
    else:
        say("encrypted", f"p2pw: links are CURVE-encrypted; only holders of the fleet key in {key.dir} can join")
    command = join_command(args, s.port, s.model_id, key)
    say("join_command", f"p2pw: join with: {command}", command=command)
    write_json(args.ready, {"port": s.port, "model_id": s.model_id, "total_size": m.total_size})
    from .ops import FleetProgress

    lines = FleetProgress(s, every=args.progress_every)
    try:  # the fleet snapshot the loop publishes: never the tracker's live member table from this thread
        if serve_until_fatal(s, lambda: bool(args.exit_after) and s.fleet.done >= args.exit_after
                             and s.fleet.all_left):
            return 1  # e.g. its files changed under it: said once
    finally:
        lines.close()
    fleet = s.fleet  # the loop's last snapshot, taken as it ended
    report = {"model_id": s.model_id, "total_size": m.total_size, "bytes_read": s.bytes_read,
              "bytes_sent": s.stats.bytes_sent, "chunks_sent": s.stats.chunks_sent, "malformed": s.stats.malformed,
              "peers": {p.rank: {"parents": list(p.sources), "done": p.done, "peer_id": p.peer_id}
                        for p in sorted(fleet.peers, key=lambda p: p.rank)}}
    if s.s3 is not None:
        report["s3_retries"] = s.s3.retries
    write_json(args.report, report)
    say("seeder_done", f"p2pw: seeder done: read {human(s.bytes_read)} from storage for a {human(m.total_size)} "
        f"model ({s.bytes_read / max(m.total_size, 1):.2f}x), sent {human(s.stats.bytes_sent)} to "
        f"{len(fleet.peers)} peers", bytes_read=s.bytes_read, bytes_sent=s.stats.bytes_sent, peers=len(fleet.peers))
    return 0


def load_key(directory: str | None):
    """The fleet key in ``directory``, or None when links stay unencrypted."""
    from .wire.keys import load

    return load(directory) if directory is not None else None


def join_command(args, port: int, model_id: str, key) -> str:
    """The exact ``p2pw join`` line a peer runs to join this seeder (model pinned, key if any)."""
    import shlex

    from .api import local_ip_towards, parse_addr

    if args.advertise:
        host, p = parse_addr(args.advertise, port)
    else:
        host, p = (args.host if args.host not in ("0.0.0.0", "", "::") else local_ip_towards("192.0.2.1")), port
    argv = ["p2pw", "join", "--parent", f"{host}:{p}", "--model-id", model_id]
    if key is not None:
        argv += ["--key", key.dir]
    return shlex.join(argv)


def cmd_keygen(args) -> int:
    from .wire.keys import keygen

    key = keygen(args.dir)
    say("keygen", f"p2pw: wrote the fleet key pair to {key.dir} (fleet.key public, fleet.key_secret secret): "
          f"copy the directory to every host and pass --key {key.dir} to p2pw seed and p2pw join")
    return 0


def tell_path(path: str) -> None:
    """The copy's directory as the last line on stdout, for scripts (with --log-format json, an event)."""
    if LOG["format"] == "json":
        say("path", f"p2pw: the copy is in {path}", path=path)
    else:
        print(path, flush=True)


def model_cache(args, needed: bool = True):
    """The node's model cache; where its folder cannot be written, None for a join that writes elsewhere
    (--out, --hf-cache: it just is not remembered), else one error line."""
    from .storage.modelcache import ModelCache

    cache = ModelCache(size=args.cache_size)
    try:
        os.makedirs(cache.root, exist_ok=True)
        writable = os.access(cache.root, os.W_OK)
    except OSError:
        writable = False
    if writable:
        return cache
    if needed:
        raise UserError(f"cannot write the model cache {cache.root}: set P2PW_CACHE_DIR, or give --out DIR "
                        "(or --no-cache to keep the copy in memory)")
    log.warning("cannot write the model cache %s: this copy is not remembered there", cache.root)
    return None


def cmd_join(args) -> int:
    from .api import join, local_copy
    from .storage.hfcache import hub_dir
    from .ops import Progress

    if args.out and args.hf_cache is not None:
        raise UserError("give --out DIR or --hf-cache [DIR], not both")
    hf = (args.hf_cache or hub_dir()) if args.hf_cache is not None else None
    cache = None if args.no_cache else model_cache(args, needed=not args.out and hf is None)
    if cache is not None and args.model_id and not args.stay and not args.device and args.verify == "marker":
        t0 = time.monotonic()
        found = local_copy(args.model_id, cache, out=args.out, hf_cache=hf)
        if found is not None:  # complete here already: nobody needs asking
            path, m = found
            say("local", f"p2pw: model {m.model_id[:16]} is complete in {path} (its marker matches): fetched "
                f"nothing in {time.monotonic() - t0:.3f} s", model_id=m.model_id, path=path)
            tell_path(path)
            write_json(args.report, {"model_id": m.model_id, "path": path, "bytes": m.total_size, "received": 0,
                                     "resumed": m.n_chunks, "local": True})
            return 0
    http = start_ops(args, starting="connecting")
    start = lambda: (args.joiner or join)(args.parent, out=args.out, port=args.port, host=args.host,  # noqa: E731
                         advertise=args.advertise, model_id=args.model_id, window=args.window, trace=args.trace,
                         connect_timeout=args.connect_timeout, device=args.device, parent_timeout=args.parent_timeout,
                         give_up_after=args.give_up_after, verify=args.verify, memory_budget=args.memory_budget,
                         key=load_key(args.key), cache=cache, hf_cache=hf, retry_now=args.retry_now, **limits(args))
    dl = start()
    if getattr(dl, "attached", False):  # another process on this host is writing --out: follow it
        if not follow_local(dl, args):
            return 0
        dl = start()  # complete now (--stay): serve it
    bind(http, dl)
    bar = None if args.quiet else Progress(dl, every=args.progress_every)
    try:
        dl.wait()
    finally:
        if bar:
            bar.close()
    p, st = dl.progress, dl.stats
    secs = dl.seconds
    parents = ", ".join(f"rank {x['rank']}" for x in dl.parents)
    say("done", f"p2pw: done {human(p['total'])} in {secs:.2f} s ({p['total'] / secs / 1e9:.3f} GB/s), "
        f"{p['n_chunks']} chunks, {st.refetched} re-fetched; rank {dl.rank} under {parents}",
        bytes=p["total"], seconds=round(secs, 3), refetched=st.refetched, received_bytes=st.bytes_received)
    if dl.snapshot:
        say("hf_cache", f"p2pw: in the Hugging Face cache {hf}: {dl.manifest.origin['repo']} at {dl.snapshot} "
            "(from_pretrained finds it with HF_HUB_OFFLINE=1)", snapshot=dl.snapshot)
    if dl.path:
        tell_path(dl.snapshot or dl.path)
    if args.device:
        from .storage.device import format_report

        dl.state_dict()
        say("device", format_report(dl.stage_report()), report=dl.stage_report())
    wall = time.time() - time.monotonic()  # wall clock = monotonic + this, for comparing peer processes
    write_json(args.report, {"rank": dl.rank, "parents": [x["rank"] for x in dl.parents], "plan": dl.parents, "seconds": secs,
                             "bytes": p["total"], "refetched": st.refetched, "bad_chunks": st.bad_chunks,
                             "bytes_sent": st.bytes_sent, "model_id": dl.model_id, "listen": dl.listen,
                             "resumed": st.resumed, "received": st.chunks_received, "stalled": st.stalled,
                             "reparented": st.reparented, "switches": st.switches, "duplicates": st.duplicates,
                             "write_cpu_seconds": round(dl.store.write_seconds, 3),
                             "ring": dl.store.ring.report() if dl.store.ring is not None else None,
                             **dl.threads(),  # threads (CPU seconds by role), loop_us_per_chunk
                             "path": dl.snapshot or dl.path,
                             # wall clock (epoch s) of join() and of the last verified chunk, for benchmarks
                             # that compare peers in separate processes against one common start
                             "started_at": wall + dl.started,
                             "done_at": wall + dl.started + secs,
                             "first_chunk_at": wall + (dl.store.first_at or dl.started),
                             **({"chunks": dl.arrivals()} if args.trace else {}), **args.report_extra()})
    if args.stay:
        say("staying", "p2pw: staying to serve others (Ctrl-C to stop)")
        return serve_until_fatal(dl, every=0.2)
    else:
        dl.close(linger=True if args.linger is None else args.linger)
    return 0


def follow_local(dl, args) -> bool:
    """Wait for the copy another local process writes into --out (``localcopy.Attached``): one download per host.
    Whether to serve it now (--stay)."""
    say("attached", f"p2pw: another process on this host is downloading model {dl.model_id[:16]} into {dl.path}: "
        "following its progress, fetching nothing", model_id=dl.model_id, path=dl.path)
    try:
        dl.wait()
    finally:
        dl.close()
    secs = time.monotonic() - dl.started
    say("done", f"p2pw: model {dl.model_id[:16]} complete in {dl.path}, written by the other process: fetched "
        f"nothing in {secs:.2f} s", model_id=dl.model_id, path=dl.path, seconds=round(secs, 3))
    tell_path(dl.path)
    write_json(args.report, {"model_id": dl.model_id, "path": dl.path, "bytes": dl.manifest.total_size,
                             "received": 0, "seconds": secs, "local": True, "attached": True})
    return bool(args.stay)


def cmd_tracker(args) -> int:
    from .origin import Tracking

    http = start_ops(args, starting="loading")
    key = load_key(args.key)
    t = Tracking(port=args.port, host=args.host, key=key, topology=args.topology, advertise=args.advertise,
                 max_peers=args.max_peers, member_timeout=args.member_timeout, probe_port=args.probe_port,
                 max_per_host=args.max_conns_per_host, publish_from=args.publish_from)
    bind(http, t)
    say("serving", f"p2pw: tracker listening on {args.host}:{t.port}: a swarm per model published to it "
        f"(p2pw seed PATH --tracker HOST:{t.port}, p2pw get URL --tracker HOST:{t.port})", port=t.port)
    if key is None:
        say("unencrypted", "p2pw: WARNING: links are NOT encrypted or authenticated: anyone who can reach this "
            f"port can {'join a swarm' if args.publish_from else 'publish a manifest or join a swarm'} (use --key "
            "DIR from p2pw keygen)")
    write_json(args.ready, {"port": t.port})
    return serve_until_fatal(t)


def cmd_get(args) -> int:
    from .api import join
    from .origin import Origin, trusted
    from .wire.local import agent_dir

    agent = agent_dir(args.agent)
    if agent is not None and not args.tracker:  # the node's agent fetches it, once for every local process
        from .agent.command import cmd_get_via_agent

        return cmd_get_via_agent(args, agent)
    if not args.tracker:
        raise UserError("give --tracker HOST[:PORT], or --agent DIR (or P2PW_AGENT) for the node's agent")
    key = load_key(args.key)
    m, source = trusted(args.tracker, args.url, key, wait=args.connect_timeout, published=args.manifest,
                        model_id=args.model_id, read_origin=not args.no_origin, s3_concurrency=args.s3_concurrency,
                        s3_range_size=args.s3_range_size)
    origin = Origin(args.url, m, source)
    args.parent, args.model_id = args.tracker, m.model_id
    args.joiner = lambda parent, **kw: join(parent, origin=origin, **kw)
    args.report_extra = lambda: {"origin_bytes_read": origin.bytes_read, "origin_reader": source is not None,
                                 "url": args.url}
    return cmd_join(args)


def origin_seeder(s, args) -> int:
    """``p2pw seed PATH --tracker HOST``: serve the shares read until signalled; the report, exit 0."""
    m = s.manifest
    say("serving", f"p2pw: serving {args.path} as an origin reader in {args.tracker}'s swarm of model "
        f"{s.model_id} ({human(m.total_size)} in {m.n_chunks} chunks)", path=args.path, model_id=s.model_id,
        port=s.port)
    say("model_id", f"p2pw: model id {s.model_id}")
    write_json(args.ready, {"port": s.port, "model_id": s.model_id, "total_size": m.total_size})
    if serve_until_fatal(s):
        return 1
    write_json(args.report, {"model_id": s.model_id, "total_size": m.total_size, "bytes_read": s.bytes_read,
                             "origin_bytes_read": s.bytes_read, "origin_chunks": s.stats.origin_chunks,
                             "bytes_sent": s.stats.bytes_sent, "chunks_sent": s.stats.chunks_sent,
                             "malformed": s.stats.malformed})
    return 0


def cmd_status(args) -> int:
    from .api import status

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


def cmd_pack(args) -> int:
    from .sources.pack import pack, unpack

    t0 = time.monotonic()
    if args.unpack:
        n = unpack(args.src, args.output)
        print(f"p2pw: unpacked {n} tensors of {args.src} into {args.output} in {time.monotonic() - t0:.2f} s")
        return 0
    doc = pack(args.src, args.output)
    print(f"p2pw: packed {len(doc['tensors'])} tensors ({human(doc['total_size'])}, forward-pass order, "
          f"{doc['align']}-byte aligned) into {args.output} in {time.monotonic() - t0:.2f} s")
    return 0


def cmd_manifest(args) -> int:
    from .sources.chunker import build

    if args.path.startswith("s3://"):
        from .sources.objstore import S3Checkpoint

        m, _, _ = S3Checkpoint(args.path, args.s3_concurrency, args.s3_range_size).build(args.chunk_size)
    else:
        m, _, _ = build(args.path, args.chunk_size, exclude=args.exclude)
    if args.tracker:
        from .origin import publish

        publish(args.tracker, args.path, m, load_key(args.key))
        print(f"p2pw: published the manifest of {args.path} (model id {m.model_id}) to {args.tracker}")
        if not args.output:
            return 0
    text = m.to_json(indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
        print(f"p2pw: wrote manifest of {args.path} ({m.n_chunks} chunks, model id {m.model_id}) to {args.output}")
    else:
        print(text)
    return 0


def cmd_verify(args) -> int:
    from .sources.manifest import Manifest
    from .sources.source import verify_copy

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


def cmd_demo(args) -> int:
    from .demo import run_demo
    from .errors import P2PError

    try:
        return run_demo(peers=args.peers, size_mb=args.size_mb, workdir=args.workdir, chunk_size=args.chunk_size)
    except (ValueError, RuntimeError) as e:  # a model size the demo cannot build, a peer that failed
        raise P2PError(f"demo: {e}") from None


def cmd_simulate(args, rest) -> int:
    from .swarm.simulate import main as simulate_main

    return simulate_main(rest) or 0


def s3_flags(p) -> None:
    """Flags for an s3://BUCKET/PREFIX source (credentials and endpoint come from the AWS environment)."""
    p.add_argument("--s3-concurrency", type=positive, default=16, metavar="N",
                   help="s3:// sources: ranged GETs in flight (default 16)")
    p.add_argument("--s3-range-size", type=size, default=8 << 20, metavar="SIZE",
                   help="s3:// sources: bytes per ranged GET (default 8MiB)")


def limit_flags(p) -> None:
    """What one host may hold at a serving node (``swarm.tracker.admission``)."""
    p.add_argument("--child-timeout", type=seconds, default=CHILD_TIMEOUT, metavar="S",
                   help=f"drop a peer pulling from this one that is silent for S seconds (default {CHILD_TIMEOUT:g}; "
                        "peers heartbeat every link)")
    p.add_argument("--max-conns-per-host", type=positive, default=MAX_PER_HOST, metavar="N",
                   help=f"connections one address may hold with this node (default {MAX_PER_HOST})")


def limits(args) -> dict:
    """``limit_flags``' values, ``--io-threads``, and a join's ``--workers`` and ``--lanes``."""
    return {"child_timeout": args.child_timeout, "max_per_host": args.max_conns_per_host,
            **({"io_threads": args.io_threads} if "io_threads" in args else {}),
            **({"workers": args.workers} if "workers" in args else {}),
            **({"lanes": args.lanes} if "lanes" in args else {})}


def io_threads_flag(p) -> None:
    """``--io-threads``: libzmq's threads that carry a node's bytes (``wire.context``)."""
    p.add_argument("--io-threads", type=positive, metavar="N",
                   help="libzmq I/O threads carrying this node's bytes, each connection on one (default: "
                        "P2PW_IO_THREADS, else one per 4 cores, 1 to 8; more for NICs faster than about 25 Gbit/s)")


def _seed_parser(sub) -> None:
    """``p2pw seed``'s arguments."""
    from .sources.manifest import HASH_NAMES

    s = sub.add_parser("seed", help="serve a checkpoint (file or directory) and run the tracker")
    s.add_argument("path", help="checkpoint file or directory, s3://BUCKET/PREFIX (pip install 'p2pweights[s3]'), "
                                "or ORG/NAME[@REVISION]: a snapshot in the local Hugging Face cache (HF_HUB_CACHE, "
                                "else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    s.add_argument("--port", type=port, default=7420)
    s.add_argument("--host", default="0.0.0.0", help="address to listen on")
    s.add_argument("--advertise", help="address peers should use to reach this host (default: the one they used)")
    s.add_argument("--probe-port", type=port, default=0, metavar="PORT",
                   help="TCP port joiners time their uplink against as they join (default: any free one; a "
                        "firewall that lets only --port through leaves slow hosts to be found by their rates)")
    s.add_argument("--chunk-size", type=size, default=None,
                   help=CHUNK_SIZE_HELP)
    s.add_argument("--topology", default=None, metavar="PLAN",
                   help="the plan: forest:K (default forest:2: K interior-disjoint stripe trees, every peer "
                        "also pulls from partners), or binomial, chain, star, kary:K, striped:K, auto "
                        "(picks from --expect), kept to compare against")
    s.add_argument("--expect", type=positive, metavar="N",
                   help="peers expected (how --topology auto chooses; default 16)")
    s.add_argument("--window", type=positive, default=FIRST_WINDOW, help=WINDOW_HELP)
    s.add_argument("--exit-after", type=count, default=0, metavar="N", help="exit once N peers are done and gone")
    s.add_argument("--manifest", metavar="M",
                   help="serve at once with this manifest (from p2pw manifest PATH -o M) instead of hashing "
                        "PATH first; chunks are read from storage and verified as peers ask for them")
    s.add_argument("--ready", type=output_path, help="write {port, model_id} as JSON to this file once serving")
    s.add_argument("--report", type=output_path, help="write a JSON report to this file on exit")
    s.add_argument("--key", metavar="DIR", help="fleet key directory (p2pw keygen): encrypt and authenticate links")
    s.add_argument("--hash", default="xxh3_64", choices=HASH_NAMES,
                   help="chunk hash: xxh3_64 (default, fast, catches corruption) or a cryptographic one "
                        "(sha256, blake2b, blake3) that also stops a peer forging chunks")
    s.add_argument("--max-peers", type=positive, default=10_000, help="refuse joiners beyond this many peers")
    s.add_argument("--tracker", metavar="HOST[:PORT]",
                   help="join the swarm of a standalone tracker (p2pw tracker) as one of the model's origin "
                        "readers: publish the manifest there, read and serve the shares it hands out, run no tracker")
    s.add_argument("--member-timeout", type=seconds, default=MEMBER_TIMEOUT, metavar="S",
                   help=f"drop a member not heard from for S seconds (default {MEMBER_TIMEOUT:g}; members report "
                        "every 0.5 s)")
    limit_flags(s)
    io_threads_flag(s)
    s3_flags(s)
    s.add_argument("--progress-every", type=seconds, default=10.0, metavar="S",
                   help="seconds between lines about the fleet (peers, done, the slowest) while peers download")
    _ops_flags(s)
    s.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="do not serve entries matching GLOB (relative name or base name; repeatable); "
                        ".git/, .p2pw/ and .cache/huggingface/ are always skipped")
    s.set_defaults(func=cmd_seed)


def _join_parser(sub) -> None:
    """``p2pw join``'s arguments."""
    j = sub.add_parser("join", help="attach this host to a broadcast and download the checkpoint")
    j.add_argument("--parent", required=True, help="HOST[:PORT] of the seeder or any peer")
    join_flags(j)
    j.set_defaults(func=cmd_join, joiner=None, report_extra=dict)  # p2pw get: the join of an origin's swarm


def join_flags(j) -> None:
    """What ``p2pw join`` and ``p2pw get`` share: where the copy goes, how the join behaves."""
    j.add_argument("--out", help="write the checkpoint's files to this directory (default: the model cache, "
                                 "$P2PW_CACHE_DIR/models/MODEL_ID)")
    j.add_argument("--hf-cache", nargs="?", const="", metavar="DIR",
                   help="write the copy in the Hugging Face cache layout in DIR (default: HF_HUB_CACHE, else "
                        "$HF_HOME/hub, else ~/.cache/huggingface/hub), for from_pretrained(\"org/name\")")
    j.add_argument("--cache-size", type=size, metavar="BYTES",
                   help="keep the model cache under this size, evicting unused models first "
                        "(default: P2PW_CACHE_SIZE, else no limit)")
    j.add_argument("--retry-now", action="store_true",
                   help="try a model whose join failed lately for a cause that repeats, without waiting out its "
                        "backoff")
    j.add_argument("--no-cache", action="store_true",
                   help="without --out, keep the copy in memory (or a temporary file) only; no model cache")
    j.add_argument("--port", type=port, default=0, help="port to serve children on (default: any free one)")
    j.add_argument("--host", default="0.0.0.0")
    j.add_argument("--advertise", help="address other peers should use to reach this host")
    j.add_argument("--model-id", help="accept only this model (its id, or at least the first 16 hex digits)")
    j.add_argument("--key", metavar="DIR", help="fleet key directory (p2pw keygen), as given to p2pw seed")
    j.add_argument("--stay", action="store_true", help="keep serving after the download completes")
    j.add_argument("--linger", type=nonnegative_seconds, metavar="S",
                   help="once the copy is complete, keep serving peers that still miss chunks (late arrivals are "
                        "sent to complete holders first) for at most S seconds before exiting (default: a quarter "
                        "of the download's time; peers planned under this one are served until done or moved)")
    j.add_argument("--window", type=positive, default=FIRST_WINDOW, help=WINDOW_HELP)
    j.add_argument("--workers", type=count, metavar="N",
                   help="threads that verify and write received chunks beside the event loop (default: "
                        "P2PW_WORKERS, else min(4, cores - 1), none on 1-2 cores; 0: the loop does it)")
    io_threads_flag(j)
    j.add_argument("--lanes", type=positive, metavar="N",
                   help="connections to pull over from each partner, so its bytes ride several I/O threads (default: "
                        "P2PW_LANES, else one per --io-threads; a partner takes at most 8)")
    j.add_argument("--connect-timeout", type=seconds, default=30.0, help="seconds to keep trying the parent")
    j.add_argument("--parent-timeout", type=seconds, default=5.0,
                   help="seconds of silence after which a partner is given up (a planned one for another)")
    j.add_argument("--give-up-after", type=seconds, default=300.0, metavar="S",
                   help="exit 1 once no chunk arrived from anyone for S seconds (the seeder and every holder "
                        "gone), keeping verified chunks for a resume (default 300)")
    j.add_argument("--verify", choices=("marker", "full"), default="marker",
                   help="marker (default): a copy in --out whose .p2pw/complete.json matches the model is served "
                        "as it is; full: re-hash every chunk on disk first")
    j.add_argument("--memory-budget", type=size, metavar="SIZE",
                   help="without --out, a blob larger than this is kept in a temporary file, not memory; with "
                        "--out, the ring serving recent chunks from memory grows to an eighth of it "
                        "(default: half the memory available)")
    j.add_argument("--report", type=output_path, help="write a JSON summary to this file")
    limit_flags(j)
    j.add_argument("--trace", action="store_true",
                   help="add each verified chunk to the --report as [seconds since join, chunk, from rank, "
                        "planned rank] (what a slow broadcast waited on: bench/trace.py reads them)")
    j.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    j.add_argument("--device", help="stream chunks into one buffer on this torch device (cpu, cuda:N) "
                                    "and print the stage report")
    j.add_argument("--progress-every", type=seconds, default=10.0, metavar="S",
                   help="seconds between progress lines when stderr is not a terminal (default 10)")
    _ops_flags(j)


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
    for name, add in COMMANDS.items():
        if named is None or name == named:
            add(sub)
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


def _tracker_parser(sub) -> None:
    t = sub.add_parser("tracker", help="run a standalone tracker: a swarm per model on one port, no seeder "
                                       "(peers p2pw get URL --tracker HOST)")
    t.add_argument("--port", type=port, default=7420)
    t.add_argument("--host", default="0.0.0.0", help="address to listen on")
    t.add_argument("--key", metavar="DIR", help="fleet key directory (p2pw keygen): encrypt and authenticate links")
    t.add_argument("--advertise", help="HOST[:PORT] peers reach this tracker at (default: the one they used)")
    t.add_argument("--topology", default="forest:2", metavar="PLAN", help="the plan of every swarm: forest:K "
                                                                         "(default forest:2)")
    t.add_argument("--probe-port", type=port, default=0, metavar="PORT",
                   help="TCP port joiners time their uplink against (default: any free one)")
    t.add_argument("--max-peers", type=positive, default=10_000, help="refuse joiners beyond this many per model")
    t.add_argument("--member-timeout", type=seconds, default=MEMBER_TIMEOUT, metavar="S",
                   help=f"drop a member not heard from for S seconds (default {MEMBER_TIMEOUT:g})")
    t.add_argument("--max-conns-per-host", type=positive, default=MAX_PER_HOST, metavar="N",
                   help=f"connections one address may hold with the tracker (default {MAX_PER_HOST})")
    t.add_argument("--publish-from", metavar="ADDR[,ADDR...]",
                   help="take PUBLISH only from these IPs or CIDRs (the operator's hosts); their swarms are never "
                        "evicted for others' (default: anyone who reaches the port may publish)")
    t.add_argument("--ready", type=output_path, help="write {port} as JSON to this file once listening")
    _ops_flags(t)
    t.set_defaults(func=cmd_tracker)


def _get_parser(sub) -> None:
    g = sub.add_parser("get", help="download a model from its origin's swarm at a standalone tracker, reading "
                                   "a share of the origin where this host can")
    g.add_argument("url", metavar="URL|MODEL_ID", help="the origin: s3://BUCKET/PREFIX, a path every host sees, or "
                   "ORG/NAME[@REVISION] in the local Hugging Face cache (as published to the tracker); with --agent, "
                   "also a model id")
    g.add_argument("--tracker", metavar="HOST[:PORT]", help="the standalone tracker (p2pw tracker)")
    g.add_argument("--agent", metavar="DIR", help="ask the node's agent (p2pw agent --cache DIR; default: "
                                                  "P2PW_AGENT) and print its verified copy's folder; --out links "
                                                  "the files there")
    g.add_argument("--manifest", metavar="M", help="publish this manifest (p2pw manifest URL -o M) for URL if "
                                                   "the tracker has none")
    g.add_argument("--no-origin", action="store_true",
                   help="never read the origin here, even where this host can: take every chunk from peers")
    s3_flags(g)
    join_flags(g)
    g.set_defaults(func=cmd_get, joiner=None, report_extra=dict)


def _status_parser(sub) -> None:
    st = sub.add_parser("status", help="ask the tracker for the fleet: each peer's rank, address, sources, "
                                       "progress, rate and state, the slowest first")
    st.add_argument("addr", metavar="HOST:PORT", help="the seeder (or any peer: it points to the tracker)")
    st.add_argument("--json", action="store_true", help="print the fleet as JSON")
    st.add_argument("--key", metavar="DIR", help="fleet key directory, when the fleet's links are keyed")
    st.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for the answer")
    st.add_argument("--model-id", help="a standalone tracker's swarm of this model (its id or a prefix)")
    st.set_defaults(func=cmd_status)


def _cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="show and manage the model cache ($P2PW_CACHE_DIR)")
    c.add_argument("action", choices=("ls", "rm", "gc"), help="ls: list; rm MODEL: remove one; gc: clean up, "
                                                              "evict down to --cache-size")
    c.add_argument("model", nargs="?", help="for rm: a model id (or a prefix of 4+ hex digits) or ORG/NAME")
    c.add_argument("--cache-size", type=size, metavar="BYTES", help="the size to keep (default: P2PW_CACHE_SIZE)")
    c.set_defaults(func=cmd_cache)


def _pack_parser(sub) -> None:
    pk = sub.add_parser("pack", help="rewrite safetensors into the loading-optimised layout (or back)")
    pk.add_argument("src", help="safetensors file or directory (with --unpack: a packed directory)")
    pk.add_argument("-o", "--output", required=True, help="packed directory (with --unpack: a .safetensors file)")
    pk.add_argument("--unpack", action="store_true", help="write a packed checkpoint back as one safetensors file")
    pk.set_defaults(func=cmd_pack)


def _keygen_parser(sub) -> None:
    kg = sub.add_parser("keygen", help="write a new fleet key pair for encrypted, authenticated links")
    kg.add_argument("dir", help="directory to create (holds fleet.key and fleet.key_secret)")
    kg.set_defaults(func=cmd_keygen)


def _manifest_parser(sub) -> None:
    m = sub.add_parser("manifest", help="print (or write) the manifest of a checkpoint")
    m.add_argument("path")
    m.add_argument("--chunk-size", type=size, default=None,
                   help=CHUNK_SIZE_HELP)
    m.add_argument("-o", "--output")
    m.add_argument("--tracker", metavar="HOST[:PORT]",
                   help="publish it to this standalone tracker (p2pw tracker), for p2pw get PATH --tracker")
    m.add_argument("--key", metavar="DIR", help="fleet key directory, when the tracker's links are keyed")
    s3_flags(m)
    m.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="leave out entries matching GLOB (as p2pw seed --exclude; repeatable)")
    m.set_defaults(func=cmd_manifest)


def _verify_parser(sub) -> None:
    v = sub.add_parser("verify", help="check a local copy against a manifest")
    v.add_argument("dir")
    v.add_argument("--manifest", required=True)
    v.set_defaults(func=cmd_verify)


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="local broadcast of a generated model to N peer processes")
    d.add_argument("--peers", type=int, default=4)
    d.add_argument("--size-mb", type=float, default=256)
    d.add_argument("--chunk-size", type=size, default=None,
                   help=CHUNK_SIZE_HELP)
    d.add_argument("--workdir", help="keep the model and copies here (default: a temporary directory)")
    d.set_defaults(func=cmd_demo)


def _simulate_parser(sub) -> None:
    sim = sub.add_parser("simulate", help="predict broadcast time for a fleet (see p2pw simulate --help)",
                         add_help=False)
    sim.set_defaults(func=cmd_simulate)


def _agent_parser(sub) -> None:
    from .agent.command import add_parser

    add_parser(sub)


COMMANDS = {"seed": _seed_parser, "join": _join_parser, "tracker": _tracker_parser, "get": _get_parser,
            "agent": _agent_parser, "status": _status_parser, "cache": _cache_parser,
            "pack": _pack_parser, "keygen": _keygen_parser, "manifest": _manifest_parser,
            "verify": _verify_parser, "demo": _demo_parser, "simulate": _simulate_parser}  # in --help's order


def _ops_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", metavar="ADDR",
                   help="serve /healthz, /readyz and /metrics (Prometheus) on ADDR from process start: :9420 "
                        "(this host only), 0.0.0.0:9420 (every interface: what a Kubernetes probe needs), "
                        "[::1]:9420")
    p.add_argument("--log-format", choices=("text", "json"), default=argparse.SUPPRESS,
                   help="json: one JSON object per log line (ts, level, event, model_id, rank, ...)")


def main(argv: list[str] | None = None) -> int:
    from .errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    # no command does linear algebra; numpy's OpenBLAS pool would otherwise start a thread per core that
    # spins at startup (measured: about 5 % of a join's CPU)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ap = parser(argv)
    args, rest = ap.parse_known_args(argv)
    if args.command != "simulate" and rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    from .ops import LogContext, configure_logging

    global context
    context = LogContext()
    LOG["format"] = args.log_format
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
