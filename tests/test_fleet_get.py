"""A fleet with no seeder: real ``p2pw tracker``, ``p2pw get`` and ``p2pw seed --tracker`` processes.

The origin is the real S3 server the S3 tests use (moto, on loopback), behind a
proxy that records every ranged GET, or a local directory.  Assertions are on
bytes, exit codes and counts, never on time; every process a test starts is
ended by PID in teardown (the ``procs`` fixture), pass or fail.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import same_tree
from hostile import Stranger
from p2pweights.sources.manifest import Manifest
from p2pweights.wire.protocol import Msg

CHUNK = "256KiB"
pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []


def start_tracker(procs, tmp_path, port=0, name="tracker"):
    """``p2pw tracker`` on 127.0.0.1 (a free port unless given); the process and its port."""
    ready = tmp_path / f"{name}.ready"
    p = procs.start("tracker", "--port", port, "--host", "127.0.0.1", "--ready", ready)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.popen.poll() is None and time.monotonic() < deadline, f"tracker did not start:\n{p.output()}"
        time.sleep(0.05)
    return p, json.loads(ready.read_text())["port"]


def get(procs, url, port, out, *extra, env=None):
    return procs.start("get", url, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--out", out, "-q",
                       "--report", f"{out}.json", *extra, env=env)


def report(out) -> dict:
    return json.loads(open(f"{out}.json").read())


def publish(port, path, *extra, env=None):
    from conftest import ROOT, p2pw_argv
    import subprocess

    r = subprocess.run(p2pw_argv("manifest", path, "--chunk-size", CHUNK, "--tracker", f"127.0.0.1:{port}",
                                 *extra), capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, **(env or {})))
    assert r.returncode == 0, r.stderr
    return r


def published_id(r) -> str:
    """The model id ``p2pw manifest --tracker`` says it published."""
    return r.stdout.split("(model id ")[1].split(")")[0]


def size_of(root) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root) for n in names)


# ----- object storage: two readers, and a host without credentials ---------------------------------------------

def test_two_readers_read_each_byte_once_and_a_host_without_credentials_completes(procs, tmp_path, model_dir):
    s3 = pytest.importorskip("test_s3")
    moto = s3.MotoServer()
    proxy = None
    try:
        bucket = "fleet"
        s3.upload(moto.client(), model_dir, bucket, "model/")
        url = f"s3://{bucket}/model"
        _, port = start_tracker(procs, tmp_path)
        mid = published_id(publish(port, url, env=s3.s3_env(moto.url)))  # straight to the server: not counted below
        proxy = s3.FaultProxy(moto.port, [])  # records every ranged GET the readers make
        readers = [get(procs, url, port, tmp_path / f"r{k}", "--s3-range-size", "1MiB", env=s3.s3_env(proxy.url))
                   for k in range(2)]
        blind = get(procs, url, port, tmp_path / "blind", "--model-id", mid, env={  # trusts the id it is given
            "AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true"})
        for p in (*readers, blind):
            assert p.wait(120) == 0, p.output()
        for name in ("r0", "r1", "blind"):
            assert same_tree(model_dir, tmp_path / name) == []
        ranges = [(path, rng) for path, rng, _ in proxy.gets]
        assert len(ranges) == len(set(ranges))  # no byte range of any object read twice
        spans = [tuple(map(int, rng.removeprefix("bytes=").split("-"))) for _, rng in ranges]
        assert sum(b - a + 1 for a, b in spans) == size_of(model_dir)  # every byte of the bucket, once
        reads = [report(tmp_path / n) for n in ("r0", "r1", "blind")]
        assert [r["origin_reader"] for r in reads] == [True, True, False]
        assert reads[0]["origin_bytes_read"] + reads[1]["origin_bytes_read"] == size_of(model_dir)
        assert reads[2]["origin_bytes_read"] == 0 and reads[2]["bad_chunks"] == 0
        assert "not reading the origin" in blind.output()
    finally:
        if proxy is not None:
            proxy.close()
        moto.close()


# ----- a tracker restarted mid-broadcast --------------------------------------------------------------------------

def progress(out) -> dict:
    try:
        return json.loads((out / ".p2pw" / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_tracker_restarted_mid_broadcast_loses_nobody(procs, tmp_path):
    from p2pweights.sources.synth import write_synthetic_model

    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=8, shards=2)
    tracker, port = start_tracker(procs, tmp_path)
    mid = published_id(publish(port, model))
    # one seeder reads the origin, slowly (each chunk it sends waits 150 ms); two hosts take it from the swarm
    seeder = procs.start("seed", model, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", 0,
                         "--chunk-size", CHUNK, env={"P2PW_FAULTS": "delay_send=150"})  # the manifest published
    joined = [get(procs, model, port, tmp_path / f"p{k}", "--no-origin", "--model-id", mid) for k in range(2)]
    deadline = time.monotonic() + 60
    while not progress(tmp_path / "p0").get("bytes"):
        assert time.monotonic() < deadline and joined[0].popen.poll() is None, (joined[0].output(), seeder.output())
        time.sleep(0.1)
    assert joined[0].popen.poll() is None  # mid-broadcast: chunks arrived, the copy is not complete
    os.kill(tracker.pid, signal.SIGKILL)
    tracker.popen.wait(10)
    start_tracker(procs, tmp_path, port=port, name="tracker2")  # empty: rebuilt from the members
    late = get(procs, model, port, tmp_path / "late", "--no-origin", "--model-id", mid)  # published again by members
    for p in (*joined, late):
        assert p.wait(150) == 0, p.output()
    for name in ("p0", "p1", "late"):
        assert same_tree(model, tmp_path / name) == []
        assert report(tmp_path / name)["bad_chunks"] == 0
    assert seeder.popen.poll() is None  # still serving; ended by the fixture


# ----- three models at once ------------------------------------------------------------------------------------

def test_a_tracker_serving_three_models_keeps_their_swarms_apart(procs, tmp_path):
    from p2pweights.sources.synth import write_synthetic_model

    _, port = start_tracker(procs, tmp_path)
    models = []
    for k in range(3):
        write_synthetic_model(tmp_path / f"model{k}", size_mb=4 + k, shards=2, seed=k)  # no chunk alike
        models.append(tmp_path / f"model{k}")
        procs.start("seed", models[k], "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", 0,
                    "--chunk-size", CHUNK, "--manifest", _manifest(tmp_path, models[k]))
    ids = [Manifest.from_json(open(_manifest(tmp_path, m)).read()).model_id for m in models]
    gets = [(k, j, get(procs, models[k], port, tmp_path / f"m{k}-{j}",
                       *(["--no-origin", "--model-id", ids[k]] if j else [])))  # one checks the origin, one the id
            for k in range(3) for j in range(2)]
    for k, j, p in gets:
        assert p.wait(120) == 0, p.output()
        out = tmp_path / f"m{k}-{j}"
        assert same_tree(models[k], out) == []
        r = report(out)
        # Another model's chunk fails this one's hash (the models share no bytes). A duplicate (a re-request
        # after a stall under load) is the swarm's own chunk, so it says nothing here.
        assert r["bad_chunks"] == 0  # no chunk of another model ever arrived
        assert r["model_id"] == Manifest.from_json(open(_manifest(tmp_path, models[k])).read()).model_id
    s = Stranger(port)
    try:
        s.send(Msg.STATUS)
        doc = json.loads(bytes(s.answer(10).payload))
        assert sorted(len(w["urls"]) for w in doc["swarms"]) == [1, 1, 1]
    finally:
        s.close()


def test_a_host_asks_by_model_id_alone_and_gets_the_swarm_s_manifest(procs, tmp_path, model_dir):
    _, port = start_tracker(procs, tmp_path)
    procs.start("seed", model_dir, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", 0,
                "--chunk-size", CHUNK, "--manifest", _manifest(tmp_path, model_dir))
    mid = Manifest.from_json(open(_manifest(tmp_path, model_dir)).read()).model_id
    for k, name in enumerate((mid, mid.upper())):  # published under its path; asked by the id it has
        p = get(procs, name, port, tmp_path / f"by-id{k}", "--no-origin")
        assert p.wait(120) == 0, p.output()
        assert same_tree(model_dir, tmp_path / f"by-id{k}") == [] and report(tmp_path / f"by-id{k}")["model_id"] == mid
    p = get(procs, "0" * 64, port, tmp_path / "unknown", "--connect-timeout", "1")
    assert p.wait(60) == 1 and p.output().count("p2pw: error:") == 1


def _manifest(tmp_path, model) -> str:
    path = tmp_path / f"{model.name}.manifest.json"
    if not path.exists():
        from p2pweights.sources.chunker import build

        path.write_text(build(model, 256 << 10)[0].to_json())
    return str(path)


# ----- hostile input at the tracker -------------------------------------------------------------------------------

def test_the_tracker_survives_malformed_new_messages(procs, tmp_path):
    tracker, port = start_tracker(procs, tmp_path)
    s = Stranger(port)
    try:
        s.raw(b"P2W\x01" + bytes([int(Msg.PUBLISH)]) + b'{"url": "s3://b/m"}', b"{not a manifest")
        assert s.answer().type == Msg.ERROR
        for kind, fields in ((Msg.READ, {"chunks": [1]}), (Msg.LOOKUP, {"url": ""}), (Msg.READ, {"chunks": "x"}),
                             (Msg.SHARE, {"chunks": [1]}), (Msg.HELLO, {"peer_id": "p", "listen": "127.0.0.1:9",
                                                                        "model_id": "ab" * 32, "origin": 1})):
            s.send(kind, **fields)
        s2 = Stranger(port)
        try:
            assert s2.ask(Msg.LOOKUP, url="s3://b/m").type == Msg.ERROR  # still answering others: nothing published
        finally:
            s2.close()
        assert tracker.popen.poll() is None
    finally:
        s.close()
