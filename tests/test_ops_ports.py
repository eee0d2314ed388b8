"""Fixed ports and integrity defaults an operator relies on, with real ``p2pw`` processes: the uplink probe
sink on its documented port (--port + 2), a published manifest's chunk hash the one asked for, and a pinned
model id shorter than 16 hex digits one error line.  Assertions are on
files, exit codes and counts; the ``procs`` fixture ends every process it started."""
from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from conftest import ROOT, p2pw_argv, same_tree
from test_fleet_get import CHUNK, get, report, start_tracker

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []


def port_pair() -> int:
    """A loopback port P with P + 2 free too (where the probe sink goes by default)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 2))
            except OSError:
                continue
            return p
    raise AssertionError("no two free ports two apart")


def listening(port: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def test_the_tracker_s_probe_sink_is_on_its_port_plus_2_by_default(procs, tmp_path):
    p = port_pair()
    _, port = start_tracker(procs, tmp_path, port=p)
    assert port == p and listening(p + 2)


def test_the_seeder_s_probe_sink_is_on_its_port_plus_2_by_default(procs, tmp_path, model_dir):
    p = port_pair()
    seeder = procs.start("seed", model_dir, "--port", p, "--host", "127.0.0.1", "--chunk-size", CHUNK)
    seeder.wait_line("model id")
    assert listening(p + 2), seeder.output()


def test_probe_port_0_still_means_any_free_one(procs, tmp_path):
    p = port_pair()
    tracker = procs.start("tracker", "--port", p, "--host", "127.0.0.1", "--probe-port", 0)
    assert listening(p), tracker.output()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p + 2))  # left free


def test_manifest_hash_sha256_is_published_and_a_get_of_it_verifies(procs, tmp_path, model_dir):
    _, port = start_tracker(procs, tmp_path)
    written = tmp_path / "published.json"
    r = subprocess.run(p2pw_argv("manifest", model_dir, "--chunk-size", CHUNK, "--hash", "sha256", "--tracker",
                                 f"127.0.0.1:{port}", "-o", written), capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    doc = json.loads(written.read_text())
    assert doc["hash"] == "sha256" and all(len(h) == 64 for h in doc["chunks"])
    mid = r.stdout.split("(model id ")[1].split(")")[0]
    p = get(procs, model_dir, port, tmp_path / "out", "--model-id", mid[:16])
    assert p.wait(120) == 0, p.output()
    assert same_tree(model_dir, tmp_path / "out") == [] and report(tmp_path / "out")["model_id"] == mid


def test_manifest_hash_refuses_an_unknown_algorithm(model_dir):
    r = subprocess.run(p2pw_argv("manifest", model_dir, "--hash", "md5"), capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode != 0 and "invalid choice" in r.stderr


@pytest.mark.parametrize("command", [
    ("join", "--parent", "127.0.0.1:1", "--connect-timeout", "2"),
    ("get", "/nonexistent/model", "--tracker", "127.0.0.1:1", "--connect-timeout", "2"),
    ("get", "/nonexistent/model", "--agent", "/nonexistent/cache", "--connect-timeout", "2"),
])
def test_a_15_digit_model_id_is_one_error_line(command, tmp_path):
    r = subprocess.run(p2pw_argv(*command, "--model-id", "0123456789abcde", "--out", tmp_path / "out"),
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("p2pw: error: bad model id"), r.stderr
