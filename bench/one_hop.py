#!/usr/bin/env python3
"""One hop on loopback: p2pw seeder -> one peer, against raw pyzmq PUSH/PULL of the same bytes, same run.

    python bench/one_hop.py [--size 1GiB] [--chunk-size 4MiB] [--repeat 3] [--disk] [--curve] [--hash sha256,blake3]
                            [--memory]

The raw baseline is the best a pyzmq program can do on this hop: a sender
process pushes the blob in chunk-sized zero-copy frames from memory, a receiver
process receives each frame straight into a preallocated, pre-touched buffer
(``recv_into``).  The p2pw run is the real thing: ``p2pw seed`` in one process,
``p2pw join`` in another, timed from the join call until every chunk is
verified (handshake, manifest, buffer allocation, hashing all included).
Runs alternate so both see the same machine.  Prints the median ratio.
``--curve`` adds a run with every link CURVE-encrypted (a fresh fleet key);
``--hash`` adds a run per chunk hash named (the seeder's manifest, verified by
the peer), so each option's cost is a ratio against the same baseline.
``--disk`` adds the file-backed path: ``p2pw join --out`` (the destination
files are the store, mapped shared) against raw pyzmq received with
``recv_into`` straight into a shared mapping of a preallocated file on the
same disk ("raw, file map"), both timed until the last byte is in the
mapping (the kernel writes it back afterwards in both).  ``--memory`` samples
the seeder's and the joiner's RSS and anonymous memory (RssAnon in
/proc/PID/status) through every p2pw run and prints their peaks.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from p2pweights.cli import size  # noqa: E402


def raw_sender(port: int, path: str, chunk: int) -> None:
    import zmq

    data = memoryview(open(path, "rb").read())
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.bind(f"tcp://127.0.0.1:{port}")
    s.setsockopt(zmq.SNDHWM, 16)
    time.sleep(0.3)
    for lo in range(0, len(data), chunk):
        s.send(data[lo:lo + chunk], copy=False)
    s.close(linger=-1)
    ctx.term()


def raw_receiver(port: int, total: int, chunk: int, fresh: bool) -> None:
    import numpy as np
    # fresh: the natural program, a new buffer that the receive loop faults in (as any receiver of
    # a new model must); touched: faulted in before timing, the ceiling of the hop alone
    buf = np.empty(total, dtype=np.uint8) if fresh else np.ones(total, dtype=np.uint8)
    _receive_timed(port, memoryview(buf), total, chunk)


def _receive_timed(port: int, view, total: int, chunk: int) -> None:
    """Pull ``total`` bytes into ``view`` in ``chunk`` frames; print the seconds of the transfer."""
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 16)
    s.connect(f"tcp://127.0.0.1:{port}")
    got = s.recv_into(view[0:chunk])
    t0 = time.perf_counter()  # first frame arrived: the timed part is pure transfer
    lo = got
    while lo < total:
        lo += s.recv_into(view[lo:lo + chunk])
    secs = (time.perf_counter() - t0) * total / (total - got)
    print(json.dumps({"seconds": secs}))
    s.close(0)
    ctx.term()


def raw_file_receiver(port: int, total: int, chunk: int, directory: str, sparse: bool = False) -> None:
    """Receive the blob straight into a shared mapping of a preallocated file (what p2pw --out does), or of a
    sparse one (``sparse``: ftruncate only, blocks allocated as pages are first written)."""
    import mmap

    path = os.path.join(directory, "raw-copy.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if sparse:
        os.ftruncate(fd, total)
    else:
        os.posix_fallocate(fd, 0, total)
    buf = mmap.mmap(fd, total, flags=mmap.MAP_SHARED)
    view = memoryview(buf)
    _receive_timed(port, view, total, chunk)
    view.release()
    buf.close()
    os.close(fd)
    os.remove(path)


def status_kib(pid: int) -> dict:
    """VmHWM (peak RSS), VmRSS and RssAnon of ``pid`` in KiB (empty once it has exited)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon"):
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


class Peaks:
    """Samples /proc/PID/status of named processes every 20 ms in a thread; keeps each one's peaks."""

    def __init__(self):
        import threading

        self.pids: dict[str, int] = {}
        self.peak: dict[str, dict] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(0.02):
            for name, pid in list(self.pids.items()):
                for key, kib in status_kib(pid).items():
                    slot = self.peak.setdefault(name, {})
                    slot[key] = max(slot.get(key, 0), kib)

    def close(self) -> dict:
        self.stop.set()
        self.thread.join()
        return self.peak


