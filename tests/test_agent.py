"""The node agent with real processes: ``p2pw tracker``, ``p2pw seed --tracker``, ``p2pw agent`` and its local
clients (``p2pw get --agent``, ``p2pweights.join(..., agent=)``).  Assertions are on bytes, exit codes and
counts, never on time; every process a test starts is ended by PID in teardown (``procs``), pass or fail."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from conftest import ROOT, Proc, same_tree
from test_fleet_get import CHUNK, publish, start_tracker
from p2pweights.sources.synth import write_synthetic_model
from p2pweights.wire import local

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []


def model(tmp_path, name, size_mb=4):
    path = tmp_path / name
    write_synthetic_model(path, size_mb=size_mb, shards=2, seed=sum(map(ord, name)))
    return path


def seeder(procs, tmp_path, path, port, env=None) -> tuple[object, str]:
    """``p2pw seed PATH --tracker``: it publishes the manifest and holds every chunk; its model id."""
    ready = tmp_path / f"{path.name}.seed.json"
    p = procs.start("seed", path, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", 0,
                    "--chunk-size", CHUNK, "--ready", ready, env=env)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.popen.poll() is None and time.monotonic() < deadline, p.output()
        time.sleep(0.05)
    return p, json.loads(ready.read_text())["model_id"]


def agent(procs, tmp_path, port, cache, *extra):
    ready = tmp_path / f"agent-{len(procs.started)}.json"
    p = procs.start("agent", "--tracker", f"127.0.0.1:{port}", "--cache", cache, "--host", "127.0.0.1",
                    "--ready", ready, *extra)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.popen.poll() is None and time.monotonic() < deadline, p.output()
        time.sleep(0.05)
    return p


def status(cache) -> dict:
    return {m["model_id"]: m for m in local.ask(str(cache), {"op": "status"}, timeout=10)["models"]}


def until(what, timeout=120, proc=None):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, proc.output() if proc else "timed out"
        time.sleep(0.05)


def test_three_local_processes_asking_for_two_models_at_once_download_each_once(procs, tmp_path):
    _, port = start_tracker(procs, tmp_path)
    paths = [model(tmp_path, "m0"), model(tmp_path, "m1")]
    ids = [seeder(procs, tmp_path, p, port)[1] for p in paths]
    cache = tmp_path / "cache"
    a = agent(procs, tmp_path, port, cache, "--no-origin")
    gets = [(k, i, procs.start("get", ids[i], "--agent", cache, "--out", tmp_path / f"out{k}-{i}", "-q",
                               "--report", tmp_path / f"out{k}-{i}.json"))
            for k in range(3) for i in range(2)]
    for k, i, g in gets:
        assert g.wait(120) == 0, g.output()
        assert same_tree(paths[i], tmp_path / f"out{k}-{i}") == []
        r = json.loads((tmp_path / f"out{k}-{i}.json").read_text())
        assert r["model_id"] == ids[i] and r["copy"] == str(cache / "models" / ids[i])
        assert r["linked"] == 5 and r["copied"] == 0  # hard links on one filesystem
    held = status(cache)
    for i, mid in enumerate(ids):
        m = held[mid]
        assert m["state"] == "ready", a.output()
        assert m["received_bytes"] == m["total"]  # one copy of each model into the host: its partners sent it once
        assert m["received_chunks"] == m["n_chunks"] and m["origin_bytes_read"] == 0
        assert same_tree(paths[i], cache / "models" / mid) == []


def test_an_agent_restarted_mid_download_resumes_and_keeps_serving(procs, tmp_path):
    _, port = start_tracker(procs, tmp_path)
    path = model(tmp_path, "slow", size_mb=8)
    seed, mid = seeder(procs, tmp_path, path, port, env={"P2PW_FAULTS": "delay_send=120"})
    cache, prewarm = tmp_path / "cache", tmp_path / "prewarm"
    prewarm.write_text(mid + "\n")
    a = agent(procs, tmp_path, port, cache, "--no-origin", "--prewarm", prewarm)
    until(lambda: status(cache).get(mid, {}).get("chunks", 0) >= 8, proc=a)
    os.kill(a.pid, signal.SIGKILL)
    a.wait(10)
    b = agent(procs, tmp_path, port, cache, "--no-origin", "--prewarm", prewarm)
    m = until(lambda: (x := status(cache).get(mid)) and x["state"] == "ready" and x, proc=b)
    assert m["resumed"] >= 8  # the chunks on disk, verified again, not fetched again
    assert m["resumed"] + m["received_chunks"] == m["n_chunks"]
    assert same_tree(path, cache / "models" / mid) == []
    os.kill(seed.pid, signal.SIGTERM)  # the agent is the only holder left: a late host takes it all from it
    assert seed.wait(30) == 0
    late = procs.start("get", path, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--no-origin",
                       "--model-id", mid, "--out", tmp_path / "late", "-q", "--report", tmp_path / "late.json")
    assert late.wait(120) == 0, late.output()
    assert same_tree(path, tmp_path / "late") == []
    assert status(cache)[mid]["sent_bytes"] >= m["total"]


def test_a_prewarm_line_added_is_pulled_and_one_removed_becomes_evictable(procs, tmp_path):
    _, port = start_tracker(procs, tmp_path)
    a_path, b_path = model(tmp_path, "a"), model(tmp_path, "b")
    for p in (a_path, b_path):
        publish(port, p)  # the agent reads the origin itself: its pre-warm file is the operator's
    cache, prewarm = tmp_path / "cache", tmp_path / "prewarm"
    prewarm.write_text(f"{a_path}\n")
    ag = agent(procs, tmp_path, port, cache, "--prewarm", prewarm, "--cache-size", "7MiB", "--local-root", tmp_path)
    a_id = until(lambda: [k for k, m in status(cache).items() if m["state"] == "ready"], proc=ag)[0]
    assert status(cache)[a_id]["kept"] and status(cache)[a_id]["origin_bytes_read"] > 0
    new = tmp_path / "prewarm.new"
    new.write_text(f"{b_path}\n")
    os.replace(new, prewarm)  # a: evictable now; b: pulled, and only one fits under 7 MiB
    b = until(lambda: [m for k, m in status(cache).items() if k != a_id and m["state"] == "ready"], proc=ag)[0]
    assert b["kept"] and same_tree(b_path, b["path"]) == []
    assert a_id not in status(cache) and not (cache / "models" / a_id).exists()  # evicted for b
    new.write_text(f"{b_path}\n{a_path}\n")
    os.replace(new, prewarm)  # a again: it does not fit beside b, which is kept
    ag.wait_line("cannot make room for model " + a_id[:16])
    assert (cache / "models" / b["model_id"]).exists() and status(cache)[b["model_id"]]["state"] == "ready"
    assert status(cache).get(a_id, {}).get("state") in (None, "failed")


CLIENT = r"""
import json, sys, torch  # torch first: the download runs while the client starts
import p2pweights
dl = p2pweights.join(None, agent=sys.argv[1], model_id=sys.argv[2], device="cpu")
name, tensor = next(iter(dl.iter_tensors(600)))
print(json.dumps({"name": name, "chunks": dl.store.count, "n_chunks": dl.manifest.n_chunks,
                  "complete": dl.progress["complete"], "sum": float(tensor.float().sum())}), flush=True)
