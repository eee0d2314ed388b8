"""One timed broadcast on the emulated hosts, timed the way a user waits for it.

A run starts the seeder in host 0 and waits until it serves (not timed: the
seeder is up before anyone joins), then launches one receiver process per peer
host at once (``p2pw join --out DIR`` or a libtorrent leecher, ``bt_peer.py``)
and times from just before the first launch to the last receiver's exit with
status 0: interpreter start and imports, connecting, the transfer, the files
on disk, and staying while others still depend on it.  Per host it keeps the
exit time, the exit status and the CPU seconds (``os.wait4`` rusage), and the
receiver's own ``--report`` (started / first chunk / done, wall clock, turned
into seconds since the launch).

With ``kill=True`` one receiver gets SIGKILL at a third of the transfer: the
live receiver that has uploaded the most so far (an interior peer when the
plan has any; every leecher uploads under BitTorrent), once it has received
S/3 bytes (its host's kernel counters); the time is then the last survivor's
exit, and every survivor must still exit 0.

Every surviving copy is compared byte for byte with the source directory; a
difference raises ``CopyMismatch`` naming the host, file and offset.  All
processes run through the ``Testbed``, which ends them by PID on any exit.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "netbed"))

from testbed import Testbed, cpu_busy, cpu_times  # noqa: E402
from warm_join import JOIN_MODULES  # noqa: E402

_SCRIPT = Path(sys.executable).with_name("p2pw")  # the console script, as a user runs it (``-m`` also
#   imports runpy: about 5 % of a join's start-up CPU, eight times over on two cores)
P2PW = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "p2pweights"]
BT_PEER = [sys.executable, str(ROOT / "bench" / "bt_peer.py")]
WARM_JOIN = [sys.executable, str(ROOT / "bench" / "warm_join.py")]  # ``warm=True``: started before the clock
WARM_SETTLE = 0.5  # seconds between the last warm join ready and the go, for the cores to go quiet
P2PW_PORT, BT_PORT = 7420, 6881
POLL = 0.01        # seconds between exit checks
KILL_POLL = 0.1    # seconds between counter reads while waiting to kill


class RunFailed(RuntimeError):
    """A run did not complete: a receiver failed or timed out, or the seeder did not start."""


class CopyMismatch(RunFailed):
    """A receiver exited 0 but its copy differs from the source."""


def source_files(model: str) -> dict[str, int]:
    """{relative path: size} of every file under the checkpoint directory."""
    root = Path(model)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def compare_copy(model: str, copy_root: str, host: int, block: int = 8 << 20) -> None:
    """Raise CopyMismatch unless every source file exists under copy_root with the same bytes."""
    for rel, size in source_files(model).items():
        dst = Path(copy_root) / rel
        if not dst.is_file():
            raise CopyMismatch(f"host {host}: {rel} missing from its copy {copy_root}")
        if dst.stat().st_size != size:
            raise CopyMismatch(f"host {host}: {rel} is {dst.stat().st_size} bytes, the source {size}")
        with open(Path(model) / rel, "rb") as a, open(dst, "rb") as b:
            off = 0
            while True:
                x, y = a.read(block), b.read(block)
                if x != y:
                    k = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), min(len(x), len(y)))
                    raise CopyMismatch(f"host {host}: {rel} differs from the source at byte {off + k}")
                if not x:
                    break
                off += len(x)


@dataclass
class Receiver:
    """One launched receiver: its host, process, log, report file and where its copy lands."""
    host: int
    proc: subprocess.Popen
    log: Path
    report: Path
    copy_root: Path
    exit_s: float | None = None
    rc: int | None = None
    arrive_s: float = 0.0  # launched this long after the first receiver (``arrivals``)
    cpu: float = 0.0


@dataclass
class Killer:
    """Decides when to SIGKILL whom: the busiest live uploader, once it has received S/3."""
    size: int
    base: dict = field(default_factory=dict)  # counters at launch
    host: int | None = None
    at_s: float | None = None
    rx: int = 0

    def pick(self, counters: dict, live: list[int]) -> int | None:
        if not live:
            return None
        sent = {h: counters[h][0] - self.base[h][0] for h in live}
        victim = max(live, key=lambda h: (sent[h], -h))
        got = counters[victim][1] - self.base[victim][1]
        return victim if got >= self.size / 3 else None


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def _reap(p: subprocess.Popen) -> tuple[int, float] | None:
    """(exit code, user+sys CPU seconds) if p has exited, else None; reaps it."""
    try:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
    except ChildProcessError:  # already reaped (the testbed's teardown on a signal)
        return (p.returncode if p.returncode is not None else -signal.SIGKILL), 0.0
    if not pid:
        return None
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, ru.ru_utime + ru.ru_stime


def _stop(p: subprocess.Popen, timeout: float = 30) -> tuple[int, float]:
    """SIGTERM p if it still runs, wait for it (SIGKILL after timeout); (exit code, CPU seconds)."""
    got = _reap(p) if p.returncode is None else (p.returncode, 0.0)
    if got:
        return got
    p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _reap(p)
        if got:
            return got
        time.sleep(0.02)
    p.kill()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    except ChildProcessError:
        return (p.returncode if p.returncode is not None else -signal.SIGKILL), 0.0
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, ru.ru_utime + ru.ru_stime


def _start_seeder(tb: Testbed, argv: list[str], ready: Path, log: Path, timeout: float = 120):
    with open(log, "wb") as f:
        p = tb.popen(0, argv, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not ready.exists() or not ready.stat().st_size:
        if p.returncode is not None or _reap(p):
            raise RunFailed(f"seeder exited {p.returncode} before serving: {_tail(log)}")
        if time.monotonic() > deadline:
            _stop(p, 5)
            raise RunFailed(f"seeder not serving after {timeout:.0f} s: {_tail(log)}")
        time.sleep(0.02)
    time.sleep(0.05)  # the ready file is written; let the writer close it
    return p


def _launch(tb: Testbed, h: int, work: Path, tag: str, receivers_argv, copy_root, **popen) -> Receiver:
    """Host ``h``'s receiver, its output to ``TAG.hH.log``, its report to ``TAG.hH.json``."""
    log, report = work / f"{tag}.h{h}.log", work / f"{tag}.h{h}.json"
    with open(log, "wb") as f:
        p = tb.popen(h, receivers_argv(h, report), stdout=f, stderr=subprocess.STDOUT, **popen)
    return Receiver(h, p, log, report, copy_root(h))


