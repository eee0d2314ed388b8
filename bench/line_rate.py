#!/usr/bin/env python3
"""Line rate on loopback: p2pw beside raw-socket programs doing the same work, per-thread CPU per GB.

    python bench/line_rate.py [--sizes 1GiB,3GiB] [--where disk,tmpfs] [--modes hop,relay] [--repeat 3]
                              [--cores K[,K...]] [--chunk-size 4MiB] [--disk-dir /var/tmp] [--json FILE]
                              [--join-args '--io-threads 2 --lanes 2'] [--seed-args '--io-threads 2']

Two shapes, each run by p2pw and by raw programs in the same invocation,
alternating so both see the same machine:

- ``hop``: one join.  p2pw: ``p2pw seed SRC`` (hashed and serving first),
  then ``p2pw join --out DIR``, timed from launch until it exits 0.  Raw: a
  sender process (``sendfile`` from the source file) already listening, then
  a receiver launched and timed until it exits 0: ``recv_into`` one
  page-aligned chunk buffer, ``pwrite`` into the destination file (``O_DIRECT``
  where the filesystem is not in memory), fsync at the end.
- ``relay``: two joins that forward to each other.  p2pw: two joins at once
  under the default plan (each forwards one stripe of the chunks to the
  other).  Raw: the sender sends even chunks to one relay and odd chunks to
  the other; each relay writes what it gets and forwards its stripe to the
  other relay, which writes it too.  Timed until both exit 0.

The source file and the destinations are on disk (``--disk-dir``) or on tmpfs
(/dev/shm).  Every process's threads are read from /proc/PID/task/*/stat
(utime + stime, and comm) every 20 ms while it runs; a join's own
``--report`` (``threads``, read inside it at the end) replaces the sampled
figures for it.  CPU is shown per GB of the blob each process received (the
seeder: per GB of the blob).  ``--cores K`` pins every process to CPUs
0..K-1 with ``taskset`` (``--cores 1,2,4,8``: every case for each K, a
K column in the table), so the defaults that follow the cores a process
may use (workers, I/O threads, lanes) follow K.  Prints medians with min-max over the repeats, and
the p2pw/raw ratio of each repeat's pair (median and spread).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TMPFS = "/dev/shm"
TIMEOUT = 300.0  # seconds one run may take before its processes are killed and the run counts as failed
TICK = os.sysconf("SC_CLK_TCK")


# ----- raw programs (run as ``line_rate.py --raw-* ...`` in their own processes) -------------------------

def _name(name: str) -> None:
    with open("/proc/thread-self/comm", "w") as f:
        f.write(name[:15])


def _listen() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def _recv_exact(sock: socket.socket, view) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def raw_sender(src: str, chunk: int, conns: int) -> None:
    """Serve ``src``: each of ``conns`` connections says which stripe (0..conns-1) it wants, and gets chunks
    ``stripe, stripe + conns, ...`` in order by ``sendfile``."""
    lst = _listen()
    print(lst.getsockname()[1], flush=True)
    total = os.path.getsize(src)
    fd = os.open(src, os.O_RDONLY)

    def serve(conn: socket.socket) -> None:
        _name("send")
        stripe = conn.recv(1)[0]
        for lo in range(stripe * chunk, total, conns * chunk):
            left, at = min(chunk, total - lo), lo
            while left:
                n = os.sendfile(conn.fileno(), fd, at, left)
                at, left = at + n, left - n
        conn.close()

    threads = []
    for _ in range(conns):
        conn, _ = lst.accept()
        threads.append(threading.Thread(target=serve, args=(conn,)))
        threads[-1].start()
    for t in threads:
        t.join()


def memory_backed(path: str) -> bool:
    from p2pweights.storage.cache import memory_backed  # (not imported by the raw programs until they need it)

    return memory_backed(path)


def _open_dest(path: str, total: int) -> tuple[int, int]:
    """(fd for buffered writes, fd for the aligned part: O_DIRECT where the filesystem takes it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, total)
    if memory_backed(os.path.dirname(path)):
        return fd, fd
    try:
        return fd, os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return fd, fd


