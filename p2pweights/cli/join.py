"""``p2pw join`` and ``p2pw get``: a host's copy of a model, from a seeder's swarm or a standalone tracker's."""
from __future__ import annotations

import time

from ..errors import UserError
from .console import bind, human, load_key, model_cache, say, serve_until_fatal, start_ops, tell_path, write_json
from .flags import join_flags, limits, s3_flags


def cmd_join(args) -> int:
    from ..api import join, local_copy
    from ..storage.hfcache import hub_dir
    from ..ops.progress import Progress

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
        from ..storage.device import format_report

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


def cmd_get(args) -> int:
    from ..api import join
    from ..origin import Origin, trusted
    from ..wire.local import agent_dir

    agent = agent_dir(args.agent)
    if agent is not None and not args.tracker:  # the node's agent fetches it, once for every local process
        from .agent import cmd_get_via_agent

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


def join_parser(sub) -> None:
    """``p2pw join``'s arguments."""
    j = sub.add_parser("join", help="attach this host to a broadcast and download the checkpoint")
    j.add_argument("--parent", required=True, help="HOST[:PORT] of the seeder or any peer")
    join_flags(j)
    j.set_defaults(func=cmd_join, joiner=None, report_extra=dict)  # p2pw get: the join of an origin's swarm


def get_parser(sub) -> None:
    g = sub.add_parser("get", help="download a model from its origin's swarm at a standalone tracker, reading "
                                   "a share of the origin where this host can")
    g.add_argument("url", metavar="URL|MODEL_ID", help="the origin: s3://BUCKET/PREFIX, "
                   "http(s)://HOST/PATH (a file, or a folder ending in / its server lists as JSON), a path every host "
                   "sees, or "
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
