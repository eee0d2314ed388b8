"""What a client waits through when the control plane or the agent goes away, and what a client cannot break: a
tracker that comes up late, an agent killed while clients wait, a byte written into a client's linked file, a
pre-warm addition.  Real processes; assertions on bytes, exit codes and counts, never on time; every process a
test starts is ended by PID in teardown (``procs``)."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from conftest import free_port, same_tree
from test_agent import agent, model, seeder, status, until
from test_fleet_get import CHUNK, publish, start_tracker

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []


def test_get_with_a_connect_timeout_waits_for_a_tracker_that_comes_up_late(procs, tmp_path):
    path = model(tmp_path, "late", size_mb=2)
    port = free_port()
    out = tmp_path / "out"
    g = procs.start("get", path, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--out", out, "-q",
                    "--connect-timeout", 20)
    g.wait_line("no answer from 127.0.0.1", timeout=60)
    time.sleep(8)  # the tracker is down this long (the get's own lookup gave up after 5 s before)
    assert g.popen.poll() is None, g.output()
    start_tracker(procs, tmp_path, port=port)
    publish(port, path)
    assert g.wait(120) == 0, g.output()
    assert same_tree(path, out) == []