def _write(fds: tuple[int, int], view, at: int) -> None:
    cut = len(view) // 4096 * 4096
    for fd, part, where in ((fds[1], view[:cut], at), (fds[0], view[cut:], at + cut)):
        while len(part):
            n = os.pwrite(fd, part, where)
            part, where = part[n:], where + n


def _receive(sock: socket.socket, fds, total: int, chunk: int, stripe: int, stripes: int, forward=None) -> None:
    """Receive chunks ``stripe, stripe + stripes, ...`` into one aligned buffer; write each (and forward it)."""
    buf = mmap.mmap(-1, chunk)
    view = memoryview(buf)
    for lo in range(stripe * chunk, total, stripes * chunk):
        part = view[:min(chunk, total - lo)]
        _recv_exact(sock, part)
        _write(fds, part, lo)
        if forward is not None:
            forward.sendall(part)
    view.release()


def raw_receiver(port: int, dest: str, total: int, chunk: int) -> None:
    """One hop: every chunk from the sender into ``dest``."""
    _name("recv")
    fds = _open_dest(dest, total)
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"\0")
    _receive(s, fds, total, chunk, 0, 1)
    os.fsync(fds[0])


def raw_relay(port: int, dest: str, total: int, chunk: int, stripe: int, listen: int, peer: int) -> None:
    """Stripe ``stripe`` from the sender (written and forwarded to the peer relay), the other from the peer."""
    _name("relay-main")
    fds = _open_dest(dest, total)
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(("127.0.0.1", listen))
    lst.listen(1)
    for _ in range(200):
        try:
            out = socket.create_connection(("127.0.0.1", peer))
            break
        except ConnectionRefusedError:
            time.sleep(0.01)
    else:
        raise ConnectionError("peer relay not listening")
    inp, _ = lst.accept()
    src = socket.create_connection(("127.0.0.1", port))
    src.sendall(bytes([stripe]))

    def from_peer() -> None:
        _name("relay-in")
        _receive(inp, fds, total, chunk, 1 - stripe, 2)

    t = threading.Thread(target=from_peer)
    t.start()
    _name("relay-fwd")
    _receive(src, fds, total, chunk, stripe, 2, forward=out)
    out.close()
    t.join()
    os.fsync(fds[0])


# ----- measuring ----------------------------------------------------------------------------------------

class Threads:
    """Samples the threads of every process it is given, every 20 ms: ``{pid: {tid: (comm, cpu seconds)}}``."""

    def __init__(self):
        self.seen: dict[int, dict[int, tuple[str, float]]] = {}
        self.pids: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def watch(self, pid: int) -> None:
        self.pids.append(pid)
        self.seen[pid] = {}

    def _run(self) -> None:
        while not self.stop.is_set():
            for pid in list(self.pids):
                self.sample(pid)
            time.sleep(0.02)

    def sample(self, pid: int) -> None:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
            except OSError:
                continue
            fields = rest.split()
            if fields[0] == "Z":
                continue
            self.seen[pid][int(tid)] = (head.partition("(")[2], (int(fields[11]) + int(fields[12])) / TICK)

    def mark(self, pid: int) -> dict[int, float]:
        """CPU seconds of ``pid``'s threads now (subtracted later: work before the timed part)."""
        self.sample(pid)
        return {tid: cpu for tid, (_, cpu) in self.seen[pid].items()}

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def roles(threads: dict[int, tuple[str, float]], pid: int, before: dict[int, float] | None = None) -> dict[str, float]:
    """CPU seconds of one process's sampled threads (less ``before``), by role (comm; the main thread is
    ``main``)."""
    out: dict[str, float] = {}
    for tid, (comm, cpu) in threads.items():
        cpu -= (before or {}).get(tid, 0.0)
        role = ("main" if tid == pid else "zmq_io" if comm.startswith("ZMQbg/IO") else
                "loop" if comm == "p2pw-loop" else "finisher" if comm == "p2pw-finish" else
                comm if not comm.startswith(("p2pw", "python")) else "other")
        out[role] = out.get(role, 0.0) + cpu
    return out