def condition_memory(size: int) -> None:
    """Touch and free 3x ``size`` of memory in a throwaway process before a measured run.

    On this VM, guest memory not touched since boot faults in several times
    slower than memory freed by an earlier process (3 GiB of fresh np.ones:
    7.8 s once, 0.2 s later), so whichever run allocates first after another
    one would pay for the other's history.  Conditioning gives every run,
    raw or p2pw, recycled memory to allocate from.
    """
    subprocess.run([sys.executable, "-c", f"import numpy; numpy.ones({3 * size}, numpy.uint8)"], check=True)


def run_raw(path: str, total: int, chunk: int, port: int, fresh: bool = False, into_dir: str | None = None,
            sparse: bool = False) -> float:
    role = ["--role", "raw-recv-sparse" if sparse else "raw-recv-file", "--blob", into_dir] if into_dir else [
        "--role", "raw-recv-fresh" if fresh else "raw-recv"]
    recv = subprocess.Popen([sys.executable, __file__, *role,
                             "--port", str(port), "--size", str(total), "--chunk-size", str(chunk)],
                            stdout=subprocess.PIPE)
    send = subprocess.Popen([sys.executable, __file__, "--role", "raw-send", "--port", str(port),
                             "--blob", path, "--chunk-size", str(chunk)])
    out, _ = recv.communicate(timeout=300)
    send.wait(60)
    return json.loads(out)["seconds"]