dl.wait(600)
print(json.dumps({"chunks": dl.store.count, "complete": dl.progress["complete"]}), flush=True)
dl.close()
"""


def test_a_process_waiting_on_the_agent_gets_a_tensor_before_the_last_chunk_lands(procs, tmp_path):
    pytest.importorskip("torch")
    _, port = start_tracker(procs, tmp_path)
    path = model(tmp_path, "ewl", size_mb=8)
    _, mid = seeder(procs, tmp_path, path, port, env={"P2PW_FAULTS": "delay_send=150"})
    cache = tmp_path / "cache"
    agent(procs, tmp_path, port, cache, "--no-origin")
    client = Proc([sys.executable, "-c", CLIENT, str(cache), mid])
    procs.started.append(client)
    assert client.wait(180) == 0, client.output()
    first, last = [json.loads(x) for x in client.output().splitlines() if x.startswith("{")]
    assert not first["complete"] and first["chunks"] < first["n_chunks"]  # the tensor came while chunks were missing
    assert last["complete"] and last["chunks"] == first["n_chunks"]


def _as_nobody(path: str) -> dict:
    """Connect to the agent's socket as uid 65534 in a forked child: what happened."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                out = {"answer": local.ask(path, {"op": "status"}, timeout=10)}
            except local.AgentError as e:
                out = {"error": str(e)}
        except BaseException as e:  # noqa: BLE001
            out = {"crash": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.fixture
def open_dir():
    """A folder every user may walk through (pytest's own are root's alone), removed afterwards."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="p2pw-agent-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_agents_socket_refuses_a_path_outside_its_cache_and_another_users_client(procs, tmp_path, open_dir):
    _, port = start_tracker(procs, tmp_path)
    cache = os.path.join(open_dir, "cache")
    agent(procs, tmp_path, port, cache)
    cache = type(tmp_path)(cache)
    sock = cache / local.SOCKET
    assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
    with pytest.raises(local.AgentError, match="outside the agent's cache"):
        local.ask(str(cache), {"op": "get", "model": "/etc"}, timeout=10)
    with pytest.raises(local.AgentError, match="unknown op"):
        local.ask(str(cache), {"op": "rm", "model": "x"}, timeout=10)
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root")
    assert "not allowed" in _as_nobody(str(cache)).get("error", ""), "mode 0600 must keep another user out"
    os.chmod(sock, 0o666)  # a mode widened by mistake: the agent still checks who is asking
    got = _as_nobody(str(cache))
    assert "uid 65534 may not use this agent" in got.get("error", ""), got
    assert status(cache) == {}  # and the agent goes on serving its own user
