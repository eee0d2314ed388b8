#!/usr/bin/env python3
"""A BitTorrent peer (libtorrent) for the broadcast benchmark: one process per emulated host.

    python bench/bt_peer.py torrent DIR -o FILE.torrent [--piece-size 256KiB]
    python bench/bt_peer.py seed FILE.torrent DIR --listen ADDR:PORT --ready F
                                 [--done-dir D --expect N] [--utp]
    python bench/bt_peer.py leech FILE.torrent --out DIR --listen ADDR:PORT --peers A:P,B:P,...
                                  --done-dir D --expect N --name NAME [--report F] [--utp]

``torrent`` writes a v1 .torrent of the checkpoint directory DIR (256 KiB
pieces unless told; the files in sorted order, as ``p2pw`` lays them out too).

``seed`` serves DIR (already complete: added in seed mode, no re-hash), writes
``--ready`` once the torrent is seeding, and runs until SIGTERM/SIGINT or, with
``--done-dir``, until every leecher is finished.

``leech`` downloads into ``--out`` (the files land under ``OUT/<torrent name>/``),
connecting to every address in ``--peers`` (the seeder and the other leechers; no
tracker, no DHT, no LSD, no UPnP/NAT-PMP).  When complete it writes
``D/NAME.done`` and keeps seeding until every one of the ``--expect`` leechers
is finished (``D/*.done``, or ``D/*.gone`` for a peer the benchmark killed), the
way a ``p2pw join`` stays while others depend on it, then exits 0.
``--report`` gets the same wall-clock fields as ``p2pw join --report``:
``started_at`` (session created), ``first_chunk_at`` (first piece verified),
``done_at`` (last piece verified), plus payload bytes down and up.

Session settings: no rate limits at all, and ``ignore_limits_on_local_network``
off, so the 10.x addresses of the testbed get no special treatment; protocol
encryption disabled both ways (p2pw's links are plaintext without ``--key``);
TCP only unless ``--utp`` (uTP runs its congestion control in user space, which
costs CPU on a small machine; ``bench/broadcast.py --bt-utp`` measures it).
Everything else is libtorrent's default (choking: 8 unchoke slots, optimistic
unchoke, rarest first).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

import libtorrent as lt

PIECE_SIZE = 256 << 10


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def make_torrent(directory: str, out: str, piece_size: int = PIECE_SIZE) -> dict:
    """Write a v1 .torrent of ``directory``; returns {"pieces", "piece_size", "total_size", "name"}."""
    d = Path(directory).resolve()
    fs = lt.file_storage()
    lt.add_files(fs, str(d))
    ct = lt.create_torrent(fs, piece_size, lt.create_torrent.v1_only)
    ct.set_creator("p2pweights bench")
    lt.set_piece_hashes(ct, str(d.parent))
    Path(out).write_bytes(lt.bencode(ct.generate()))
    return {"pieces": ct.num_pieces(), "piece_size": piece_size, "total_size": fs.total_size(), "name": d.name}


def session(listen: str, utp: bool) -> lt.session:
    """A session listening on ``listen`` (ADDR:PORT) with the settings described above."""
    s = {
        "listen_interfaces": listen,
        "enable_dht": False, "enable_lsd": False, "enable_upnp": False, "enable_natpmp": False,
        "enable_incoming_utp": utp, "enable_outgoing_utp": utp,
        "enable_incoming_tcp": True, "enable_outgoing_tcp": True,
        "in_enc_policy": int(lt.enc_policy.disabled), "out_enc_policy": int(lt.enc_policy.disabled),
        "upload_rate_limit": 0, "download_rate_limit": 0,
        "ignore_limits_on_local_network": False,
        "alert_mask": int(lt.alert.category_t.error_notification | lt.alert.category_t.status_notification
                          | lt.alert.category_t.piece_progress_notification),
    }
    return lt.session(s)


def _finished(done_dir: Path, expect: int) -> bool:
    names = {p.stem for p in done_dir.iterdir() if p.suffix in (".done", ".gone")}
    return len(names) >= expect


def _stop_event() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_seed(args) -> int:
    stop = _stop_event()
    ses = session(args.listen, args.utp)
    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(args.torrent)
    atp.save_path = str(Path(args.dir).resolve().parent)
    atp.flags |= lt.torrent_flags.seed_mode
    atp.flags &= ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
    h = ses.add_torrent(atp)
    while not h.status().is_seeding:
        if stop.wait(0.02):
            return 1
    Path(args.ready).write_text(json.dumps({"total_size": atp.ti.total_size()}))
    while not stop.is_set():
        ses.wait_for_alert(100)
        ses.pop_alerts()
        if args.done_dir and _finished(Path(args.done_dir), args.expect):
            break
    st = h.status()
    print(json.dumps({"uploaded": st.total_payload_upload}), flush=True)
    return 0


def cmd_leech(args) -> int:
    started = time.time()
    stop = _stop_event()
    ses = session(args.listen, args.utp)
    atp = lt.add_torrent_params()
    atp.ti = lt.torrent_info(args.torrent)
    atp.save_path = args.out
    atp.flags &= ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
    h = ses.add_torrent(atp)
    for peer in filter(None, args.peers.split(",")):
        host, port = peer.rsplit(":", 1)
        h.connect_peer((host, int(port)))
    done_dir = Path(args.done_dir)
    first = done = None
    while not stop.is_set():
        ses.wait_for_alert(50)
        for a in ses.pop_alerts():
            if isinstance(a, lt.piece_finished_alert) and first is None:
                first = time.time()
            elif isinstance(a, lt.torrent_finished_alert) and done is None:
                done = time.time()
            elif isinstance(a, (lt.file_error_alert, lt.torrent_error_alert)):
                print(f"bt_peer: error: {a.message()}", file=sys.stderr, flush=True)
                return 1
        if done is None and h.status().is_seeding:
            done = time.time()
        if done is not None:
            if not (done_dir / f"{args.name}.done").exists():
                (done_dir / f"{args.name}.done").write_text("")
            if _finished(done_dir, args.expect):
                break
    if done is None:
        return 1  # stopped before complete
    st = h.status()
    if args.report:
        Path(args.report).write_text(json.dumps({
            "started_at": started, "first_chunk_at": first or done, "done_at": done,
            "bytes": st.total_wanted_done, "downloaded": st.total_payload_download,
            "bytes_sent": st.total_payload_upload}))
    ses.pause()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bt_peer", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("torrent", help="write a .torrent of a checkpoint directory")
    t.add_argument("dir")
    t.add_argument("-o", "--output", required=True)
    t.add_argument("--piece-size", type=_size, default=PIECE_SIZE)
    for name in ("seed", "leech"):
        p = sub.add_parser(name)
        p.add_argument("torrent")
        p.add_argument("--listen", required=True, help="ADDR:PORT to listen on")
        p.add_argument("--utp", action="store_true", help="allow uTP as well as TCP")
        p.add_argument("--done-dir", help="directory of NAME.done / NAME.gone files")
        p.add_argument("--expect", type=int, default=0, help="leechers to wait for")
        if name == "seed":
            p.add_argument("dir", help="the complete checkpoint directory the torrent was made of")
            p.add_argument("--ready", required=True, help="write JSON here once seeding")
        else:
            p.add_argument("--out", required=True)
            p.add_argument("--peers", default="", help="comma-separated ADDR:PORT of the other hosts")
            p.add_argument("--name", required=True)
            p.add_argument("--report")
    args = ap.parse_args(argv)
    if args.cmd == "torrent":
        print(json.dumps(make_torrent(args.dir, args.output, args.piece_size)))
        return 0
    if args.cmd == "leech" and not args.done_dir:
        ap.error("leech needs --done-dir")
    return cmd_seed(args) if args.cmd == "seed" else cmd_leech(args)


if __name__ == "__main__":
    sys.exit(main())
