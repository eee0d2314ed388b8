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


def _probe(port, path) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_prewarm_line_added_leaves_the_agent_ready_while_its_own_probe_waits_for_the_model(procs, tmp_path):
    _, port = start_tracker(procs, tmp_path)
    first, second = model(tmp_path, "warm0"), model(tmp_path, "warm1", size_mb=8)
    _, id0 = seeder(procs, tmp_path, first, port)
    _, id1 = seeder(procs, tmp_path, second, port, env={"P2PW_FAULTS": "delay_send=150"})
    cache, prewarm = tmp_path / "cache", tmp_path / "prewarm"
    prewarm.write_text(id0 + "\n")
    a = agent(procs, tmp_path, port, cache, "--no-origin", "--prewarm", prewarm, "--http", "127.0.0.1:0")
    http = json.loads((tmp_path / f"agent-{len(procs.started) - 1}.json").read_text())["http_port"]
    until(lambda: _probe(http, f"/readyz/{id0}")[0] == 200, proc=a)
    assert _probe(http, "/readyz")[0] == 200 and _probe(http, "/healthz")[0] == 200
    prewarm.write_text(f"{id0}\n{id1}\n")
    until(lambda: (status(cache).get(id1) or {}).get("state") == "fetching", proc=a)
    seen = []
    while (model_probe := _probe(http, f"/readyz/{id1}"))[0] != 200:
        whole = _probe(http, "/readyz")
        seen.append((model_probe[0], whole[0], whole[1].get("prewarm_complete")))
        assert model_probe[0] == 503 and whole[0] == 200, (model_probe, whole)
        time.sleep(0.2)
    assert seen and seen[0] == (503, 200, False)  # ready the whole time, its pre-warm named as not complete
    assert _probe(http, "/readyz") == (200, {"stage": "ready", "prewarm_complete": True})


@pytest.mark.parametrize("running, since_tick, answered, alive, why", [
    (True, 0.4, True, True, ""),
    (False, 0.4, True, False, "thread stopped"),  # its loop or socket thread ended
    (True, 61.0, True, False, "not ticked for 61 s"),  # its loop is stuck in a tick
    (True, 0.4, False, False, "socket does not answer"),  # its socket accepts nothing, or never answers
    (True, 0.4, None, False, "socket does not answer"),
])
def test_an_agent_is_alive_while_its_loop_ticks_and_its_socket_answers(running, since_tick, answered, alive, why):
    from p2pweights.agent import rules

    got = rules.alive(running, since_tick, answered, wedged=60.0)
    assert got[0] is alive and why in got[1]
