"""Emulated hosts for benchmarks: network namespaces on a bridge, uplinks capped.

This module owns the life of one testbed: the namespaces it creates, the
processes it starts inside them, and their removal.

Layout of ``Testbed(hosts=n, rate_mbit=R, rates={i: R_i})`` with run id ``abc123``::

    p2pwnb-abc123-sw        the "switch": a namespace holding bridge br0
      br0 -- p0 ... p{n-1}  switch-side veth ends, enslaved to br0 (uncapped)
    p2pwnb-abc123-h{i}      host i: lo up, eth0 = 10.77.0.{i+1}/24, the peer
                            of p{i}; eth0 egress is htb class 1:1 at
                            rate=ceil=R_i (the host's uplink: R unless
                            ``rates`` names host i), shared fairly by one
                            child class per destination host (below); the
                            route sets congctl cubic

Per-destination fairness (``fair=True``, the default). Every Linux host
queues its egress per flow (fq_codel is the default qdisc; fq where BBR is
used), so two flows leaving one host share its uplink. This kernel has no
fq_codel, fq, sfq or drr, and one FIFO under the cap is not what a host does:
with TCP small queues, a flow that starts behind another's standing queue is
allowed only a couple of packets in that FIFO at a time, never becomes
cwnd-limited, so its window never grows, and it runs at a few percent of the
uplink for seconds (seen at 100 Mbit/s: a seeder's second flow at cwnd 12,
4 packets in flight, 40 KB not sent, while the first held cwnd 734). So
under 1:1 each other host j gets its own class 1:{100+j:x} (rate R_i/hosts,
ceil R_i, equal quanta: htb shares the cap round-robin among the busy ones)
with its own FIFO, chosen by a u32 match on the destination address;
anything else takes 1:10. Peers hold about one connection per pair, so per
destination is per flow here. ``fair=False`` gives the single FIFO.

Per-destination ceilings (``dest_ceils={i: C}``): host i's class for each
destination gets ceil C Mbit/s instead of R_i (rate min(R_i/hosts, C)), so no
one destination takes more than C of host i's uplink while all of them
together may take R_i: an object store's throughput per client, below what
its NIC and a client's NIC could carry.  Read back with ``class_ceil(i, j)``.

A host's cap can be changed while the testbed runs (``set_rate(i, mbit)``,
``set_rates({i: mbit})``: an in-place ``tc class change``) and read back from
the kernel (``class_rate(i)``, bits/s as ``tc`` reports it).

The root namespace is never modified: veth pairs are created inside the
switch namespace and their peers moved straight into the host namespace.
Teardown (``__exit__``, ``close()``, atexit, SIGINT/SIGTERM) kills the
processes this testbed started, by PID, then deletes only the namespaces this
run created; deleting any other name raises ``ForeignNamespaceError``.

The kernel this was written against has htb/tbf/pfifo/bfifo only: asking for
``latency_ms > 0`` tries netem and raises ``NetemUnavailable`` if the kernel
lacks it. TCP goodput through an htb cap is about 0.956 x rate on a 1500-byte
MTU (the cap counts frame bytes: 1448 payload bytes per 1514-byte frame).
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PREFIX = "p2pwnb-"
FLOW_SCRIPT = str(Path(__file__).resolve().with_name("flow.py"))
TCP_GOODPUT_FRACTION = 1448 / 1514  # payload bytes per frame byte at MTU 1500


class TestbedError(RuntimeError):
    """A namespace, link or qdisc could not be set up or torn down."""


class NetemUnavailable(TestbedError):
    """latency_ms > 0 was asked for but this kernel has no netem qdisc."""


class ForeignNamespaceError(TestbedError):
    """Refused to delete a namespace this testbed run did not create."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cp = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and cp.returncode != 0:
        raise TestbedError(f"ip {' '.join(args)}: {cp.stderr.strip() or cp.returncode}")
    return cp


def list_netns() -> list[str]:
    """Names of all network namespaces known to `ip netns`."""
    cp = _ip("netns", "list", check=False)
    return [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]