def _launch_warm(tb: Testbed, n: int, work: Path, tag: str, receivers_argv, copy_root, timeout: float = 60):
    """Hosts 1..n's ``warm_join.py`` receivers, started and imported, each blocked until its go."""
    receivers = [_launch(tb, h, work, tag, receivers_argv, copy_root, stdin=subprocess.PIPE,
                         env={**os.environ, "P2PW_WARM_READY": str(work / f"{tag}.h{h}.ready")})
                 for h in range(1, n + 1)]
    deadline = time.monotonic() + timeout
    for r in receivers:
        ready = work / f"{tag}.h{r.host}.ready"
        while not ready.exists():
            if _reap(r.proc) or time.monotonic() > deadline:
                for other in receivers:
                    _stop(other.proc, 5)
                raise RunFailed(f"warm join on host {r.host} never got ready: {_tail(r.log)}")
            time.sleep(0.02)
    time.sleep(WARM_SETTLE)
    return receivers


def _timed(tb: Testbed, model: str, n: int, work: Path, tag: str, seeder, receivers_argv, copy_root,
           kill: bool, timeout: float, on_kill=None, warm: bool = False, arrivals: dict | None = None) -> dict:
    """Launch hosts 1..n's receivers, wait for them (killing one if asked), verify, measure.

    ``warm``: the receivers are ``warm_join.py`` processes, launched and imported before the clock
    starts, which starts as each is given its go.  ``arrivals``: {host: seconds after the clock starts}
    to launch each receiver (late arrivals; hosts not named at once)."""
    size = sum(source_files(model).values())
    killer = Killer(size) if kill else None
    receivers = _launch_warm(tb, n, work, tag, receivers_argv, copy_root) if warm else []
    c0 = tb.counters()
    if killer:
        killer.base = c0
    busy0 = cpu_times()
    t0 = time.monotonic()
    wall0 = time.time()
    for r in receivers:
        r.proc.stdin.write(b"g")
        r.proc.stdin.close()
    pending = [] if warm else sorted(range(1, n + 1), key=lambda h: ((arrivals or {}).get(h, 0.0), h))
    next_counters = t0
    try:
        while True:
            while pending and time.monotonic() - t0 >= (arrivals or {}).get(pending[0], 0.0):
                receivers.append(_launch(tb, pending.pop(0), work, tag, receivers_argv, copy_root))
                receivers[-1].arrive_s = time.monotonic() - t0
            live = [r for r in receivers if r.rc is None]
            for r in live:
                got = _reap(r.proc)
                if got:
                    r.exit_s, (r.rc, r.cpu) = time.monotonic() - t0, got
                    if r.rc != 0 and not (killer and r.host == killer.host):
                        raise RunFailed(f"host {r.host} exited {r.rc} after {r.exit_s:.1f} s: {_tail(r.log)}")
            live = [r for r in receivers if r.rc is None]
            if not live and not pending:
                break
            now = time.monotonic()
            if now - t0 > timeout:
                killed = f" (h{killer.host} killed at {killer.at_s:.1f} s)" if killer and killer.host else ""
                raise RunFailed(f"hosts {[r.host for r in live]} still running after {timeout:.0f} s{killed}: "
                                f"{_tail(live[0].log) if live else ''}")
            if killer and killer.host is None and now >= next_counters:
                next_counters = now + KILL_POLL
                counters = tb.counters()
                victim = killer.pick(counters, [r.host for r in live])
                if victim is not None:
                    r = next(r for r in receivers if r.host == victim)
                    r.proc.send_signal(signal.SIGKILL)
                    killer.host, killer.at_s = victim, time.monotonic() - t0
                    killer.rx = counters[victim][1] - c0[victim][1]
                    if on_kill:
                        on_kill(victim)
            time.sleep(POLL)
        c1 = tb.counters()
        busy = cpu_busy(busy0, cpu_times())
    finally:
        for r in receivers:
            if r.rc is None:
                r.rc, r.cpu = _stop(r.proc, 5)
        seed_rc, seed_cpu = _stop(seeder)
    if kill and killer.host is None:
        raise RunFailed("the kill never fired: every receiver finished before receiving S/3")
    survivors = [r for r in receivers if not (killer and r.host == killer.host)]
    for r in survivors:
        compare_copy(model, str(r.copy_root), r.host)
    reports = {}
    for r in survivors:
        try:
            doc = json.loads(r.report.read_text())
        except (OSError, ValueError):
            continue
        reports[r.host] = {**doc, **{k: doc[k] - wall0 for k in ("started_at", "first_chunk_at", "done_at")
                                     if isinstance(doc.get(k), (int, float))}}
    return {
        "n": n, "size": size, "rates": {h: tb.rate_of(h) for h in range(tb.hosts)},
        "time": max(r.exit_s for r in survivors),
        "exits": {r.host: r.exit_s for r in survivors},
        "arrivals": {r.host: r.arrive_s for r in survivors},
        "cpu": {r.host: r.cpu for r in survivors},
        "seed_cpu": seed_cpu, "seed_rc": seed_rc,
        "seed_tx": c1[0][0] - c0[0][0],
        "host_tx": {h: c1[h][0] - c0[h][0] for h in range(tb.hosts)},
        "busy": sum(busy) / len(busy),
        "reports": reports,
        "killed": None if not killer else {"host": killer.host, "at_s": killer.at_s, "rx": killer.rx},
        "receivers": receivers,
        "wall0": wall0,
    }


