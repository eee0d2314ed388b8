"""Bounded memory: a 1 GiB checkpoint through a seeder and two joiners, each in its own 384 MiB memory cgroup.

The blob does not fit in any of them: the seeder serves its source files
mapped (page cache the kernel may drop and read again), the joiners receive
into their mapped destination files (dirty page cache the kernel must write
back under the limit).  Every copy must be identical and nothing killed.
The cgroups (v2 ``memory.max`` where the memory controller is mounted that
way, else v1 ``memory.limit_in_bytes``) are created and removed by the test;
it is skipped, saying why, where neither can be made.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid

import pytest

from conftest import Proc, p2pw_argv

LIMIT = 384 << 20
CHECKPOINT = 1 << 30
CHUNK = 4 << 20
WINDOW = 8
# about 256 MiB plus the credit windows (two links of WINDOW chunks; the pull scheduler may widen a fast
# link's window, and what a window asks for waits in libzmq's receive queue, anonymous memory, until taken)
ANON_BOUND = (256 << 20) + 2 * WINDOW * CHUNK


class MemoryCgroup:
    """A memory cgroup of ``limit`` bytes, made for one test and removed after it."""

    def __init__(self, limit: int):
        name = f"p2pw-test-{uuid.uuid4().hex[:8]}"
        v2 = next((r for r in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
                   if "memory" in _read(os.path.join(r, "cgroup.controllers")).split()), None)
        if v2 is not None:
            self.path, self.limit_file, self.events = os.path.join(v2, name), "memory.max", "memory.events"
        elif os.path.exists("/sys/fs/cgroup/memory/memory.limit_in_bytes"):
            self.path = os.path.join("/sys/fs/cgroup/memory", name)
            self.limit_file, self.events = "memory.limit_in_bytes", "memory.oom_control"
        else:
            raise OSError("no cgroup v2 memory controller and no cgroup v1 memory hierarchy mounted")
        os.mkdir(self.path)
        try:
            with open(os.path.join(self.path, self.limit_file), "w") as f:
                f.write(str(limit))
        except OSError:
            self.remove()
            raise

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this cgroup (the shell moves itself in, then execs: every byte is charged)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *argv]

    def oom_kills(self) -> int:
        for line in _read(os.path.join(self.path, self.events)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):  # rmdir fails while an exiting process is still charged to it
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class AnonPeak:
    """Samples RssAnon (anonymous resident memory, /proc/PID/status) of processes; keeps each one's peak."""

    def __init__(self):
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(0.02):
            for name, pid in list(self.pids.items()):
                for line in _read(f"/proc/{pid}/status").splitlines():
                    if line.startswith("RssAnon:"):
                        self.peak[name] = max(self.peak.get(name, 0), int(line.split()[1]) * 1024)


def write_checkpoint(root) -> None:
    """1 GiB of random bytes in four shards and a config, on disk and out of the page cache."""
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "test"}')
    block = 64 << 20
    for k in range(4):
        with open(root / f"shard-{k}.bin", "wb") as f:
            for _ in range(CHECKPOINT // 4 // block):
                f.write(os.urandom(block))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the seeder's cgroup reads it


def digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


@pytest.fixture
def cgroups():
    made = []

    def make():
        try:
            cg = MemoryCgroup(LIMIT)
        except OSError as e:
            pytest.skip(f"cannot make a {LIMIT >> 20} MiB memory cgroup here: {e}")
        made.append(cg)
        return cg

    yield make
    for cg in made:
        cg.remove()


@pytest.fixture
def big_tmp(tmp_path):
    """tmp_path, emptied afterwards: pytest keeps recent tmp dirs, and these hold 3 GiB."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_one_gib_through_three_384_mib_cgroups(cgroups, big_tmp, procs):  # torn down: procs, files, cgroups
    tmp_path = big_tmp
    groups = {name: cgroups() for name in ("seeder", "a", "b")}
    src = tmp_path / "model"
    write_checkpoint(src)
    ready = tmp_path / "ready.json"
    watch = AnonPeak()
    started = []
    try:
        def start(name, *args):
            p = Proc(groups[name].argv(p2pw_argv(*args)))
            procs.started.append(p)
            started.append(p)
            watch.pids[name] = p.pid
            return p

        seeder = start("seeder", "seed", src, "--port", 0, "--host", "127.0.0.1", "--ready", ready,
                       "--exit-after", 2, "--report", tmp_path / "seed.json", "--window", WINDOW)
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert seeder.popen.poll() is None and time.monotonic() < deadline, seeder.output()
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        joiners = {name: start(name, "join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1",
                               "--out", tmp_path / name, "-q", "--model-id", info["model_id"],
                               "--report", tmp_path / f"{name}.json", "--window", WINDOW)
                   for name in ("a", "b")}
        for name, j in joiners.items():
            assert j.wait(300) == 0, f"joiner {name} (exit {j.popen.returncode}):\n{j.output()}"
        assert seeder.wait(60) == 0, seeder.output()
    finally:
        watch.stop.set()
    for name, cg in groups.items():
        assert cg.oom_kills() == 0, f"{name} was OOM-killed in its {LIMIT >> 20} MiB cgroup"
    want = {n: digest(src / n) for n in os.listdir(src)}
    for name in ("a", "b"):
        got = {n: digest(tmp_path / name / n) for n in os.listdir(tmp_path / name) if n != ".p2pw"}
        assert got == want, name
        assert (tmp_path / name / ".p2pw" / "complete.json").exists()
    for name, peak in watch.peak.items():
        assert peak < ANON_BOUND, f"{name}: {peak >> 20} MiB anonymous memory, over {ANON_BOUND >> 20} MiB"
    seed = json.loads((tmp_path / "seed.json").read_text())
    # it read the checkpoint once to hash it, and again only what the kernel dropped to stay under the limit
    assert seed["bytes_read"] >= sum(os.path.getsize(src / n) for n in os.listdir(src))
    print(f"peak RssAnon MiB: { {n: p >> 20 for n, p in watch.peak.items()} }; seeder read "
          f"{seed['bytes_read'] / CHECKPOINT:.2f}x the checkpoint")
