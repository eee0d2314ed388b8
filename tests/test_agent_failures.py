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
from test_fleet_get import publish, start_tracker

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


def test_a_byte_written_into_a_clients_link_is_mended_in_the_agents_copy_before_a_peer_or_client_gets_it(
        procs, tmp_path):
    from test_fleet_get import get, report

    _, port = start_tracker(procs, tmp_path)
    path = model(tmp_path, "sealed")
    seed, mid = seeder(procs, tmp_path, path, port)
    cache = tmp_path / "cache"
    a = agent(procs, tmp_path, port, cache, "--no-origin")
    first = procs.start("get", mid, "--agent", cache, "--out", tmp_path / "out0", "-q")
    assert first.wait(120) == 0, first.output()
    copy = cache / "models" / mid
    files = sorted(p for p in (tmp_path / "out0").rglob("*") if p.is_file())
    assert files and all(os.stat(p).st_mode & 0o777 == 0o444 for p in files)  # the agent's inodes, sealed
    victim = max(files, key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:  # root may write a 0444 file: the agent must notice
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    until(lambda: (status(cache).get(mid) or {}).get("repairs") == 1, proc=a)
    until(lambda: status(cache)[mid]["state"] == "ready", proc=a)
    assert same_tree(path, copy) == [] and same_tree(path, tmp_path / "out0") == []  # the shared inode too
    seed.popen.terminate()
    seed.wait(30)
    peer = get(procs, mid, port, tmp_path / "peer", "--no-origin")  # the agent is the only holder now
    assert peer.wait(120) == 0, peer.output()
    assert same_tree(path, tmp_path / "peer") == [] and report(tmp_path / "peer")["bad_chunks"] == 0
    nxt = procs.start("get", mid, "--agent", cache, "--out", tmp_path / "out1", "-q")
    assert nxt.wait(120) == 0, nxt.output()
    assert same_tree(path, tmp_path / "out1") == []


def test_a_writer_waiting_for_the_readers_of_a_copy_that_is_not_complete_gives_up_with_one_line(tmp_path):
    import fcntl

    from p2pweights.errors import P2PError
    from p2pweights.storage import localcopy

    copy = tmp_path / "copy"
    copy.mkdir()
    reader = localcopy._open_lock(str(copy))
    fcntl.flock(reader, fcntl.LOCK_SH)  # a reader (a seeder of it) holds a copy with no marker
    try:
        with pytest.raises(P2PError, match=r"held by a reader and not complete: gave up waiting to write it "
                                            r"after 0\.3 s"):
            localcopy.claim(str(copy), write_wait=0.3)
        with pytest.raises(P2PError, match=r"held by a reader and not complete$"):
            localcopy.attach(str(copy))  # a local client never waits to write
    finally:
        os.close(reader)
    held = localcopy.claim(str(copy), write_wait=0.3)  # let go: this one writes it
    assert held.mode == "write"
    held.release()


def test_an_agent_with_no_tracker_is_alive_and_one_whose_loop_is_stuck_is_not(tmp_path, monkeypatch):
    import threading

    from p2pweights.agent import service

    a = service.Agent(f"127.0.0.1:{free_port()}", str(tmp_path / "cache"))  # nobody at its tracker's address
    try:
        assert a.probe() == (True, "")
        stuck = threading.Event()
        monkeypatch.setattr(a.keeper, "check", lambda: stuck.wait(60))
        monkeypatch.setattr(service, "WEDGED", 1.0)
        why = until(lambda: a.probe()[1], timeout=30)
        assert "has not ticked" in why
        stuck.set()
        until(lambda: a.probe()[0], timeout=30)
        a.server.close()  # its socket accepts nothing more
        assert not a.probe()[0]
    finally:
        stuck.set()
        a.close()


def test_manifest_publishing_waits_for_the_tracker_as_long_as_its_connect_timeout_says(procs, tmp_path):
    import subprocess

    from conftest import ROOT, p2pw_argv

    path = model(tmp_path, "pub", size_mb=1)
    r = subprocess.run(p2pw_argv("manifest", path, "--tracker", f"127.0.0.1:{free_port()}", "--connect-timeout", 1),
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("p2pw: error: no answer from")
    assert "within 1 s" in r.stderr


def test_an_agent_restarted_while_its_tracker_is_away_hands_out_its_complete_copies_at_once(procs, tmp_path):
    tracker, port = start_tracker(procs, tmp_path)
    path = model(tmp_path, "kept")
    seed, mid = seeder(procs, tmp_path, path, port)
    cache = tmp_path / "cache"
    first = agent(procs, tmp_path, port, cache, "--no-origin", "--connect-timeout", 120)
    g = procs.start("get", mid, "--agent", cache, "--out", tmp_path / "out0", "-q")
    assert g.wait(120) == 0, g.output()
    for p in (tracker, seed, first):
        p.popen.terminate()
        p.wait(30)
    again = agent(procs, tmp_path, port, cache, "--no-origin", "--connect-timeout", 120)
    g = procs.start("get", mid, "--agent", cache, "--out", tmp_path / "out1", "-q")
    assert g.wait(60) == 0, g.output() + again.output()
    assert same_tree(path, tmp_path / "out1") == []
