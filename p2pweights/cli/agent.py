"""``p2pw agent`` (the process) and ``p2pw get URL|MODEL_ID --agent DIR`` (a client of it)."""
from __future__ import annotations

import os
import time

from ..agent.service import Agent
from ..errors import UserError
from .console import error, load_key, say, serve_until_signalled, tell_path, write_json
from .flags import ops_flags, output_path, seconds, size


def cmd_agent(args) -> int:
    http = None
    if args.http:
        from ..ops.http import parse_http_addr

        parse_http_addr(args.http)  # a bad address fails before anything starts
    key = load_key(args.key)
    agent = Agent(args.tracker, args.cache, key=key, prewarm=args.prewarm, cache_size=args.cache_size,
                  socket_group=args.socket_group, host=args.host, advertise=args.advertise,
                  no_origin=args.no_origin, connect_timeout=args.connect_timeout, local_roots=args.local_root)
    try:
        if args.http:
            from ..agent.httpops import AgentOps

            http = AgentOps(args.http, agent)
        say("serving", f"p2pw: agent for {agent.keeper.cache.root} (socket {agent.server.path}), swarms at "
            f"{args.tracker}; {len(agent.resumed)} cached models served or resumed", socket=agent.server.path,
            resumed=agent.resumed)
        write_json(args.ready, {"socket": agent.server.path, "resumed": agent.resumed,
                                **({"http_port": http.port} if http else {})})
        serve_until_signalled(lambda: not agent.alive(), every=0.2)
    finally:
        if http is not None:
            http.close()
        agent.close()
    if not agent.alive() and not agent.stopped.is_set():
        error("the agent's loop stopped")
        return 1
    return 0


def cmd_get_via_agent(args, agent: str) -> int:
    """``p2pw get URL|MODEL_ID --agent DIR``: the agent fetches it once for the host; wait for its verified copy,
    link it into --out if given, print where it is."""
    from ..storage.agentcopy import link_tree, wait_through_agent

    t0 = time.monotonic()
    dl = wait_through_agent(agent, args.url, args.model_id, timeout=args.connect_timeout + 600,
                            wait=args.connect_timeout, stall=args.give_up_after)
    try:
        manifest, path = dl.manifest, dl.path
    finally:
        dl.close()
    where, links = path, None
    if args.out:
        if os.path.abspath(args.out) == os.path.abspath(path):
            raise UserError(f"--out {args.out} is the agent's own copy: give another folder")
        links = link_tree(manifest, path, args.out)
        where = os.path.abspath(args.out)
    secs = time.monotonic() - t0
    say("done", f"p2pw: model {manifest.model_id[:16]} complete in {path} (through the agent at {agent}) in "
        f"{secs:.2f} s", model_id=manifest.model_id, path=where, seconds=round(secs, 3))
    tell_path(where)
    write_json(args.report, {"model_id": manifest.model_id, "path": where, "copy": path, "agent": agent,
                             "bytes": manifest.total_size, "received": 0, "seconds": secs, "local": True,
                             **(links or {})})
    return 0


def agent_parser(sub) -> None:
    a = sub.add_parser("agent", help="run the node agent: keep this node's models, serve them to the swarm, fetch "
                                     "what local processes ask for once (p2pw get --agent DIR)")
    a.add_argument("--tracker", required=True, metavar="HOST[:PORT]", help="the standalone tracker (p2pw tracker)")
    a.add_argument("--cache", required=True, metavar="DIR", help="the node's model cache; the socket local clients "
                                                                 "use is DIR/agent.sock")
    a.add_argument("--prewarm", metavar="FILE", help="model URLs or ids, one a line, pulled and kept; watched: a new "
                                                     "line is pulled, a removed one becomes evictable")
    a.add_argument("--key", metavar="DIR", help="fleet key directory (p2pw keygen): encrypt and authenticate links")
    a.add_argument("--cache-size", type=size, metavar="BYTES", help="evict (by the cache's policy) to stay under this "
                                                                     "(default: P2PW_CACHE_SIZE, else no limit)")
    a.add_argument("--socket-group", metavar="GROUP", help="let this group's members use the socket (mode 0660); "
                                                           "default: the agent's own user and root (0600)")
    a.add_argument("--host", default="0.0.0.0", help="address peers connect to this node on")
    a.add_argument("--advertise", help="HOST peers reach this node at (default: the address towards the tracker)")
    a.add_argument("--no-origin", action="store_true", help="never read an origin here: take every chunk from peers")
    a.add_argument("--local-root", action="append", default=[], metavar="DIR",
                   help="read origins named by an absolute path only under this folder (repeatable; none: no local "
                        "path is ever read as an origin, only s3:// and Hugging Face repo ids)")
    a.add_argument("--connect-timeout", type=seconds, default=30.0, metavar="S",
                   help="keep trying the tracker, or waiting for a manifest, this long (default 30)")
    a.add_argument("--ready", type=output_path, metavar="FILE", help="write {socket, resumed, http_port} as JSON once listening")
    ops_flags(a)
    a.set_defaults(func=cmd_agent)