# Live testbeds, torn down by atexit and by the signal handlers.
_live: list["Testbed"] = []
_live_lock = threading.RLock()
_prev_handlers: dict[int, object] = {}


def _teardown_live() -> None:
    with _live_lock:
        beds = list(_live)
    for tb in beds:
        try:
            tb.close()
        except Exception as exc:  # keep going: remove what we can
            print(f"netbed: teardown of {tb.run_id} failed: {exc}", file=sys.stderr)


def _on_signal(signum, frame):
    prev = _prev_handlers.get(signum, signal.SIG_DFL)  # before teardown: the last close() restores them
    _teardown_live()
    if callable(prev):
        return prev(signum, frame)
    if prev == signal.SIG_IGN:
        return None
    # SIG_DFL: die of the same signal, as the process would have.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _register(tb: "Testbed") -> None:
    with _live_lock:
        if not _live and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                _prev_handlers[sig] = signal.getsignal(sig)
                signal.signal(sig, _on_signal)
        _live.append(tb)


def _unregister(tb: "Testbed") -> None:
    with _live_lock:
        if tb in _live:
            _live.remove(tb)
        if not _live and _prev_handlers and threading.current_thread() is threading.main_thread():
            for sig, prev in _prev_handlers.items():
                signal.signal(sig, prev)
            _prev_handlers.clear()


atexit.register(_teardown_live)


