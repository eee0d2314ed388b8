"""Ops: readiness and metrics over real HTTP, fleet status, JSON log lines, the fleet snapshot under churn.

Real processes, sockets and HTTP (urllib); assertions on bytes and states, never on time.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from p2pweights import api

from p2pweights.swarm.tracker import fleet

from p2pweights.wire import keys
from p2pweights.swarm.tracker.topology import make as make_topology
from p2pweights.swarm.tracker.tracker import Tracker

from conftest import free_port, p2pw_argv

CHUNK = "256KiB"


def get(port: int, path: str) -> tuple[int, bytes]:
    """(status, body) of GET http://127.0.0.1:port/path; (0, b"") while nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, b""


def until(check, proc=None, timeout: float = 60, what: str = "condition"):
    """Poll ``check()`` until it returns something truthy; fail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"process exited ({proc.popen.returncode}) before {what}:\n{proc.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s" + (f":\n{proc.output()}" if proc else ""))
        time.sleep(0.05)


def metrics(port: int) -> dict[str, float]:
    """Samples of /metrics as {'name{labels}': value}, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    code, body = get(port, "/metrics")
    assert code == 200, body
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_readyz_waits_for_the_parent_then_counters_add_up_and_status_lists_every_peer(procs, tmp_path, model_dir):
    seed_port, h_seed, h_a, h_b = free_port(), free_port(), free_port(), free_port()
    # A joiner whose seeder is not up yet keeps trying (--connect-timeout); its probes answer from the start.
    a = procs.join(seed_port, tmp_path / "a", "--stay", "--http", f"127.0.0.1:{h_a}", "--connect-timeout", 60)
    code, body = until(lambda: (lambda r: r if r[0] else None)(get(h_a, "/readyz")), a, what="/readyz answer")
    assert code == 503 and json.loads(body) == {"stage": "connecting", "pct": 0.0}
    assert get(h_a, "/healthz")[0] == 200
    before = metrics(h_a)
    assert before["p2pw_ready"] == 0 and before['p2pw_build_info{model_id="",version="0.1.0"}'] == 1

    # star: each peer pulls from the seeder alone (no partners, no endgame duplicates), so bytes add up exactly
    seeder = procs.start("seed", model_dir, "--port", seed_port, "--host", "127.0.0.1", "--chunk-size", CHUNK,
                         "--topology", "star", "--http", f"127.0.0.1:{h_seed}", env={"P2PW_FAULTS": "delay_send=20"})
    until(lambda: get(h_seed, "/readyz")[0] == 200, seeder, what="seeder ready")
    b = procs.join(seed_port, tmp_path / "b", "--stay", "--http", f"127.0.0.1:{h_b}")
    first = api.status(f"127.0.0.1:{seed_port}")
    total, n_chunks, model_id = first["total_size"], first["n_chunks"], first["model_id"]

    # While they download: every peer listed, progress never going back.
    seen: dict[int, float] = {}
    while True:
        doc = api.status(f"127.0.0.1:{seed_port}")
        assert doc["model_id"] == model_id and doc["n_chunks"] == n_chunks
        for p in doc["peers"]:
            assert 0.0 <= p["progress"] <= 1.0 and p["rate"] >= 0 and p["state"] in fleet.STATES
            assert p["progress"] >= seen.get(p["rank"], 0.0)
            seen[p["rank"]] = p["progress"]
        if len(doc["peers"]) == 2 and all(p["state"] == "done" for p in doc["peers"]):
            break
        assert a.popen.poll() is None and b.popen.poll() is None, a.output() + b.output()
        time.sleep(0.1)
    for port, proc in ((h_a, a), (h_b, b)):
        code, body = until(lambda: (lambda r: r if r[0] == 200 else None)(get(port, "/readyz")), proc,
                           what="joiner ready")
        assert json.loads(body) == {"stage": "ready"}

    ms, ma, mb = metrics(h_seed), metrics(h_a), metrics(h_b)
    for mj in (ma, mb):  # each joiner received the model exactly once, verified every chunk, rejected none
        assert mj["p2pw_received_bytes_total"] == total
        assert mj["p2pw_chunks_verified_total"] == n_chunks
        assert mj['p2pw_chunks_rejected_total{reason="hash"}'] == 0
        assert mj['p2pw_chunks_rejected_total{reason="duplicate"}'] == 0
        assert mj["p2pw_source_switches_total"] == 0  # all from the planned source
        assert mj["p2pw_ready"] == 1 and mj["p2pw_download_seconds"] > 0
        assert mj[f'p2pw_build_info{{model_id="{model_id}",version="0.1.0"}}'] == 1
        assert mj["p2pw_sent_bytes_total"] == 0  # leaves of the star
    # the seeder sent what the joiners received, and read the checkpoint from storage once
    assert ms["p2pw_sent_bytes_total"] == ma["p2pw_received_bytes_total"] + mb["p2pw_received_bytes_total"]
    assert ms["p2pw_peers"] == 2 and ms["p2pw_ready"] == 1 and ms["p2pw_received_bytes_total"] == 0
    assert 0 < ms["p2pw_storage_read_bytes_total"] <= total and ms["p2pw_chunks_verified_total"] == n_chunks

    # p2pw status, through the CLI, asked of a peer (which points to the tracker): both peers, done
    out = subprocess.run(p2pw_argv("status", f"127.0.0.1:{seed_port}", "--json"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["model_id"] == model_id
    assert sorted(p["rank"] for p in doc["peers"]) == [1, 2]
    assert all(p["progress"] == 1.0 and p["state"] == "done" and p["addr"].startswith("127.0.0.1:")
               for p in doc["peers"])
    a_listen = next(p["addr"] for p in doc["peers"])
    via_peer = subprocess.run(p2pw_argv("status", a_listen), capture_output=True, text=True, timeout=60)
    assert via_peer.returncode == 0, via_peer.stderr
    lines = via_peer.stdout.splitlines()
    assert lines[1].split() == ["RANK", "ADDR", "SOURCES", "PROGRESS", "RATE", "STATE"]
    assert sorted(int(line.split()[0]) for line in lines[2:]) == [1, 2]
    assert all("100.0%" in line and line.endswith("done") for line in lines[2:])

    # a peer that goes away is shown as left (or, if it vanished without a word, not as downloading)
    b.popen.terminate()
    b.wait(30)
    doc = until(lambda: (lambda d: d if any(p["state"] == "left" for p in d["peers"]) else None)(
        api.status(f"127.0.0.1:{seed_port}")), what="peer shown as left")
    assert [p["state"] for p in doc["peers"]] == ["done", "left"]  # the live one first


def test_json_logs_parse_line_by_line(procs, tmp_path, model_dir):
    seeder = procs.start("seed", model_dir, "--port", 0, "--host", "127.0.0.1", "--log-format", "json",
                         "--exit-after", 1, "--ready", tmp_path / "ready.json")
    until(lambda: (tmp_path / "ready.json").exists(), seeder, what="seeder")
    port = json.loads((tmp_path / "ready.json").read_text())["port"]
    joiner = procs.start("--log-format", "json", "join", "--parent", f"127.0.0.1:{port}", "--host", "127.0.0.1",
                         "--out", tmp_path / "out", "--progress-every", "0.05")
    assert joiner.wait(60) == 0, joiner.output()
    assert seeder.wait(60) == 0, seeder.output()
    for proc, want in ((seeder, {"serving", "model_id", "join_command", "seeder_done"}),
                       (joiner, {"progress", "done"})):
        docs = [json.loads(line) for line in proc.lines]  # every line of stdout and stderr is one JSON object
        assert docs
        for d in docs:
            assert {"ts", "level", "event", "model_id", "rank", "message"} <= set(d), d
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", d["ts"])
        assert want <= {d["event"] for d in docs}
    jdocs = [json.loads(line) for line in joiner.lines]
    last = [d for d in jdocs if d["event"] == "progress"][-1]
    done = next(d for d in jdocs if d["event"] == "done")
    assert last["bytes"] == last["total"] == done["bytes"] == done["received_bytes"] and last["pct"] == 100.0
    assert isinstance(last["sources"], list) and done["rank"] == 1 and done["model_id"]
    assert any(d["event"] == "join_command" and d["command"].startswith("p2pw join")
               for d in map(json.loads, seeder.lines))


def test_progress_lines_off_a_terminal(procs, tmp_path, model_dir):
    seeder, info = procs.seeder(model_dir, "--chunk-size", CHUNK, "--progress-every", "0.05",
                                env={"P2PW_FAULTS": "delay_send=50"})
    j = procs.start("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "--out",
                    tmp_path / "out", "--progress-every", "0.1")
    assert j.wait(60) == 0, j.output()
    lines = [ln for ln in j.lines if " progress " in ln]
    assert lines, j.output()
    assert re.search(r"progress 6\.\d MiB/6\.\d MiB \(100\.0%\) [\d.]+ MB/s ETA \S+ sources rank 0", lines[-1])
    # the seeder's own line about its fleet while the peer downloads (24 chunks at 50 ms each, a line every 50 ms)
    seeder.wait_line(r"fleet: 1 peers, 0 done; slowest rank 1 \(127\.0\.0\.1:\d+\) at [\d.]+%, [\d.]+ MB/s, "
                     r"(waiting|downloading|silent)$")


def test_fleet_snapshot_stays_consistent_while_peers_join_and_leave(procs, tmp_path, model_dir):
    s = api.seed(model_dir, port=0, host="127.0.0.1", chunk_size=256 << 10)
    problems, snapshots, stop = [], [], threading.Event()

    def read():  # another thread, as the CLI and /metrics are: reads only the published snapshots
        last = None
        while not stop.is_set():
            f = s.fleet
            try:
                assert isinstance(f.peers, tuple)
                ranks = [p.rank for p in f.peers]
                assert len(set(ranks)) == len(ranks)
                assert list(f.peers) == sorted(f.peers, key=fleet._order)
                assert f.done == sum(p.done for p in f.peers) and f.live == sum(not p.left for p in f.peers)
                for p in f.peers:
                    assert p.state in fleet.STATES and 0.0 <= p.progress <= 1.0
                    assert (p.state == "left") == p.left and (not p.done or p.progress == 1.0)
                if last is not None and f is not last:
                    assert {p.rank for p in last.peers} <= set(ranks)  # members are never forgotten
                    before = {p.rank: p for p in last.peers}
                    for p in f.peers:
                        q = before.get(p.rank)
                        assert q is None or (p.done >= q.done and (q.left <= p.left or p.state != "left"))
                    snapshots.append(f)
                last = f
                doc = api.status(f"127.0.0.1:{s.port}", timeout=10)
                assert len(doc["peers"]) == doc["count"] and doc["model_id"] == s.model_id
            except Exception as e:  # noqa: BLE001  (reported below, from the test's thread)
                problems.append(repr(e))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        stayers = [procs.join(s.port, tmp_path / f"stay{k}", "--stay") for k in range(2)]
        leavers = [procs.join(s.port, tmp_path / f"leave{k}") for k in range(3)]
        for p in leavers:
            assert p.wait(60) == 0, p.output()
        until(lambda: s.fleet.done == 5, what="5 peers done")
        for p in stayers:
            p.popen.terminate()
            p.wait(30)
        until(lambda: s.fleet.all_left, what="every peer gone")
    finally:
        stop.set()
        reader.join(30)
        s.close()
    assert not problems, problems
    assert len(snapshots) > 2
    final = s.fleet
    assert sorted(p.rank for p in final.peers) == [1, 2, 3, 4, 5]
    assert all(p.left and p.done and p.progress == 1.0 for p in final.peers)
    assert s.peers_done() == 5


def test_snapshot_and_status_reply_are_bounded(tmp_path):
    """A fleet larger than a STATUS_REPLY lists: the slowest are shown, the count covers all."""
    from p2pweights.sources.chunker import build

    (tmp_path / "w.bin").write_bytes(b"x" * 7 * 4096)
    man, _, _ = build(tmp_path / "w.bin", 4096)
    assert man.n_chunks == 7
    now = [0.0]
    t = Tracker(make_topology("forest:2"), "seed:1", clock=lambda: now[0])
    for k in range(30):
        m = t.join(f"p{k}", f"10.0.0.{k % 250}:{7000 + k}")
        t.touch(m.rank, have=k % 7, rates={0: 1000.0 + k})
    t.done(3, seconds=2.0)
    f = fleet.snapshot(t, man)
    assert f.peers[-1].rank == 3 and f.peers[-1].state == "done" and f.peers[-1].rate == 7 * 4096 / 2.0
    doc = json.loads(f.encode(limit=20))
    assert doc["count"] == 30 and len(doc["peers"]) == 20
    assert doc["peers"][0]["progress"] == 0.0 and doc["peers"][0]["state"] == "waiting"
    assert [p["progress"] for p in doc["peers"]] == sorted(p["progress"] for p in doc["peers"])
    big = fleet.Fleet("m" * 64, 1 << 20, 1 << 40, 0.0, tuple(
        fleet.PeerStatus(rank=r, peer_id="p" * 256, addr="a" * 256, sources=tuple(range(64)), have=r, progress=0.5,
                         rate=1e9, state="downloading", done=False, left=False, demoted=False)
        for r in range(5 * fleet.MAX_LISTED)))  # the longest names a HELLO may carry, the most stripes
    payload = big.encode()
    assert len(json.loads(payload)["peers"]) == fleet.MAX_LISTED and len(payload) < api.MAX_STATUS_BYTES
    now[0] = fleet.SILENT_AFTER + 1  # every peer but rank 9 goes quiet
    t.touch(9, have=1)
    states = {p.rank: p.state for p in fleet.snapshot(t, man).peers}
    assert states[9] == "downloading" and states[3] == "done" and states[8] == "silent"
    assert fleet.snapshot(t, man).peers[0].state == "silent"  # the ones to look at first


@pytest.mark.parametrize("argv, message", [
    (["seed", "MODEL", "--http", "nonsense"], "bad --http address 'nonsense'"),
    (["join", "--parent", "127.0.0.1:1", "--http", "127.0.0.1:PORT_TAKEN", "--connect-timeout", "1"],
     "cannot serve --http on 127.0.0.1:"),
    (["status", "127.0.0.1:PORT_FREE", "--timeout", "0.5"], "no answer from 127.0.0.1:"),
])
def test_bad_ops_input_is_one_error_line(model_dir, argv, message):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        argv = [a.replace("MODEL", str(model_dir)).replace("PORT_TAKEN", str(taken.getsockname()[1]))
                .replace("PORT_FREE", str(free_port())) for a in argv]
        r = subprocess.run(p2pw_argv(*argv), capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("p2pw: error: ")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_http_without_prometheus_client_says_how_to_get_it(tmp_path, model_dir):
    """prometheus_client hidden from the process: --http fails with one line naming the extra."""
    (tmp_path / "prometheus_client").mkdir()
    (tmp_path / "prometheus_client" / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    r = subprocess.run(p2pw_argv("seed", model_dir, "--http", "127.0.0.1:0"), capture_output=True, text=True,
                       timeout=60, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == ("p2pw: error: --http needs prometheus_client: pip install "
                                                  "'p2pweights[ops]' (or pip install prometheus_client)")


def test_readyz_with_a_device_waits_for_the_device_buffer(procs, tmp_path, model_dir):
    pytest.importorskip("torch")
    _, info = procs.seeder(model_dir)
    h = free_port()
    j = procs.join(info["port"], tmp_path / "out", "--device", "cpu", "--stay", "--http", f"127.0.0.1:{h}")
    code, body = until(lambda: (lambda r: r if r[0] == 200 else None)(get(h, "/readyz")), j, what="ready")
    assert json.loads(body) == {"stage": "ready"}
    j.wait_line(r"staying to serve")  # after the stage report: every tensor on the device
    m = metrics(h)
    assert m["p2pw_ready"] == 1 and m["p2pw_received_bytes_total"] > 0


def test_status_of_a_keyed_fleet_needs_the_key(procs, tmp_path, model_dir):
    key = tmp_path / "key"
    assert subprocess.run(p2pw_argv("keygen", key), capture_output=True, timeout=60).returncode == 0
    _, info = procs.seeder(model_dir, "--key", key)
    j = procs.join(info["port"], tmp_path / "out", "--key", key)
    assert j.wait(60) == 0, j.output()
    refused = subprocess.run(p2pw_argv("status", f"127.0.0.1:{info['port']}", "--timeout", "5"),
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr.startswith("p2pw: error: ")
    assert "--key" in refused.stderr and "Traceback" not in refused.stderr
    doc = api.status(f"127.0.0.1:{info['port']}", key=keys.load(str(key)))
    assert [(p["rank"], p["progress"], p["state"]) for p in doc["peers"]] == [(1, 1.0, "left")]
