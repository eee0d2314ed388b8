"""Flags: the argument types every command parses with (sizes, ports, seconds, paths) and the flag groups
commands share (object store, limits, I/O threads, a join's, probes and logs)."""
from __future__ import annotations

import argparse
import math
import os

from ..swarm.policy.pull import DEFAULT_WINDOW
from ..swarm.tracker.admission import CHILD_TIMEOUT, MAX_PER_HOST


CHUNK_SIZE_HELP = "chunk size (default: 4 MiB, halved down to 512 KiB while the checkpoint has under 512 chunks)"


FIRST_WINDOW = DEFAULT_WINDOW  # the scheduler's (pull imports no numpy: parsing stays cheap)


WINDOW_HELP = "first credit window of a link, until its rate is measured (then 0.25 s of it, 2-32 chunks)"


def size(text: str) -> int:
    """'4MiB', '4M', '4194304' -> bytes (an argparse type)."""
    from ..errors import UserError
    from ..storage.sizes import parse_size

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


def s3_flags(p) -> None:
    """Flags for an s3://BUCKET/PREFIX source (credentials and endpoint come from the AWS environment)."""
    p.add_argument("--s3-concurrency", type=positive, default=16, metavar="N",
                   help="s3:// and http(s):// sources: ranged GETs in flight (default 16)")
    p.add_argument("--s3-range-size", type=size, default=8 << 20, metavar="SIZE",
                   help="s3:// and http(s):// sources: bytes per ranged GET (default 8MiB)")


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
    ops_flags(j)


def ops_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", metavar="ADDR",
                   help="serve /healthz, /readyz and /metrics (Prometheus) on ADDR from process start: :9420 "
                        "(this host only), 0.0.0.0:9420 (every interface: what a Kubernetes probe needs), "
                        "[::1]:9420")
    p.add_argument("--log-format", choices=("text", "json"), default=argparse.SUPPRESS,
                   help="json: one JSON object per log line (ts, level, event, model_id, rank, ...)")
