"""``p2pw tracker``: a standalone tracker, a swarm per model on one port."""
from __future__ import annotations

from ..swarm.tracker.admission import MAX_PER_HOST, MEMBER_TIMEOUT
from .console import bind, load_key, say, serve_until_fatal, start_ops, write_json
from .flags import ops_flags, output_path, port, positive, seconds


def cmd_tracker(args) -> int:
    from ..origin import Tracking

    http = start_ops(args, starting="loading")
    key = load_key(args.key)
    t = Tracking(port=args.port, host=args.host, key=key, topology=args.topology, advertise=args.advertise,
                 max_peers=args.max_peers, member_timeout=args.member_timeout, probe_port=args.probe_port,
                 max_per_host=args.max_conns_per_host, publish_from=args.publish_from, state_dir=args.state_dir)
    bind(http, t)
    say("serving", f"p2pw: tracker listening on {args.host}:{t.port}: a swarm per model published to it "
        f"(p2pw seed PATH --tracker HOST:{t.port}, p2pw get URL --tracker HOST:{t.port})", port=t.port)
    if key is None:
        say("unencrypted", "p2pw: WARNING: links are NOT encrypted or authenticated: anyone who can reach this "
            f"port can {'join a swarm' if args.publish_from else 'publish a manifest or join a swarm'} (use --key "
            "DIR from p2pw keygen)")
    write_json(args.ready, {"port": t.port})
    return serve_until_fatal(t)


def tracker_parser(sub) -> None:
    t = sub.add_parser("tracker", help="run a standalone tracker: a swarm per model on one port, no seeder "
                                       "(peers p2pw get URL --tracker HOST)")
    t.add_argument("--port", type=port, default=7420)
    t.add_argument("--host", default="0.0.0.0", help="address to listen on")
    t.add_argument("--key", metavar="DIR", help="fleet key directory (p2pw keygen): encrypt and authenticate links")
    t.add_argument("--advertise", help="HOST[:PORT] peers reach this tracker at (default: the one they used)")
    t.add_argument("--topology", default="forest:2", metavar="PLAN", help="the plan of every swarm: forest:K "
                                                                         "(default forest:2)")
    t.add_argument("--probe-port", type=port, default=None, metavar="PORT",
                   help="TCP port joiners time their uplink against (default: --port + 2, 7422; 0: any free one)")
    t.add_argument("--max-peers", type=positive, default=10_000, help="refuse joiners beyond this many per model")
    t.add_argument("--member-timeout", type=seconds, default=MEMBER_TIMEOUT, metavar="S",
                   help=f"drop a member not heard from for S seconds (default {MEMBER_TIMEOUT:g})")
    t.add_argument("--max-conns-per-host", type=positive, default=MAX_PER_HOST, metavar="N",
                   help=f"connections one address may hold with the tracker (default {MAX_PER_HOST})")
    t.add_argument("--publish-from", metavar="ADDR[,ADDR...]",
                   help="take PUBLISH only from these IPs or CIDRs (the operator's hosts); their swarms are never "
                        "evicted for others' (default: anyone who reaches the port may publish)")
    t.add_argument("--state-dir", metavar="DIR",
                   help="keep published manifests and URL -> model id bindings in DIR (a volume), written durably "
                        "and reloaded on start: a restart forgets no model (default: kept in memory only)")
    t.add_argument("--ready", type=output_path, help="write {port} as JSON to this file once listening")
    ops_flags(t)
    t.set_defaults(func=cmd_tracker)