class Run:
    """Processes of one measured run: started, watched, all killed by PID at the end."""

    def __init__(self, pin: list[str], sampler: Threads):
        self.pin, self.sampler, self.procs = pin, sampler, []

    def start(self, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.pin + argv, **kw)
        self.procs.append(p)
        self.sampler.watch(p.pid)
        return p

    def finish(self, procs, started: float) -> float:
        """Seconds from ``started`` until the last of ``procs`` exited; RuntimeError unless each exited 0."""
        deadline = started + TIMEOUT
        ends = []
        for p in procs:
            try:
                rc = p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{p.args[-6:]} still running after {TIMEOUT:.0f} s") from None
            ends.append(time.monotonic())
            if rc != 0:
                err = p.stderr.read().decode()[-400:] if p.stderr else ""
                raise RuntimeError(f"{p.args[-6:]} exited {rc}: {err}")
        return max(ends) - started

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def p2pw_run(mode: str, src: str, dests: list[str], chunk: int, pin, sampler, tmp: str, extra=(),
             seed_extra=()) -> dict:
    run = Run(pin, sampler)
    py = [sys.executable, "-m", "p2pweights"]
    joins = len(dests)
    ready = os.path.join(tmp, "ready")
    try:
        seed = run.start(py + ["seed", src, "--host", "127.0.0.1", "--port", "0", "--chunk-size", str(chunk),
                               "--ready", ready, "--exit-after", str(joins), *seed_extra],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        while not os.path.exists(ready):
            if seed.poll() is not None:
                raise RuntimeError(f"the seeder exited {seed.returncode}: {seed.stderr.read().decode()[-400:]}")
            time.sleep(0.05)
        time.sleep(0.05)
        port = json.load(open(ready))["port"]
        reports = [os.path.join(tmp, f"join{k}.json") for k in range(joins)]
        before = sampler.mark(seed.pid)  # the seeder's hashing is not part of the run
        t0 = time.monotonic()
        procs = [run.start(py + ["join", "--parent", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--out", d,
                                 "-q", "--report", r, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for d, r in zip(dests, reports)]
        secs = run.finish(procs, t0)
        run.finish([seed], t0)
        docs = [json.load(open(r)) for r in reports]
    finally:
        run.kill()
        if os.path.exists(ready):
            os.remove(ready)
    procs_cpu = {"seeder": roles(sampler.seen[seed.pid], seed.pid, before)}
    for k, (p, doc) in enumerate(zip(procs, docs)):
        procs_cpu[f"join{k}"] = doc.get("threads") or roles(sampler.seen[p.pid], p.pid)
    return {"seconds": secs, "cpu": procs_cpu, "ring": [d.get("ring") for d in docs],
            "loop_us_per_chunk": [d.get("loop_us_per_chunk") for d in docs],
            "loop_passes_per_chunk": [d["loop_passes"] / d["received"] for d in docs
                                      if d.get("loop_passes") is not None and d.get("received")],
            "zmq_io_each": [d.get("zmq_io_each") for d in docs], "lane_chunks": [d.get("lane_chunks") for d in docs]}


def raw_run(mode: str, src: str, dests: list[str], chunk: int, pin, sampler) -> dict:
    run = Run(pin, sampler)
    me = [sys.executable, os.path.abspath(__file__)]
    total = os.path.getsize(src)
    try:
        sender = run.start(me + ["--raw-send", src, str(chunk), str(len(dests))], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
        port = int(sender.stdout.readline())
        before = sampler.mark(sender.pid)
        t0 = time.monotonic()
        if mode == "hop":
            procs = [run.start(me + ["--raw-recv", str(port), dests[0], str(total), str(chunk)],
                               stderr=subprocess.PIPE)]
        else:
            ports = _free_ports(2)
            procs = [run.start(me + ["--raw-relay", str(port), d, str(total), str(chunk), str(k), str(ports[k]),
                                     str(ports[1 - k])], stderr=subprocess.PIPE) for k, d in enumerate(dests)]
        secs = run.finish(procs, t0)
        run.finish([sender], t0)
    finally:
        run.kill()
    cpu = {"sender": roles(sampler.seen[sender.pid], sender.pid, before)}
    for k, p in enumerate(procs):
        cpu[f"{'recv' if mode == 'hop' else 'relay'}{k}"] = roles(sampler.seen[p.pid], p.pid)
    return {"seconds": secs, "cpu": cpu}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def make_source(path: str, total: int) -> None:
    """``total`` bytes: a 64 MiB random block repeated (each chunk is hashed by its index: repeats cost nothing)."""
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        left = total
        while left:
            n = f.write(block[:min(left, len(block))])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def check_copy(src: str, dest: str) -> None:
    """The copy holds the source's bytes (compared in 64 MiB pieces)."""
    if os.path.isdir(dest):
        dest = os.path.join(dest, os.path.basename(src))
    with open(src, "rb") as a, open(dest, "rb") as b:
        while True:
            x, y = a.read(64 << 20), b.read(64 << 20)
            if x != y:
                raise RuntimeError(f"{dest} differs from {src}")
            if not x:
                return


# ----- the table ----------------------------------------------------------------------------------------

def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]" if xs else "-"


def per_gb(runs: list[dict], total: int) -> dict[str, dict[str, str]]:
    """Median CPU seconds per GB of each process's threads by role, over the runs."""
    gb = total / 1e9
    out: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for proc, rs in r["cpu"].items():
            for role, cpu in rs.items():
                out.setdefault(proc, {}).setdefault(role, []).append(cpu / gb)
    return {proc: {role: f"{statistics.median(v):.3f}" for role, v in rs.items() if max(v) >= 0.005}
            for proc, rs in out.items()}


def summarise(case: dict, total: int, cores: int | None = None) -> list[str]:
    p, r = case["p2pw"], case["raw"]
    ps, rs = [x["seconds"] for x in p], [x["seconds"] for x in r]
    ratios = [a / b for a, b in zip(ps, rs)]
    lines = [f"| {'' if cores is None else f'{cores} | '}{case['size']} | {case['where']} | {case['mode']} | {spread(ps)} | {spread(rs)} | "
             f"{spread(ratios)} | {total / statistics.median(ps) / 1e9:.2f} | {total / statistics.median(rs) / 1e9:.2f} |"]
    loops = [u for x in p for u in x["loop_us_per_chunk"] if u is not None]
    passes = [u for x in p for u in x.get("loop_passes_per_chunk", ())]
    rings = [g for x in p for g in x.get("ring", []) if g]
    served = (f"; chunks served from ring slots {sum(g['sent_from_slots'] for g in rings)}, from the files "
              f"{sum(g['sent_from_files'] for g in rings)} (read back into slots "
              f"{sum(g.get('read_back', 0) for g in rings)}), most slots {max(g['slots'] for g in rings)}"
              if rings else "")
    cpu = {**per_gb(p, total), **per_gb(r, total)}
    io = [max(e) / (total / 1e9) for x in p for e in x.get("zmq_io_each") or () if e]  # each join's busiest
    lanes = [sum(1 for c in lc if c) for x in p for lc in x.get("lane_chunks") or () if lc]
    lines.append("    CPU s/GB by thread: " + "; ".join(
        f"{proc}: " + ", ".join(f"{k} {v}" for k, v in sorted(rs.items(), key=lambda kv: -float(kv[1])))
        for proc, rs in cpu.items()) + (f"; loop µs/chunk {spread(loops, '{:.0f}')}" if loops else "")
        + (f", loop passes per chunk {spread(passes, '{:.2f}')}" if passes else "") + served
        + (f"; a join's busiest zmq_io thread {spread(io, '{:.3f}')} CPU s/GB, lanes that carried chunks "
           f"{max(lanes)}" if io and lanes else ""))
    return lines


def run_cases(a, pin: list[str], k: int, sampler, text: str, total: int, where: str) -> list[dict]:
    """Every mode of one size and place, p2pw and raw alternating ``a.repeat`` times; each case's rows printed."""
    cases = []
    base = TMPFS if where == "tmpfs" else a.disk_dir
    if where == "disk" and memory_backed(base):
        raise SystemExit(f"--disk-dir {base} is in memory")
    tmp = tempfile.mkdtemp(prefix="p2pw-line-rate-", dir=base)
    try:
        src = os.path.join(tmp, "model.bin")
        make_source(src, total)
        for mode in a.modes.split(","):
            case = {"cores": k, "size": text, "where": where, "mode": mode, "p2pw": [], "raw": []}
            joins = 1 if mode == "hop" else 2
            for n in range(a.repeat):
                for who in (("p2pw", "raw") if n % 2 == 0 else ("raw", "p2pw")):
                    dests = [os.path.join(tmp, f"out{j}") for j in range(joins)]
                    if who == "raw":
                        dests = [d + ".bin" for d in dests]
                        case[who].append(raw_run(mode, src, dests, a.chunk_size, pin, sampler))
                    else:
                        case[who].append(p2pw_run(mode, src, dests, a.chunk_size, pin, sampler, tmp,
                                                  a.join_args.split(), a.seed_args.split()))
                    for d in dests:
                        if not a.no_check:
                            check_copy(src, d)
                        shutil.rmtree(d) if os.path.isdir(d) else os.remove(d)
            cases.append(case)
            print("\n".join(summarise(case, total, k if a.cores else None)), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cases


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1].startswith("--raw-"):
        kind, args = sys.argv[1], sys.argv[2:]
        if kind == "--raw-send":
            raw_sender(args[0], int(args[1]), int(args[2]))
        elif kind == "--raw-recv":
            raw_receiver(int(args[0]), args[1], int(args[2]), int(args[3]))
        else:
            raw_relay(int(args[0]), args[1], int(args[2]), int(args[3]), *map(int, args[4:]))
        return 0
    from p2pweights.cli import size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1GiB", help="blob sizes, comma-separated (default 1GiB; the issue's 1GiB,3GiB "
                    "take about 4 minutes at repeat 3 on a 2-core VM)")
    ap.add_argument("--where", default="disk,tmpfs", help="disk, tmpfs or both")
    ap.add_argument("--modes", default="hop,relay", help="hop, relay or both")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cores", default="", metavar="K[,K...]",
                    help="pin every process to CPUs 0..K-1 (taskset); a list (1,2,4,8) runs every case for each K")
    ap.add_argument("--chunk-size", type=size, default=4 << 20)
    ap.add_argument("--disk-dir", default="/var/tmp", help="a directory on disk (not tmpfs) for the disk runs")
    ap.add_argument("--no-check", action="store_true", help="skip comparing each copy with the source")
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--join-args", default="", help="more flags for every p2pw join, e.g. '--io-threads 2 --lanes 2'")
    ap.add_argument("--seed-args", default="", help="more flags for the p2pw seeder, e.g. '--io-threads 2'")
    a = ap.parse_args()
    sampler = Threads()
    cases = []
    cores = [int(k) for k in a.cores.split(",")] if a.cores else [0]
    print(f"# {os.cpu_count()} CPUs{f', each process pinned to the first K: K = {a.cores}' if a.cores else ''}; "
          f"{os.uname().release}; chunk {a.chunk_size >> 20} MiB; medians [min-max] of {a.repeat}", flush=True)
    print(f"| {'K | ' if a.cores else ''}size | where | mode | p2pw s | raw s | p2pw/raw | p2pw GB/s | raw GB/s |")
    print(f"| {'--- | ' if a.cores else ''}--- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    try:
        for k in cores:
            pin = ["taskset", "-c", f"0-{k - 1}"] if k else []
            for text in a.sizes.split(","):
                total = size(text)
                for where in a.where.split(","):
                    cases += run_cases(a, pin, k, sampler, text, total, where)
    finally:
        sampler.close()
        if a.json:
            with open(a.json, "w") as f:
                json.dump(cases, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
