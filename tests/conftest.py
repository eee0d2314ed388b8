"""Shared fixtures: start real p2pw processes, and always end them."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A loopback TCP port nothing listens on (free when this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def manifest_catalog(tmp_path_factory, monkeypatch):
    """Each test's processes keep their manifest catalog and model cache (copies, remembered failures) in a
    throwaway directory of their own, not the user's and not another test's."""
    monkeypatch.setenv("P2PW_CACHE_DIR", str(tmp_path_factory.mktemp("p2pw-cache")))


def p2pw_argv(*args) -> list[str]:
    return [sys.executable, "-m", "p2pweights", *map(str, args)]


class Proc:
    """A p2pw process whose stderr lines are collected as they come."""

    def __init__(self, argv, env=None, cwd=None):
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                                      cwd=cwd or ROOT, text=True)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.popen.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()

    @property
    def pid(self):
        return self.popen.pid

    def output(self) -> str:
        with self.cond:
            return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = 60) -> re.Match:
        """Block until an output line matches ``pattern``; fail the test otherwise."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and seen == len(self.lines)):
                    raise AssertionError(f"no line matching {pattern!r}; output:\n{self.output()}")
                self.cond.wait(min(left, 0.2))

    def wait(self, timeout: float = 60) -> int:
        """Its exit status; fail the test with its output if it is still running after ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g} s; output:\n{self.output()}") from None


class Procs:
    """Starts p2pw processes for one test and ends every one of them in teardown."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.started: list[Proc] = []

    def start(self, *args, env=None) -> Proc:
        p = Proc(p2pw_argv(*args), env=env)
        self.started.append(p)
        return p

    def seeder(self, path, *extra, env=None) -> tuple[Proc, dict]:
        """Start ``p2pw seed`` on a free loopback port; returns it and its {port, model_id}."""
        ready = self.tmp / f"seed-{len(self.started)}.ready"
        p = self.start("seed", path, "--port", 0, "--host", "127.0.0.1", "--ready", ready, *extra, env=env)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if p.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"seeder did not start:\n{p.output()}")
            time.sleep(0.05)
        return p, json.loads(ready.read_text())

    def join(self, port, out, *extra, env=None) -> Proc:
        return self.start("join", "--parent", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--out", out, "-q",
                          *extra, env=env)

    def close(self):
        for p in self.started:
            if p.popen.poll() is None:
                try:
                    os.kill(p.pid, 18)  # SIGCONT, in case a test stopped it
                except OSError:
                    pass
                p.popen.terminate()
        for p in self.started:
            try:
                p.popen.wait(10)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(10)


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.close()


@pytest.fixture
def model_dir(tmp_path):
    """A small sharded Llama-style checkpoint with config and tokenizer files."""
    from p2pweights.sources.synth import write_synthetic_model

    d = tmp_path / "model"
    write_synthetic_model(d, size_mb=6, shards=3)
    return d


def same_tree(a, b) -> list[str]:
    """Relative names of files that differ between directory trees ``a`` and ``b`` (missing ones included).

    ``.p2pw/`` (what p2pw keeps about a copy: its completion marker) is not part of either tree."""
    def files(root):
        out = {}
        for dirpath, dirs, names in os.walk(root):
            if ".p2pw" in dirs:
                dirs.remove(".p2pw")
            for n in names:
                full = os.path.join(dirpath, n)
                out[os.path.relpath(full, root)] = full
        return out

    fa, fb = files(a), files(b)
    diff = sorted(set(fa) ^ set(fb))
    for name in set(fa) & set(fb):
        with open(fa[name], "rb") as x, open(fb[name], "rb") as y:
            if x.read() != y.read():
                diff.append(name)
    return diff


def forwarding_joins(procs, tmp_path, where, *join_args) -> tuple[object, list[dict]]:
    """Two joins into ``where/copy0``, ``where/copy1`` forwarding to each other, each corrupting a fifth of the
    chunks it sends: both end 0 with exact copies, something was forwarded and some chunks failed their
    check.  Returns the model's folder and the joins' ``--report`` documents."""
    from p2pweights.sources.synth import write_synthetic_model

    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=4, shards=2)
    seeder, info = procs.seeder(src, "--chunk-size", "64KiB", "--exit-after", 2,
                                env={"P2PW_FAULTS": "delay_send=5"})  # slow enough that the joins forward
    joins = [procs.join(info["port"], where / f"copy{k}", "--report", tmp_path / f"{k}.json", *join_args,
                        env={"P2PW_FAULTS": f"corrupt=0.2,seed={k}"}) for k in range(2)]
    for j in joins:
        assert j.wait(60) == 0, j.output()
    assert seeder.wait(60) == 0, seeder.output()
    reports = [json.loads((tmp_path / f"{k}.json").read_text()) for k in range(2)]
    assert sum(r["bytes_sent"] for r in reports) > 0 and sum(r["bad_chunks"] for r in reports) > 0
    for k in range(2):
        assert same_tree(src, where / f"copy{k}") == []
    return src, reports


def left_everywhere(port, timeout=60):
    """Wait until the seeder at ``port`` lists no member that has not left."""
    from p2pweights.api import status

    deadline = time.monotonic() + timeout
    while any(p.get("state") != "left" for p in status(f"127.0.0.1:{port}")["peers"]):
        assert time.monotonic() < deadline, status(f"127.0.0.1:{port}")
        time.sleep(0.1)