def _cleanup(paths) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def compile_package() -> None:
    """Byte-compile the package, as ``pip install`` does: an interpreter started with
    PYTHONDONTWRITEBYTECODE (this sandbox sets it) would otherwise compile every module at every
    launch, about 0.15 CPU s per process that no installed copy pays."""
    import compileall
    compileall.compile_dir(str(ROOT / "p2pweights"), quiet=1)


def start_cost(n: int, repeats: int = 3) -> tuple[float, float]:
    """Seconds from launching ``n`` interpreters that import what a join imports (the CLI, ``api`` with
    pyzmq) at once to the last one's exit, and one alone: medians of ``repeats``.  The part of a cold
    run's start that is this machine's cores this hour, not the data plane (``--warm`` measures it
    inside a run)."""
    compile_package()
    imports = "import " + ", ".join(JOIN_MODULES)  # what a warm join imports before the go

    def once(k: int) -> float:
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, "-c", imports], cwd=ROOT) for _ in range(k)]
        for p in procs:
            if p.wait() != 0:
                raise RunFailed(f"{sys.executable} -c {imports!r} exited {p.returncode}")
        return time.monotonic() - t0

    return statistics.median(once(1) for _ in range(repeats)), statistics.median(once(n) for _ in range(repeats))


def run_p2pw(tb: Testbed, model: str, n: int, work: str, *, plan: str | None = None, chunk: int | None = None,
             kill: bool = False, timeout: float = 300, keep: bool = False, trace: bool = False,
             warm: bool = False, arrivals: dict | None = None) -> dict:
    """p2pw: ``p2pw seed`` in host 0, ``p2pw join --parent H0 --out DIR --report F -q`` in hosts 1..n.

    ``plan`` None: the seeder's default (no --topology); ``chunk`` None: its default chunk size;
    ``trace``: the joins add each verified chunk to their reports (``--trace``, for ``bench/trace.py``);
    ``warm``: the joins start and import before the clock (``warm_join.py``), a diagnostic of the bed.
    """
    compile_package()
    work = Path(work)
    tag = f"p2pw-{(plan or 'default').replace(':', '')}-{time.monotonic_ns()}"
    ready, seed_report, seed_log = work / f"{tag}.ready", work / f"{tag}.seed.json", work / f"{tag}.seed.log"
    argv = [*P2PW, "seed", model, "--port", str(P2PW_PORT), "--ready", str(ready), "--report", str(seed_report)]
    if plan:
        argv += ["--topology", plan]
    if chunk:
        argv += ["--chunk-size", str(chunk)]
    argv += ["--log-format", "json"]  # millisecond timestamps, for ``seed_events`` (demotions)
    outs = {h: work / f"{tag}.out{h}" for h in range(1, n + 1)}
    parent = f"{tb.addr(0)}:{P2PW_PORT}"
    try:
        seeder = _start_seeder(tb, argv, ready, seed_log)
        r = _timed(tb, model, n, work, tag, seeder,
                   lambda h, rep: [*(WARM_JOIN if warm else P2PW), "join", "--parent", parent, "--out",
                                   str(outs[h]), "--report", str(rep), "-q", *(["--trace"] if trace else [])],
                   lambda h: outs[h], kill, timeout, warm=warm, arrivals=arrivals)
    finally:
        if not keep:
            _cleanup(outs.values())
    try:
        doc = json.loads(seed_report.read_text())
        r["settled"] = {int(k): m["parents"] for k, m in doc.get("peers", {}).items()}
        r["seed_bytes_sent"] = doc.get("bytes_sent")
    except (OSError, ValueError):
        r["settled"] = {}
    r["blob_size"] = json.loads(ready.read_text()).get("total_size")
    r["seed_events"] = seed_events(seed_log, r["wall0"])
    r["demoted"] = demotions(r["seed_events"], {doc.get("rank"): h for h, doc in r["reports"].items()})
    r.update(tool="p2pw", plan=plan or "default", warm=warm)
    r.pop("receivers")
    return r


