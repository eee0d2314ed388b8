"""A standalone tracker's restart: ``--state-dir`` keeps its manifests and URL bindings, and members come back once.

Real ``p2pw tracker``, ``p2pw manifest`` and ``p2pw get`` processes on loopback, the origin a local directory;
assertions are on exit codes, bytes, files and counted log lines, never on time.  Every process is ended by
PID in teardown (``procs``), pass or fail.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter

import pytest

from conftest import same_tree
from test_fleet_get import get, publish, published_id, start_tracker
from p2pweights.origin import lookup
from p2pweights.sources.manifest import Manifest
from p2pweights.swarm.node.member import HELLO_PATIENCE, HELLO_PATIENCE_MAX, Reintroduction

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []


def tracker(procs, tmp_path, port=0, name="tracker", *extra):
    ready = tmp_path / f"{name}.ready"
    p = procs.start("tracker", "--port", port, "--host", "127.0.0.1", "--ready", ready, *extra)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.popen.poll() is None and time.monotonic() < deadline, f"tracker did not start:\n{p.output()}"
        time.sleep(0.05)
    return p, json.loads(ready.read_text())["port"]


def joined(t) -> Counter:
    """Each peer id's joins in tracker ``t``'s log."""
    return Counter(m.group(1) for ln in t.output().splitlines() if (m := re.search(r"peer (\S+) joined as", ln)))


def kill(p) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.popen.wait(10)


def test_a_restarted_tracker_with_a_state_dir_serves_a_model_nobody_holds(procs, tmp_path, model_dir):
    state = tmp_path / "state"
    t, port = tracker(procs, tmp_path, 0, "t1", "--state-dir", state)
    mid = published_id(publish(port, model_dir))  # the publisher has gone: only the tracker knows the manifest
    kill(t)
    t2, _ = tracker(procs, tmp_path, port, "t2", "--state-dir", state)
    assert "1 models and 1 URLs kept from the state folder" in t2.output()
    g = get(procs, model_dir, port, tmp_path / "out", "--connect-timeout", "2")  # no wait for a publish
    assert g.wait(120) == 0, g.output()
    assert same_tree(model_dir, tmp_path / "out") == []
    assert json.loads(open(f"{tmp_path / 'out'}.json").read())["model_id"] == mid
    # the same get against a restarted tracker that kept nothing finds no manifest
    kill(t2)
    t3, _ = tracker(procs, tmp_path, port, "t3")
    g = get(procs, model_dir, port, tmp_path / "out2", "--connect-timeout", "2")
    assert g.wait(120) == 1 and "no manifest published" in g.output()


def test_a_hostile_state_dir_costs_one_line_a_file_and_the_tracker_starts(procs, tmp_path, model_dir):
    state = tmp_path / "state"
    t, port = tracker(procs, tmp_path, 0, "t1", "--state-dir", state)
    mid = published_id(publish(port, model_dir))
    kill(t)
    good = (state / f"{mid}.manifest").read_bytes()
    other = Manifest.from_wire(good).body()
    other["chunk_size"] = other["chunk_size"] * 2
    (state / ("0" * 64 + ".manifest")).write_bytes(good)  # another model's bytes under this name
    (state / ("1" * 64 + ".manifest")).write_text(json.dumps(other))  # not its own id's bytes either
    (state / ("2" * 64 + ".manifest")).symlink_to(state / f"{mid}.manifest")
    (state / ("3" * 64 + ".manifest")).write_bytes(good[:len(good) // 2])  # truncated
    bindings = (state / "bindings.json").read_text()
    t2, _ = tracker(procs, tmp_path, port, "t2", "--state-dir", state)
    for bad in ("0", "1", "2", "3"):
        assert len([ln for ln in t2.output().splitlines() if f"{bad * 64}.manifest skipped" in ln]) == 1
    assert "a symlink" in t2.output()
    assert lookup(f"127.0.0.1:{port}", str(model_dir)).model_id == mid  # the good one is served
    kill(t2)
    (state / "bindings.json").write_text(bindings[:len(bindings) // 2])  # truncated JSON
    t3, _ = tracker(procs, tmp_path, port, "t3", "--state-dir", state)
    assert len([ln for ln in t3.output().splitlines() if "bindings.json skipped" in ln]) == 1
    assert lookup(f"127.0.0.1:{port}", mid).model_id == mid  # by id, its URL binding lost
    assert t3.popen.poll() is None
    (tmp_path / "a-file").write_text("")
    bad = procs.start("tracker", "--port", 0, "--host", "127.0.0.1", "--state-dir", tmp_path / "a-file")
    assert bad.wait(60) == 1
    assert bad.output().splitlines()[-1] == f"p2pw: error: --state-dir {tmp_path / 'a-file'}: not a folder"


@pytest.mark.parametrize("outage", [3, 16])  # shorter than the members' tracker timeout (10 s), and longer
def test_members_through_a_tracker_restart_introduce_themselves_once(procs, tmp_path, model_dir, outage):
    t, port = tracker(procs, tmp_path, 0, "t1")
    publish(port, model_dir)
    gets = [get(procs, model_dir, port, tmp_path / f"g{k}", "--stay") for k in range(3)]
    for k in range(3):
        marker = tmp_path / f"g{k}" / ".p2pw"
        deadline = time.monotonic() + 120
        while not (marker.exists() and any(n.startswith("complete") for n in os.listdir(marker))):
            assert gets[k].popen.poll() is None and time.monotonic() < deadline, gets[k].output()
            time.sleep(0.1)
    kill(t)
    time.sleep(outage)  # long: each member's tracker timeout passes while the tracker is away
    t2, _ = tracker(procs, tmp_path, port, "t2")
    t2.wait_line(r"joined as rank", 60)
    time.sleep(6)  # what each member queued while the tracker was away arrives in this time
    joins = Counter(m.group(1) for ln in t2.output().splitlines() if (m := re.search(r"peer (\S+) joined as", ln)))
    assert len(joins) == 3 and set(joins.values()) == {1}, t2.output()
    assert "unexpected" not in t2.output(), t2.output()
    for g in gets:
        assert g.popen.poll() is None
        back = [ln for ln in g.output().splitlines() if "introducing ourselves again" in ln]
        assert len(back) == 1, g.output()


# ----- when a member says HELLO again: the rules, one at a time ------------------------------------------------

def test_nothing_is_said_while_the_link_is_down_and_one_hello_when_it_comes_back():
    again = Reintroduction()
    again.dropped()
    assert not again.due(20.0, silent=True) and not again.due(21.0, silent=False)
    again.connected()
    assert again.due(22.0, silent=False)  # back after a drop: the tracker behind it may have restarted
    assert again.said(22.0) is True
    assert not again.due(22.5, silent=True)


def test_a_silent_tracker_gets_one_hello_then_more_only_past_a_doubling_patience():
    again = Reintroduction()
    assert not again.due(1.0, silent=False)
    assert again.due(10.0, silent=True) and again.said(10.0) is True
    assert not again.due(10.0 + HELLO_PATIENCE - 0.1, silent=True)
    assert again.due(10.0 + HELLO_PATIENCE, silent=True) and again.said(15.0) is False
    assert not again.due(15.0 + HELLO_PATIENCE, silent=True) and again.due(15.0 + 2 * HELLO_PATIENCE, silent=True)
    for _ in range(10):
        again.said(100.0)
    assert again.patience == HELLO_PATIENCE_MAX


def test_a_welcome_ends_the_round():
    again = Reintroduction()
    again.said(10.0)
    again.said(15.0)
    again.welcomed()
    assert again.patience == HELLO_PATIENCE and not again.due(16.0, silent=False)
    assert again.due(16.0, silent=True) and again.said(16.0) is True


def test_agents_and_a_seeder_through_a_tracker_restart_introduce_themselves_once(procs, tmp_path):
    from test_agent import agent, model, seeder, status, until

    t, port = tracker(procs, tmp_path, 0, "t1")
    path = model(tmp_path, "m")
    _, mid = seeder(procs, tmp_path, path, port)
    prewarm = tmp_path / "prewarm"
    prewarm.write_text(mid + "\n")
    caches = [tmp_path / f"cache{k}" for k in range(3)]
    agents = [agent(procs, tmp_path, port, c, "--no-origin", "--prewarm", prewarm) for c in caches]
    for a, c in zip(agents, caches):
        until(lambda: status(c).get(mid, {}).get("state") == "ready", proc=a)
    kill(t)
    time.sleep(16)
    t2, _ = tracker(procs, tmp_path, port, "t2")
    until(lambda: len(joined(t2)) == 4, 60)  # the agents know no URL: they join once the seeder has re-published
    time.sleep(6)
    joins = joined(t2)
    assert len(joins) == 4 and set(joins.values()) == {1}, t2.output() + "\n".join(a.output() for a in agents)
    assert "unexpected" not in t2.output(), t2.output()
    for a, c in zip(agents, caches):
        assert a.popen.poll() is None and status(c)[mid]["state"] == "ready"


def test_a_hello_answered_with_an_error_is_repeated_once_the_patience_passes():
    again = Reintroduction()
    again.said(10.0)  # the tracker answered: no swarm for the model (not published again yet)
    assert not again.due(10.0 + HELLO_PATIENCE - 0.1, silent=False)
    assert again.due(10.0 + HELLO_PATIENCE, silent=False)


# ----- the state folder's contents, without processes -------------------------------------------------------------

def test_every_candidate_its_publisher_and_confirmation_survive_a_restart(tmp_path):
    from test_shares import manifest
    from p2pweights.swarm.tracker.registry import Registry
    from p2pweights.swarm.tracker.statedir import TrackerState
    from p2pweights.swarm.tracker.topology import make

    def registry():
        return Registry(lambda n: make("forest:2"), clock=lambda: 0.0)

    a, b, c = manifest(8, 1), manifest(8, 2), manifest(8, 3)
    reg = registry()
    reg.publish(b"p1", {"url": "s3://b/m"}, a.wire_bytes(), "10.0.0.1")
    reg.publish(b"p2", {"url": "s3://b/m"}, b.wire_bytes(), "10.0.0.2", operator=True)
    reg.publish(b"p3", {"url": "s3://b/other"}, c.wire_bytes(), "10.0.0.3")
    reg.hello(b"r", {"peer_id": "r", "listen": "127.0.0.1:9", "model_id": a.model_id, "origin": True})
    assert reg.dirty
    state = TrackerState(tmp_path / "state", 256)
    state.save(*reg.kept())
    back = registry()
    kept = TrackerState(tmp_path / "state", 256).load()
    assert kept.skipped == 0
    back.restore(kept.manifests, kept.urls, kept.opened)
    assert [(x.model_id, x.source, x.operator, x.confirmed) for x in back.candidates("s3://b/m")] == [
        (a.model_id, "10.0.0.1", False, True), (b.model_id, "10.0.0.2", True, False)]
    assert back.opened[c.model_id].source == "10.0.0.3" and set(back.swarms) == {a.model_id, b.model_id, c.model_id}
    assert not back.dirty  # what was read is not written back
    # a swarm evicted is gone from the folder too
    del reg.swarms[c.model_id], reg.opened[c.model_id], reg.urls["s3://b/other"]
    state.save(*reg.kept())
    assert not (tmp_path / "state" / f"{c.model_id}.manifest").exists()
    assert set(TrackerState(tmp_path / "state", 256).load().manifests) == {a.model_id, b.model_id}
