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


def test_an_agent_killed_while_three_clients_wait_serves_all_three_once_it_is_back(procs, tmp_path):
    _, port = start_tracker(procs, tmp_path)
    path = model(tmp_path, "restart", size_mb=8)
    _, mid = seeder(procs, tmp_path, path, port, env={"P2PW_FAULTS": "delay_send=150"})
    cache = tmp_path / "cache"
    first = agent(procs, tmp_path, port, cache, "--no-origin")
    gets = [procs.start("get", mid, "--agent", cache, "--out", tmp_path / f"out{k}", "-q", "--connect-timeout", 120)
            for k in range(3)]
    until(lambda: (status(cache).get(mid) or {}).get("chunks", 0) >= 2, proc=first)
    assert status(cache)[mid]["state"] == "fetching"
    first.popen.send_signal(signal.SIGKILL)
    first.popen.wait(30)
    for g in gets:  # each noticed: the agent is away while they wait
        g.wait_line("stopped writing|is not running|no p2pw agent at")
    agent(procs, tmp_path, port, cache, "--no-origin")
    for k, g in enumerate(gets):
        assert g.wait(180) == 0, g.output()
        assert same_tree(path, tmp_path / f"out{k}") == [], g.output()


def test_a_client_asks_an_away_agent_again_with_backoff_until_its_own_wait_is_spent(tmp_path):
    from p2pweights.wire import local

    assert [local.backoff(n) for n in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    now, slept = [0.0], []

    def sleep(s):
        slept.append(s)
        now[0] += s

    with pytest.raises(local.AgentAway, match=r"no p2pw agent at .*\(waited 10 s\)"):
        local.ask_until(str(tmp_path), {"op": "status"}, 10, clock=lambda: now[0], sleep=sleep)
    assert slept == [0.2, 0.4, 0.8, 1.6, 3.2] and now[0] <= 10