def make_torrent(model: str, out: str, piece_size: int) -> dict:
    """Write the .torrent of the checkpoint (bt_peer.py torrent); returns its description."""
    cp = subprocess.run([*BT_PEER, "torrent", model, "-o", out, "--piece-size", str(piece_size)],
                        capture_output=True, text=True)
    if cp.returncode != 0:
        raise RunFailed(f"making the torrent failed: {cp.stderr.strip()[-1500:]}")
    return json.loads(cp.stdout.strip().splitlines()[-1])


def seed_events(seed_log: Path, wall0: float) -> list[tuple[float, str]]:
    """The seeder's log lines (``--log-format json``) as (seconds since launch, message): placements,
    demotions, re-placements, what ``bench/trace.py`` lists beside the chunks."""
    out = []
    try:
        lines = seed_log.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            doc = json.loads(line)
            ts = datetime.fromisoformat(doc["ts"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        out.append((round(ts - wall0, 3), doc.get("message", "")))
    return out


def demotions(events: list[tuple[float, str]], host_of: dict) -> list[tuple[int | None, float]]:
    """(host, seconds since launch) of each peer the tracker made a leaf (a probe or a review found its
    uplink slow), from ``seed_events``; ``host_of`` maps ranks to hosts (None: a rank no report names)."""
    out = []
    for at, message in events:
        m = re.match(r"peer rank (\d+) .*becomes a leaf", message)
        if m:
            out.append((host_of.get(int(m.group(1))), at))
    return out


def run_libtorrent(tb: Testbed, model: str, torrent: str, n: int, work: str, *, kill: bool = False,
                   utp: bool = False, timeout: float = 300, keep: bool = False, arrivals: dict | None = None) -> dict:
    """libtorrent: a seeder in host 0, one leecher per host 1..n, each told every other host's address."""
    work = Path(work)
    tag = f"bt-{time.monotonic_ns()}"
    ready, seed_log, done = work / f"{tag}.ready", work / f"{tag}.seed.log", work / f"{tag}.done"
    done.mkdir()
    name = Path(model).resolve().name
    extra = ["--utp"] if utp else []
    argv = [*BT_PEER, "seed", torrent, model, "--listen", f"{tb.addr(0)}:{BT_PORT}", "--ready", str(ready),
            "--done-dir", str(done), "--expect", str(n), *extra]
    outs = {h: work / f"{tag}.out{h}" for h in range(1, n + 1)}

    def leech(h, rep):
        peers = ",".join(f"{tb.addr(i)}:{BT_PORT}" for i in range(n + 1) if i != h)
        return [*BT_PEER, "leech", torrent, "--out", str(outs[h]), "--listen", f"{tb.addr(h)}:{BT_PORT}",
                "--peers", peers, "--done-dir", str(done), "--expect", str(n), "--name", f"h{h}",
                "--report", str(rep), *extra]

    try:
        seeder = _start_seeder(tb, argv, ready, seed_log)
        r = _timed(tb, model, n, work, tag, seeder, leech, lambda h: outs[h] / name, kill, timeout,
                   on_kill=lambda h: (done / f"h{h}.gone").write_text(""), arrivals=arrivals)
    finally:
        if not keep:
            _cleanup([*outs.values(), done])
    r.update(tool="libtorrent", plan="bt-tcp" if not utp else "bt-utp")
    r.pop("receivers")
    return r
