"""``p2pw seed``, ``p2pw manifest``, ``p2pw pack``, ``p2pw keygen``: what an operator runs where the checkpoint is."""
from __future__ import annotations

import time

from ..swarm.tracker.admission import MEMBER_TIMEOUT
from .console import bind, human, load_key, say, serve_until_fatal, start_ops, write_json
from .flags import (CHUNK_SIZE_HELP, FIRST_WINDOW, WINDOW_HELP, count, io_threads_flag, limit_flags, limits, ops_flags,
                    output_path, port, positive, s3_flags, seconds, size)


def cmd_seed(args) -> int:
    from ..api import DEFAULT_PLAN, seed
    from ..sources.formats import SKIPPED_DIRS

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
    from ..ops.progress import FleetProgress

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


def join_command(args, port: int, model_id: str, key) -> str:
    """The exact ``p2pw join`` line a peer runs to join this seeder (model pinned, key if any)."""
    import shlex

    from ..api import local_ip_towards, parse_addr

    if args.advertise:
        host, p = parse_addr(args.advertise, port)
    else:
        host, p = (args.host if args.host not in ("0.0.0.0", "", "::") else local_ip_towards("192.0.2.1")), port
    argv = ["p2pw", "join", "--parent", f"{host}:{p}", "--model-id", model_id]
    if key is not None:
        argv += ["--key", key.dir]
    return shlex.join(argv)


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


def cmd_keygen(args) -> int:
    from ..wire.keys import keygen

    key = keygen(args.dir)
    say("keygen", f"p2pw: wrote the fleet key pair to {key.dir} (fleet.key public, fleet.key_secret secret): "
          f"copy the directory to every host and pass --key {key.dir} to p2pw seed and p2pw join")
    return 0


def cmd_pack(args) -> int:
    from ..sources.pack import pack, unpack

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
    from ..sources.chunker import build
    from ..sources.remote import checkpoint, is_remote

    if is_remote(args.path):
        m, _, _ = checkpoint(args.path, args.s3_concurrency, args.s3_range_size).build(args.chunk_size, args.hash)
    else:
        m, _, _ = build(args.path, args.chunk_size, args.hash, exclude=args.exclude)
    if args.tracker:
        from ..origin import publish

        publish(args.tracker, args.path, m, load_key(args.key), timeout=args.connect_timeout)
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


def seed_parser(sub) -> None:
    """``p2pw seed``'s arguments."""
    from ..sources.manifest import HASH_NAMES

    s = sub.add_parser("seed", help="serve a checkpoint (file or directory) and run the tracker")
    s.add_argument("path", help="checkpoint file or directory, s3://BUCKET/PREFIX (pip install 'p2pweights[s3]'), "
                                "http(s)://HOST/PATH (a file, or a folder ending in / listed as JSON), "
                                "or ORG/NAME[@REVISION]: a snapshot in the local Hugging Face cache (HF_HUB_CACHE, "
                                "else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    s.add_argument("--port", type=port, default=7420)
    s.add_argument("--host", default="0.0.0.0", help="address to listen on")
    s.add_argument("--advertise", help="address peers should use to reach this host (default: the one they used)")
    s.add_argument("--probe-port", type=port, default=None, metavar="PORT",
                   help="TCP port joiners time their uplink against as they join (default: --port + 2, 7422; 0: "
                        "any free one; a firewall that lets only --port through leaves slow hosts to be found by "
                        "their rates)")
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
    ops_flags(s)
    s.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="do not serve entries matching GLOB (relative name or base name; repeatable); "
                        ".git/, .p2pw/ and .cache/huggingface/ are always skipped")
    s.set_defaults(func=cmd_seed)


def manifest_parser(sub) -> None:
    from ..sources.manifest import HASH_NAMES

    m = sub.add_parser("manifest", help="print (or write) the manifest of a checkpoint")
    m.add_argument("path")
    m.add_argument("--chunk-size", type=size, default=None,
                   help=CHUNK_SIZE_HELP)
    m.add_argument("-o", "--output")
    m.add_argument("--hash", default="xxh3_64", choices=HASH_NAMES,
                   help="chunk hash (as p2pw seed --hash): sha256 for a manifest published to a fleet, so no "
                        "member holding the fleet key can forge chunks; xxh3_64 (default) catches corruption only")
    m.add_argument("--tracker", metavar="HOST[:PORT]",
                   help="publish it to this standalone tracker (p2pw tracker), for p2pw get PATH --tracker")
    m.add_argument("--key", metavar="DIR", help="fleet key directory, when the tracker's links are keyed")
    m.add_argument("--connect-timeout", type=seconds, default=30.0, metavar="S",
                   help="wait this long for the tracker to take the manifest (default 30)")
    s3_flags(m)
    m.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="leave out entries matching GLOB (as p2pw seed --exclude; repeatable)")
    m.set_defaults(func=cmd_manifest)


def pack_parser(sub) -> None:
    pk = sub.add_parser("pack", help="rewrite safetensors into the loading-optimised layout (or back)")
    pk.add_argument("src", help="safetensors file or directory (with --unpack: a packed directory)")
    pk.add_argument("-o", "--output", required=True, help="packed directory (with --unpack: a .safetensors file)")
    pk.add_argument("--unpack", action="store_true", help="write a packed checkpoint back as one safetensors file")
    pk.set_defaults(func=cmd_pack)


def keygen_parser(sub) -> None:
    kg = sub.add_parser("keygen", help="write a new fleet key pair for encrypted, authenticated links")
    kg.add_argument("dir", help="directory to create (holds fleet.key and fleet.key_secret)")
    kg.set_defaults(func=cmd_keygen)