def run_p2pw(path: str, chunk: int, port: int, out_dir: str | None, extra: list[str], seed_only=(),
             memory: dict | None = None) -> dict:
    """One p2pw seed + join; with ``memory`` (a dict), fill it with both processes' peak RSS and RssAnon."""
    with tempfile.TemporaryDirectory() as tmp:
        ready, report = os.path.join(tmp, "ready"), os.path.join(tmp, "peer.json")
        # a fresh manifest catalog: the seeder scans the blob into memory before serving (a first start),
        # so the timed part is the hop itself, not a restarted seeder's reads from storage
        os.environ["P2PW_CACHE_DIR"] = os.path.join(tmp, "catalog")
        seeder = subprocess.Popen([sys.executable, "-m", "p2pweights", "seed", path, "--host", "127.0.0.1",
                                   "--port", str(port), "--chunk-size", str(chunk), "--ready", ready, *extra, *seed_only],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        try:
            while not os.path.exists(ready):
                if seeder.poll() is not None:
                    raise RuntimeError("seeder failed to start")
                time.sleep(0.05)
            condition_memory(os.path.getsize(path))  # after the seeder's scan, before the peer allocates
            argv = [sys.executable, "-m", "p2pweights", "join", "--parent", f"127.0.0.1:{port}", "--host",
                    "127.0.0.1", "--report", report, "-q", *extra]
            argv += ["--out", out_dir] if out_dir else ["--no-cache"]  # in memory: not the model cache
            peaks = Peaks()
            peaks.pids["seeder"] = seeder.pid
            joiner = subprocess.Popen(argv, stdout=subprocess.DEVNULL, cwd=ROOT)
            peaks.pids["joiner"] = joiner.pid
            if joiner.wait(300) != 0:
                raise RuntimeError(f"p2pw join exited {joiner.returncode}")
            peaks.pids.pop("joiner")
            if memory is not None:
                memory.update(peaks.close())
            else:
                peaks.close()
            with open(report) as f:
                return json.load(f)
        finally:
            seeder.terminate()
            seeder.wait(30)


def print_memory(size: int, memory: dict) -> None:
    print(f"\npeak memory (MiB) of a {size / 2**30:.2f} GiB one-hop run: VmHWM = peak RSS (page cache of mapped "
          "files included), RssAnon = anonymous")
    print(f"{'path':<16}{'seeder RSS':>11}{'seeder anon':>12}{'joiner RSS':>11}{'joiner anon':>12}")
    for name, m in memory.items():
        s_, j_ = m.get("seeder", {}), m.get("joiner", {})
        print(f"{name:<16}{s_.get('VmHWM', 0) / 1024:>11.0f}{s_.get('RssAnon', 0) / 1024:>12.0f}"
              f"{j_.get('VmHWM', 0) / 1024:>11.0f}{j_.get('RssAnon', 0) / 1024:>12.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=size, default=1 << 30)
    ap.add_argument("--chunk-size", type=size, default=4 << 20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--disk", action="store_true", help="also time p2pw writing the copy to disk")
    ap.add_argument("--curve", action="store_true", help="also time p2pw with CURVE on every link")
    ap.add_argument("--hash", default="", help="also time p2pw with these chunk hashes (comma-separated)")
    ap.add_argument("--memory", action="store_true", help="print peak RSS and RssAnon of seeder and joiner")
    ap.add_argument("--memory-only", action="store_true",
                    help="only the memory table: one p2pw run in memory and one with --out, no timing rows")
    ap.add_argument("--port", type=int, default=17420)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--blob", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "raw-send":
        raw_sender(args.port, args.blob, args.chunk_size)
        return 0
    if args.role in ("raw-recv-file", "raw-recv-sparse"):
        raw_file_receiver(args.port, args.size, args.chunk_size, args.blob, sparse=args.role == "raw-recv-sparse")
        return 0
    if args.role in ("raw-recv", "raw-recv-fresh"):
        raw_receiver(args.port, args.size, args.chunk_size, fresh=args.role == "raw-recv-fresh")
        return 0

    with tempfile.TemporaryDirectory(prefix="p2pw-bench-") as tmp:
        blob = os.path.join(tmp, "blob.bin")
        with open(blob, "wb") as f:
            left = args.size
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
        if args.memory_only:
            memory = {}
            for name, out in (("p2pw", None), ("p2pw --out", os.path.join(tmp, "copy"))):
                run_p2pw(blob, args.chunk_size, args.port + 1, out, [], memory=memory.setdefault(name, {}))
            print_memory(args.size, memory)
            return 0
        variants = {"p2pw": ([], [])}  # row name -> (arguments for seed and join, for seed only)
        if args.curve:
            key = os.path.join(tmp, "key")
            subprocess.run([sys.executable, "-m", "p2pweights", "keygen", key], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            variants["p2pw curve"] = (["--key", key], [])
        for name in filter(None, args.hash.split(",")):
            variants[f"p2pw {name}"] = ([], ["--hash", name])
        rows = {"raw pyzmq": [], "raw, fresh buf": [], **{name: [] for name in variants}}
        if args.disk:
            rows["raw, file map"] = []
            rows["raw, sparse map"] = []
            rows["p2pw --out"] = []
        memory: dict[str, dict] = {}
        # Warm-up, not counted: on a VM, guest memory touched for the first time since boot costs
        # several times more than memory the guest has used before (measured: 3 GiB of fresh
        # np.ones took 7.8 s), and whichever run comes first pays it.
        run_raw(blob, args.size, args.chunk_size, args.port)
        run_p2pw(blob, args.chunk_size, args.port + 1, None, [])
        for r in range(args.repeat):
            condition_memory(args.size)
            rows["raw pyzmq"].append(run_raw(blob, args.size, args.chunk_size, args.port))
            condition_memory(args.size)
            rows["raw, fresh buf"].append(run_raw(blob, args.size, args.chunk_size, args.port, fresh=True))
            for name, (extra, seed_only) in variants.items():
                mem = memory.setdefault(name, {}) if args.memory and r == 0 else None
                rows[name].append(run_p2pw(blob, args.chunk_size, args.port + 1, None, extra, seed_only,
                                           memory=mem)["seconds"])
            if args.disk:
                condition_memory(args.size)
                rows["raw, file map"].append(run_raw(blob, args.size, args.chunk_size, args.port, into_dir=tmp))
                condition_memory(args.size)
                rows["raw, sparse map"].append(run_raw(blob, args.size, args.chunk_size, args.port, into_dir=tmp,
                                                       sparse=True))
                out = os.path.join(tmp, f"copy{r}")
                mem = memory.setdefault("p2pw --out", {}) if args.memory and r == 0 else None
                rows["p2pw --out"].append(run_p2pw(blob, args.chunk_size, args.port + 1, out, [],
                                                   memory=mem)["seconds"])
                shutil.rmtree(out)
        base = statistics.median(rows["raw pyzmq"])
        fresh = statistics.median(rows["raw, fresh buf"])
        print(f"one hop on loopback, {args.size / 2**30:.2f} GiB in {args.chunk_size >> 20} MiB chunks, "
              f"median of {args.repeat} after a warm-up run")
        filemap = statistics.median(rows["raw, file map"]) if args.disk else None
        print(f"{'path':<16}{'seconds':>9}{'GB/s':>8}{'vs touched':>12}{'vs fresh':>10}"
              + (f"{'vs file map':>13}" if filemap else ""))
        for name, secs in rows.items():
            med = statistics.median(secs)
            print(f"{name:<16}{med:>9.3f}{args.size / med / 1e9:>8.2f}{base / med:>12.2f}{fresh / med:>10.2f}"
                  + (f"{filemap / med:>13.2f}" if filemap else ""))
        print("touched: raw receiver's buffer faulted in before timing (the hop alone); fresh: faulted in by "
              "the receive loop, as p2pw's is; file map: raw receiver into a shared mapping of a preallocated "
              "file, as p2pw --out's is (sparse map: of a file only truncated to size, its blocks allocated as pages are "
              "first written)")
        if memory:
            print_memory(args.size, memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