def cpu_plan(hosts: int, per_host: int | None = None, cores: list[int] | None = None) -> dict[int, list[int]]:
    """Host -> the cores its processes are pinned to, ``per_host`` each (None: as many as fit, at least one),
    one core left over for the bench itself; {} (every host shares every core) where they do not fit.  Real
    hosts do not share CPUs: on this 2-core VM eight joins starting at once take 0.25-0.4 s of a run's
    start that hosts with cores of their own would not."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    fit = (len(cores) - 1) // hosts if hosts > 0 else 0
    k = fit if per_host is None else per_host
    if k < 1 or k > fit:
        return {}
    return {i: cores[1 + i * k: 1 + (i + 1) * k] for i in range(hosts)}


class Testbed:
    """``hosts`` emulated hosts on one bridge, each uplink capped at ``rate_mbit``.

    ``rates`` ({host index: Mbit/s}) gives some hosts their own uplink cap; ``cpus`` ({host index: [core,
    ...]}, ``cpu_plan``) pins what a host runs to cores of its own; ``dest_ceils`` ({host index: Mbit/s})
    caps what each destination may take of that host's uplink.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        hosts: int,
        rate_mbit: float = 400,
        latency_ms: float = 0,
        subnet: str = "10.77.0.0/24",
        congctl: str = "cubic",
        rates: dict[int, float] | None = None,
        fair: bool = True,
        cpus: dict[int, list[int]] | None = None,
        dest_ceils: dict[int, float] | None = None,
    ):
        net = ipaddress.ip_network(subnet)
        if hosts < 1 or hosts > net.num_addresses - 2:
            raise ValueError(f"hosts={hosts} does not fit in {subnet}")
        if rate_mbit <= 0:
            raise ValueError("rate_mbit must be > 0")
        self.hosts = hosts
        self.rate_mbit = float(rate_mbit)
        self.rates: dict[int, float] = {}  # hosts whose cap differs from rate_mbit
        for i, r in (rates or {}).items():
            if not 0 <= i < hosts:
                raise ValueError(f"rates names host {i}, not in 0..{hosts - 1}")
            if r <= 0:
                raise ValueError(f"rate of host {i} must be > 0")
            self.rates[int(i)] = float(r)
        self.dest_ceils: dict[int, float] = {}  # host -> ceil of each of its per-destination classes
        for i, c in (dest_ceils or {}).items():
            if not 0 <= i < hosts or c <= 0:
                raise ValueError(f"dest_ceils: host {i} not in 0..{hosts - 1} or ceil {c} not > 0")
            if not fair:
                raise ValueError("dest_ceils needs fair=True (a class per destination)")
            self.dest_ceils[int(i)] = float(c)
        self.latency_ms = float(latency_ms)
        self.congctl = congctl
        self.fair = bool(fair)
        self.cpus = {int(i): sorted(c) for i, c in (cpus or {}).items() if c}  # host -> the cores its processes
        #   run on (``cpu_plan``): each emulated host's CPUs its own, as on real hosts; none: all share the machine's
        self._net = net
        self.run_id = secrets.token_hex(3)
        self.switch_ns = f"{PREFIX}{self.run_id}-sw"
        self._created: list[str] = []  # namespaces this run made, in order
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._closing = threading.Lock()

    # -- names and addresses -------------------------------------------------

    def ns(self, i: int) -> str:
        """Namespace name of host i."""
        if not 0 <= i < self.hosts:
            raise IndexError(f"host {i} not in 0..{self.hosts - 1}")
        return f"{PREFIX}{self.run_id}-h{i}"

    def addr(self, i: int) -> str:
        """IPv4 address of host i's eth0 (10.77.0.{i+1} by default)."""
        self.ns(i)
        return str(self._net.network_address + i + 1)

    def rate_of(self, i: int) -> float:
        """Configured uplink cap of host i, Mbit/s."""
        self.ns(i)
        return self.rates.get(i, self.rate_mbit)

    @property
    def namespaces(self) -> list[str]:
        """Namespaces created so far by this run (and not yet deleted)."""
        return list(self._created)

    # -- availability --------------------------------------------------------

    @staticmethod
    def available() -> tuple[bool, str]:
        """(True, "") if namespaces can be made here, else (False, why not)."""
        if sys.platform != "linux":
            return False, f"needs Linux, this is {sys.platform}"
        if os.geteuid() != 0:
            return False, "needs root to create network namespaces"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"`{tool}` (iproute2) not found"
        trial = f"{PREFIX}{secrets.token_hex(3)}-trial"
        cp = _ip("netns", "add", trial, check=False)
        if cp.returncode != 0:
            return False, f"`ip netns add` failed: {cp.stderr.strip()}"
        cp = _ip("netns", "del", trial, check=False)
        if cp.returncode != 0:
            return False, f"`ip netns del {trial}` failed: {cp.stderr.strip()}"
        return True, ""

    # -- setup ---------------------------------------------------------------

    def __enter__(self) -> "Testbed":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> "Testbed":
        """Create the switch and host namespaces, links, addresses and caps."""
        if self._created or self._closed:
            raise TestbedError("a Testbed is opened once")
        _register(self)
        try:
            existing = set(list_netns())
            if any(n.startswith(f"{PREFIX}{self.run_id}-") for n in existing):
                raise TestbedError(f"run id {self.run_id} already in use")
            self._add_ns(self.switch_ns)
            sw = self.switch_ns
            _ip("-n", sw, "link", "set", "lo", "up")
            _ip("-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0",
                "forward_delay", "0")
            _ip("-n", sw, "link", "set", "br0", "up")
            for i in range(self.hosts):
                self._add_host(i)
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        # No IPv6: keeps router solicitations etc. out of the tx byte counts.
        for key in ("all", "default"):
            self._sysctl(name, f"net/ipv6/conf/{key}/disable_ipv6", "1")

    @staticmethod
    def _sysctl(ns: str, key: str, value: str) -> None:
        cp = subprocess.run(
            ["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > /proc/sys/{key}"],
            capture_output=True, text=True)
        if cp.returncode != 0:
            raise TestbedError(f"sysctl {key}={value} in {ns}: {cp.stderr.strip()}")

    def _add_host(self, i: int) -> None:
        ns, sw = self.ns(i), self.switch_ns
        self._add_ns(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", sw, "link", "set", f"p{i}", "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{self.addr(i)}/{self._net.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        # The kernel's connected route, replaced to carry the congestion control.
        _ip("-n", ns, "route", "replace", str(self._net), "dev", "eth0", "proto", "kernel",
            "scope", "link", "src", self.addr(i), "congctl", self.congctl)
        self._cap(i)

    @staticmethod
    def _htb_class(mbit: float, ceil_mbit: float | None = None) -> list[str]:
        """htb class parameters for a cap of ``mbit`` (ceil ``ceil_mbit``, else the
        same), with bursts and quantum sized from the ceil."""
        ceil_bps = (ceil_mbit or mbit) * 1e6
        # Burst: 1 ms at rate, but at least two 64 KiB GSO segments (veth does
        # GSO, so htb sees super-packets); quantum: one burst, so that sibling
        # classes share round-robin in equal turns.
        burst = max(int(ceil_bps / 8 / 1000), 2 * 65536 + 2 * 1514)
        quantum = min(200000, max(1514, burst))
        return ["htb", "rate", f"{int(mbit * 1e6)}bit", "ceil", f"{int(ceil_bps)}bit",
                "burst", str(burst), "cburst", str(burst), "quantum", str(quantum)]

    def _leaves(self, i: int) -> list[tuple[str, int | None]]:
        """Host i's leaf classes under 1:1: (classid, destination host or None)."""
        if not self.fair:
            return [("1:10", None)]
        return [("1:10", None)] + [(f"1:{0x100 + j:x}", j)
                                   for j in range(self.hosts) if j != i]

    def _shape(self, i: int, verb: str) -> None:
        """Add (``verb="add"``) or change the classes of host i's cap."""
        tc, r = ["tc", "-n", self.ns(i)], self.rate_of(i)
        self._run([*tc, "class", verb, "dev", "eth0", "parent", "1:", "classid", "1:1",
                   *self._htb_class(r)])
        leaves = self._leaves(i)
        for classid, dest in leaves:
            ceil = min(r, self.dest_ceils.get(i, r)) if dest is not None else r
            self._run([*tc, "class", verb, "dev", "eth0", "parent", "1:1", "classid",
                       classid, *self._htb_class(min(r / len(leaves), ceil), ceil)])

    def _cap(self, i: int) -> None:
        ns = self.ns(i)
        tc = ["tc", "-n", ns]
        self._run([*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb",
                   "default", "10"])
        self._shape(i, "add")
        for n, (classid, dest) in enumerate(self._leaves(i)):
            handle = f"{0x10 + n:x}:"
            if self.latency_ms > 0:
                cp = subprocess.run([*tc, "qdisc", "add", "dev", "eth0", "parent", classid,
                                     "handle", handle, "netem", "delay",
                                     f"{self.latency_ms}ms", "limit", "10000"],
                                    capture_output=True, text=True)
                if cp.returncode != 0:
                    raise NetemUnavailable(
                        f"latency_ms={self.latency_ms} needs the netem qdisc, which is not "
                        f"available on this kernel ({cp.stderr.strip()}); use latency_ms=0")
            else:
                self._run([*tc, "qdisc", "add", "dev", "eth0", "parent", classid, "handle",
                           handle, "pfifo", "limit", "1000"])
            if dest is not None:
                self._run([*tc, "filter", "add", "dev", "eth0", "parent", "1:", "protocol",
                           "ip", "prio", "1", "u32", "match", "ip", "dst",
                           f"{self.addr(dest)}/32", "flowid", classid])

    @staticmethod
    def _run(argv: list[str]) -> None:
        cp = subprocess.run(argv, capture_output=True, text=True)
        if cp.returncode != 0:
            raise TestbedError(f"{' '.join(argv)}: {cp.stderr.strip() or cp.returncode}")

    # -- use -------------------------------------------------------------------

    def set_rate(self, i: int, mbit: float | None) -> None:
        """Change host i's uplink cap now (None: back to ``rate_mbit``)."""
        if mbit is not None and mbit <= 0:
            raise ValueError(f"rate of host {i} must be > 0")
        self.ns(i)
        if mbit is None or float(mbit) == self.rate_mbit:
            self.rates.pop(i, None)
        else:
            self.rates[i] = float(mbit)
        self._shape(i, "change")

    def set_rates(self, rates: dict[int, float]) -> None:
        """Give the hosts in ``rates`` those caps and every other host ``rate_mbit``."""
        for i in range(self.hosts):
            want = rates.get(i)
            if self.rate_of(i) != (want or self.rate_mbit):
                self.set_rate(i, want)

    def class_rate(self, i: int) -> int:
        """Host i's uplink cap as the kernel holds it (htb class 1:1 rate, bits/s)."""
        return self._class_bits(i, "1:1", "rate")

    def class_ceil(self, i: int, j: int) -> int:
        """The ceil of host i's class for destination host j as the kernel holds it (bits/s)."""
        self.ns(j)
        return self._class_bits(i, f"1:{0x100 + j:x}", "ceil")

    def _class_bits(self, i: int, classid: str, field: str) -> int:
        """``field`` (rate, ceil) of htb class ``classid`` on host i's eth0, bits/s.

        Parsed from ``tc -s class show`` text (this iproute2 has no JSON for classes).
        """
        cp = subprocess.run(["tc", "-n", self.ns(i), "-s", "class", "show", "dev", "eth0"],
                            capture_output=True, text=True)
        if cp.returncode != 0:
            raise TestbedError(f"tc class show in {self.ns(i)}: {cp.stderr.strip()}")
        m = re.search(rf"class htb {classid} .*?\b{field} (\d+(?:\.\d+)?)([KMG]?)bit", cp.stdout)
        if m:
            return round(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])
        raise TestbedError(f"no htb class {classid} on {self.ns(i)} eth0")

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start argv inside host i's namespace; teardown kills it by PID.

        `ip netns exec` execs the command, so the returned PID is the command's.
        """
        if self._closed:
            raise TestbedError("testbed is closed")
        pin = ["taskset", "-c", ",".join(map(str, self.cpus[i]))] if i in self.cpus else []  # execs too
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *pin, *argv], **kw)
        self._procs.append(p)
        return p

    def tx_bytes(self, i: int) -> int:
        """Bytes host i's eth0 has transmitted (frame bytes, from the kernel)."""
        cp = _ip("-n", self.ns(i), "-j", "-s", "link", "show", "dev", "eth0")
        return int(json.loads(cp.stdout)[0]["stats64"]["tx"]["bytes"])

    def counters(self) -> dict[int, tuple[int, int]]:
        """{host: (bytes it transmitted, bytes it received)} for every host, in one call.

        Read from the switch side of each link (port p{i} receives what host i
        sends), so one ``ip`` process serves all hosts: cheap enough to poll.
        """
        cp = _ip("-n", self.switch_ns, "-j", "-s", "link", "show")
        out = {}
        for link in json.loads(cp.stdout):
            name = link.get("ifname", "")
            if name.startswith("p") and name[1:].isdigit():
                st = link["stats64"]
                out[int(name[1:])] = (int(st["rx"]["bytes"]), int(st["tx"]["bytes"]))
        return out

    def rx_bytes(self, i: int) -> int:
        """Bytes host i's eth0 has received."""
        cp = _ip("-n", self.ns(i), "-j", "-s", "link", "show", "dev", "eth0")
        return int(json.loads(cp.stdout)[0]["stats64"]["rx"]["bytes"])

    def cpu_seconds(self) -> float:
        """User+system CPU seconds of the processes this testbed started (live ones)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for p in self._procs:
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return total

    # -- teardown --------------------------------------------------------------

    def delete_netns(self, name: str) -> None:
        """Delete a namespace this run created; refuse any other name."""
        if name not in self._created:
            raise ForeignNamespaceError(
                f"refusing to delete namespace {name!r}: not created by testbed run "
                f"{self.run_id}")
        cp = _ip("netns", "del", name, check=False)
        if cp.returncode != 0 and name in list_netns():
            raise TestbedError(f"ip netns del {name}: {cp.stderr.strip()}")
        self._created.remove(name)

    def _kill_procs(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()

    def close(self) -> None:
        """Kill our processes, delete our namespaces (hosts, then switch). Idempotent."""
        if not self._closing.acquire(blocking=False):
            return  # a teardown is already running (e.g. signal during close)
        try:
            self._closed = True
            self._kill_procs()
            errors = []
            for name in reversed(list(self._created)):
                try:
                    self.delete_netns(name)
                except TestbedError as exc:
                    errors.append(str(exc))
            _unregister(self)
            if errors:
                raise TestbedError("; ".join(errors))
        finally:
            self._closing.release()


# -- capacity check -------------------------------------------------------------


def cpu_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies per CPU from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
            out.append((sum(v[:8]) - idle, sum(v[:8])))
    return out


def cpu_busy(before, after) -> list[float]:
    """Busy fraction per CPU between two cpu_times() samples."""
    return [(b1 - b0) / max(1, t1 - t0) for (b0, t0), (b1, t1) in zip(before, after)]


def flows(tb: Testbed, pairs: list[tuple[int, int]], seconds: float, port: int,
          stagger: float = 0.0) -> dict:
    """Run one TCP flow per (src, dst) pair; return aggregate goodput.

    With ``stagger`` > 0, flow k starts k * stagger seconds after the first and
    all of them end together (flow k sends for seconds - k * stagger), so a late
    flow's ``per_flow_mbit`` is what it got while sharing with the earlier ones.
    """
    if stagger * (len(pairs) - 1) >= seconds:
        raise ValueError("stagger leaves a flow no time to send")
    py = sys.executable
    recvs = []
    for k, (_, dst) in enumerate(pairs):
        r = tb.popen(dst, [py, FLOW_SCRIPT, "recv", tb.addr(dst), str(port + k)],
                     stdout=subprocess.PIPE, text=True)
        if r.stdout.readline().strip() != "ready":
            raise TestbedError(f"receiver on h{dst} did not start")
        recvs.append(r)
    tx0 = {src: tb.tx_bytes(src) for src, _ in pairs}
    cpu0 = cpu_times()
    sends = []
    for k, (src, dst) in enumerate(pairs):
        if k and stagger:
            time.sleep(stagger)
        sends.append(tb.popen(src, [py, FLOW_SCRIPT, "send", tb.addr(dst), str(port + k),
                                    str(seconds - k * stagger)],
                              stdout=subprocess.PIPE, text=True))
    results = []
    for r in recvs:
        out, _ = r.communicate(timeout=seconds + 60)
        results.append(json.loads(out.strip().splitlines()[-1]))
    cpu1 = cpu_times()
    for s in sends:
        s.communicate(timeout=30)
    tx1 = {src: tb.tx_bytes(src) for src, _ in pairs}
    total = sum(r["bytes"] for r in results)
    span = max(r["t_last"] for r in results) - min(r["t_first"] for r in results)
    busy = cpu_busy(cpu0, cpu1)
    return {
        "flows": len(pairs),
        "bytes": total,
        "seconds": span,
        "mbit": total * 8 / span / 1e6,
        "per_flow_mbit": [r["bytes"] * 8 / max(1e-9, r["t_last"] - r["t_first"]) / 1e6
                          for r in results],
        "tx_bytes": sum(tx1[s] - tx0[s] for s in tx0),
        "cpu_busy": busy,
    }


def check_cap(tb: Testbed, seconds: float = 2.0, port: int = 5201) -> dict:
    """Measure h0's capped uplink: one flow h0->h1, then two at once h0->h1, h0->h2.

    Returns {"rate_mbit", "expected_mbit", "single": {...}, "dual": {...} or None}
    where each run has "mbit" (TCP goodput, all flows together), "per_flow_mbit",
    "bytes", "seconds", "tx_bytes" (frame bytes h0 sent) and "cpu_busy" (per-CPU
    busy fraction over the run). Both runs should come near expected_mbit
    (about 0.956 x rate): the cap is per host, not per flow.
    """
    if tb.hosts < 2:
        raise ValueError("check_cap needs at least 2 hosts")
    out = {
        "rate_mbit": tb.rate_mbit,
        "expected_mbit": tb.rate_mbit * TCP_GOODPUT_FRACTION,
        "single": flows(tb, [(0, 1)], seconds, port),
        "dual": None,
    }
    if tb.hosts >= 3:
        out["dual"] = flows(tb, [(0, 1), (0, 2)], seconds, port + 10)
    return out
