"""A fleet without --key that a stranger cannot fool: real ``p2pw tracker``, ``p2pw get`` and ``p2pw seed`` processes.

A stranger publishes over the real wire (``hostile.publish``, from other
loopback addresses).  Assertions are on the files written (none of the
stranger's), exit codes and the one error line; the registry's and the
publishers' rules are also checked alone (pure).
"""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from conftest import same_tree
from hostile import publish as stranger_publishes
from p2pweights.sources.chunker import build
from p2pweights.sources.manifest import Manifest
from p2pweights.wire.protocol import Msg
from test_fleet_get import _manifest, get, publish, start_tracker

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []

NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_CONFIG_FILE": os.devnull,
                  "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}


def strangers_model(tmp_path, like, name="stranger", same_sizes=False):
    """A model whose files have ``like``'s names: other bytes (``same_sizes``: one byte of each file flipped)."""
    from p2pweights.sources.synth import write_synthetic_model

    d = tmp_path / name
    if same_sizes:
        shutil.copytree(like, d)
        for root, _, names in os.walk(d):
            for n in names:
                with open(os.path.join(root, n), "r+b") as f:  # its last byte: tensor data, or a file's end
                    f.seek(-1, os.SEEK_END)
                    b = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([b[0] ^ 0xFF]))
    else:
        write_synthetic_model(d, size_mb=3, shards=3, seed=99)
    return d, build(d, 256 << 10)[0]


def seed(procs, path, port, manifest_path):
    """``p2pw seed PATH --tracker``, once serving (its manifest published, its reader joined)."""
    ready = f"{manifest_path}.ready"
    p = procs.start("seed", path, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", 0,
                    "--chunk-size", "256KiB", "--manifest", manifest_path, "--ready", ready)
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        assert p.popen.poll() is None and time.monotonic() < deadline, p.output()
        time.sleep(0.05)
    return p


def stranger_seeds(procs, tmp_path, path, manifest, port):
    """The stranger serves its own bytes (a seeder of its model), so a host that takes its manifest gets them."""
    mpath = tmp_path / f"{path.name}.json"
    mpath.write_text(manifest.to_json())
    return seed(procs, path, port, mpath)


def wrote_nothing_of(out, stranger, honest) -> bool:
    """Whether no file under ``out`` holds the bytes of the stranger's file of its name (where they are not the
    ``honest`` model's too)."""
    def read(path):
        return open(path, "rb").read() if os.path.exists(path) else None

    for root, _, names in os.walk(stranger):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), stranger)
            theirs = read(os.path.join(stranger, rel))
            if theirs != read(os.path.join(honest, rel)) and read(os.path.join(out, rel)) == theirs:
                return False
    return True


# ----- 1: asking by id --------------------------------------------------------------------------------------------

def test_asking_by_model_id_gets_that_model_not_one_published_under_a_url_spelled_like_it(procs, tmp_path, model_dir):
    _, port = start_tracker(procs, tmp_path)
    seed(procs, model_dir, port, _manifest(tmp_path, model_dir))
    mid = Manifest.from_json(open(_manifest(tmp_path, model_dir)).read()).model_id
    other, theirs = strangers_model(tmp_path, model_dir)
    stranger_seeds(procs, tmp_path, other, theirs, port)
    answer, s = stranger_publishes(port, mid, theirs, source="127.0.0.2")  # its manifest "for the URL" <honest id>
    s.close()
    p = get(procs, mid, port, tmp_path / "by-id", "--no-origin")
    assert p.wait(120) == 0, p.output()
    assert same_tree(model_dir, tmp_path / "by-id") == []
    assert wrote_nothing_of(tmp_path / "by-id", other, model_dir)
    assert answer is not None and answer.type == Msg.ERROR  # a model id is not an origin's URL


# ----- 2: a host with bucket credentials ---------------------------------------------------------------------------

def test_a_host_with_credentials_stores_only_the_bucket_s_bytes_whatever_strangers_publish(procs, tmp_path, model_dir):
    s3 = pytest.importorskip("test_s3")
    moto = s3.MotoServer()
    try:
        s3.upload(moto.client(), model_dir, "fleet", "model/")
        url = "s3://fleet/model"
        _, port = start_tracker(procs, tmp_path)
        other, theirs = strangers_model(tmp_path, model_dir)  # other files under the same names
        forged_dir, forged = strangers_model(tmp_path, model_dir, "forged", same_sizes=True)  # real sizes, no ETags
        stranger_seeds(procs, tmp_path, forged_dir, forged, port)  # its HELLO as a reader: "confirmed"
        stranger_seeds(procs, tmp_path, other, theirs, port)
        conns = []
        for source, m in (("127.0.0.2", theirs), ("127.0.0.3", forged)):
            answer, s = stranger_publishes(port, url, m, source=source)
            conns.append(s)
            assert answer.type == Msg.PUBLISHED
        publish(port, url, env=s3.s3_env(moto.url))  # the honest manifest comes last
        for source, m in (("127.0.0.2", theirs), ("127.0.0.3", forged)):  # and they publish again
            conns.append(stranger_publishes(port, url, m, source=source)[1])
        for s in conns:
            s.close()
        honest = get(procs, url, port, tmp_path / "honest", env=s3.s3_env(moto.url))
        blind = get(procs, url, port, tmp_path / "blind", "--connect-timeout", "5",
                    env=dict(NO_CREDENTIALS, AWS_ENDPOINT_URL=moto.url))
        assert honest.wait(120) == 0, honest.output()
        assert same_tree(model_dir, tmp_path / "honest") == []
        assert blind.wait(120) == 1, blind.output()
        errors = [line for line in blind.output().splitlines() if line.startswith("p2pw: error:")]
        assert len(errors) == 1 and "not one this host can trust" in errors[0] and "--model-id" in errors[0]
        for out in ("honest", "blind"):
            assert wrote_nothing_of(tmp_path / out, other, model_dir)
            assert wrote_nothing_of(tmp_path / out, forged_dir, model_dir)
        assert not os.path.exists(tmp_path / "blind" / "config.json")
    finally:
        moto.close()


def test_a_local_origin_with_a_forged_manifest_of_the_right_sizes_is_refused_not_taken_from_peers(procs, tmp_path,
                                                                                                    model_dir):
    _, port = start_tracker(procs, tmp_path)
    forged_dir, forged = strangers_model(tmp_path, model_dir, "forged", same_sizes=True)
    stranger_seeds(procs, tmp_path, forged_dir, forged, port)
    answer, s = stranger_publishes(port, str(model_dir), forged, source="127.0.0.2")
    s.close()
    assert answer.type == Msg.PUBLISHED
    p = get(procs, model_dir, port, tmp_path / "out", "--connect-timeout", "5")
    assert p.wait(120) == 1, p.output()
    errors = [line for line in p.output().splitlines() if line.startswith("p2pw: error:")]
    assert len(errors) == 1 and "describes the origin" in errors[0]
    assert wrote_nothing_of(tmp_path / "out", forged_dir, model_dir)


def test_a_manifest_with_the_bucket_s_etags_and_another_chunk_hash_fails_the_get_at_that_chunk(procs, tmp_path,
                                                                                                 model_dir):
    import subprocess

    from conftest import ROOT, p2pw_argv

    s3 = pytest.importorskip("test_s3")
    moto = s3.MotoServer()
    try:
        s3.upload(moto.client(), model_dir, "fleet", "model/")
        url = "s3://fleet/model"
        r = subprocess.run(p2pw_argv("manifest", url, "--chunk-size", "256KiB", "-o", tmp_path / "real.json"),
                           capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ,
                                                                                          **s3.s3_env(moto.url)))
        assert r.returncode == 0, r.stderr
        real = Manifest.from_json((tmp_path / "real.json").read_text())
        chunks = list(real.chunks)
        chunks[-1] = f"{int(chunks[-1], 16) ^ 1:016x}"  # the last chunk's hash: not the bucket's bytes
        forged = Manifest(real.total_size, real.chunk_size, chunks, real.files, real.tensors, real.hash)
        answer, s = stranger_publishes(port := start_tracker(procs, tmp_path)[1], url, forged, source="127.0.0.2")
        s.close()
        assert answer.type == Msg.PUBLISHED
        publish(port, url, env=s3.s3_env(moto.url))  # the honest one comes second
        p = get(procs, url, port, tmp_path / "out", env=s3.s3_env(moto.url))
        assert p.wait(120) == 1, p.output()
        errors = [line for line in p.output().splitlines() if line.startswith("p2pw: error:")]
        assert len(errors) == 1 and "is not the manifest's" in errors[0], p.output()
    finally:
        moto.close()


# ----- 3: a pinned host --------------------------------------------------------------------------------------------

def test_a_host_pinned_to_a_model_id_gets_it_after_a_stranger_republished_the_url(procs, tmp_path, model_dir):
    _, port = start_tracker(procs, tmp_path)
    seed(procs, model_dir, port, _manifest(tmp_path, model_dir))
    mid = Manifest.from_json(open(_manifest(tmp_path, model_dir)).read()).model_id
    other, theirs = strangers_model(tmp_path, model_dir)
    stranger_seeds(procs, tmp_path, other, theirs, port)
    answer, s = stranger_publishes(port, str(model_dir), theirs, source="127.0.0.2")
    s.close()
    assert answer.type == Msg.PUBLISHED
    p = get(procs, model_dir, port, tmp_path / "pinned", "--model-id", mid, "--no-origin")
    assert p.wait(120) == 0, p.output()
    assert same_tree(model_dir, tmp_path / "pinned") == []


# ----- what a host trusts where it cannot read the origin ---------------------------------------------------------

def test_a_keyed_fleet_s_host_without_the_origin_takes_the_tracker_s_manifest(procs, tmp_path, model_dir):
    import subprocess

    from conftest import ROOT, p2pw_argv

    key = tmp_path / "key"
    assert subprocess.run(p2pw_argv("keygen", key), capture_output=True, timeout=60, cwd=ROOT).returncode == 0
    ready = tmp_path / "t.ready"
    t = procs.start("tracker", "--port", 0, "--host", "127.0.0.1", "--ready", ready, "--key", key)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert t.popen.poll() is None and time.monotonic() < deadline, t.output()
        time.sleep(0.05)
    port = json.loads(ready.read_text())["port"]
    procs.start("seed", model_dir, "--tracker", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", 0,
                "--chunk-size", "256KiB", "--key", key)
    p = get(procs, model_dir, port, tmp_path / "keyed", "--no-origin", "--key", key)
    assert p.wait(120) == 0, p.output()
    assert same_tree(model_dir, tmp_path / "keyed") == []


def test_an_unkeyed_host_that_does_not_read_the_origin_and_has_no_id_is_refused_in_one_line(procs, tmp_path,
                                                                                             model_dir):
    _, port = start_tracker(procs, tmp_path)
    publish(port, model_dir)
    p = get(procs, model_dir, port, tmp_path / "out", "--no-origin")
    assert p.wait(60) == 1, p.output()
    errors = [line for line in p.output().splitlines() if line.startswith("p2pw: error:")]
    assert errors == [(f"p2pw: error: the manifest of {model_dir} published at 127.0.0.1:{port} is not one this "
                       "host can trust: give --model-id ID, credentials to read the origin, or --key")]
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


# ----- 6: strangers fill the table ---------------------------------------------------------------------------------

def tiny(k: int) -> Manifest:
    return Manifest(total_size=5, chunk_size=4096, chunks=[f"{k:016x}"], files=[{"name": f"m{k}.json", "offset": 0,
                                                                                   "size": 5}])


def test_strangers_swarms_from_four_addresses_leave_room_for_the_operator_s_publish(procs, tmp_path, model_dir):
    import zmq

    _, port = start_tracker(procs, tmp_path)
    ctx, conns, answers = zmq.Context(), [], []
    try:
        for k in range(256):  # each swarm kept by a member of its own: 64 connections from each of 4 addresses
            answer, s = stranger_publishes(port, f"s3://strangers/m{k}", tiny(k), source=f"127.0.0.{2 + k % 4}",
                                           hello=True, ctx=ctx)
            conns.append(s)
            answers.append(answer.type if answer is not None else None)
        r = publish(port, model_dir)  # the operator's p2pw manifest --tracker
        assert "published the manifest" in r.stdout
        assert answers.count(Msg.WELCOME) == 64 and answers.count(Msg.ERROR) == 256 - 64  # 16 swarms an address
    finally:
        for s in conns:
            s.close()
        ctx.term()


def test_a_tracker_with_publish_from_refuses_a_stranger_s_publish_and_takes_the_operator_s(procs, tmp_path,
                                                                                             model_dir):
    ready = tmp_path / "t.ready"
    t = procs.start("tracker", "--port", 0, "--host", "127.0.0.1", "--ready", ready, "--publish-from", "127.0.0.1/32")
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert t.popen.poll() is None and time.monotonic() < deadline, t.output()
        time.sleep(0.05)
    port = json.loads(ready.read_text())["port"]
    answer, s = stranger_publishes(port, str(model_dir), tiny(1), source="127.0.0.2")
    s.close()
    assert answer.type == Msg.ERROR and "may not publish" in answer.fields["message"]
    publish(port, model_dir)


# ----- 13: a manifest over 1 MiB -----------------------------------------------------------------------------------

def test_a_publish_of_a_manifest_over_one_mib_reaches_the_tracker(procs, tmp_path):
    from p2pweights.origin import lookup
    from p2pweights.origin import publish as publish_over_wire

    n = 80_000
    m = Manifest(total_size=n * 4096, chunk_size=4096, chunks=[f"{k:016x}" for k in range(n)],
                 files=[{"name": "w.bin", "offset": 0, "size": n * 4096}])
    assert len(m.wire_bytes()) > 1 << 20
    _, port = start_tracker(procs, tmp_path)
    assert publish_over_wire(f"127.0.0.1:{port}", "s3://b/big", m, timeout=20) == m.model_id
    assert lookup(f"127.0.0.1:{port}", "s3://b/big", timeout=20).model_id == m.model_id


# ----- the rules alone ---------------------------------------------------------------------------------------------

def registry(**kw):
    from p2pweights.swarm.tracker.registry import Registry
    from p2pweights.swarm.tracker.topology import make

    return Registry(lambda n: make("forest:2"), **kw)


def answer(reg, ident):
    from p2pweights.wire import protocol

    return protocol.decode_header(bytes([f for i, f in reg.take() if i == ident][-1][0]))


def published(reg, url, m, source="10.0.0.9", operator=False) -> str:
    ident = b"c" + os.urandom(4)
    reg.publish(ident, {"url": url}, m.wire_bytes(), source, operator)
    event = answer(reg, ident)
    return event.type.name if event.type == Msg.PUBLISHED else event.fields["message"]


def looked_up(reg, **f):
    reg.lookup(b"asker", f)
    event = answer(reg, b"asker")
    return event.fields if event.type == Msg.MANIFEST else None


def test_a_url_keeps_every_candidate_first_come_and_a_confirmed_one_first():
    reg = registry()
    assert published(reg, "u", tiny(1), "10.0.0.1") == "PUBLISHED"
    assert published(reg, "u", tiny(2), "10.0.0.2") == "PUBLISHED"
    assert [looked_up(reg, url="u", index=i)["model_id"] for i in (0, 1)] == [tiny(1).model_id, tiny(2).model_id]
    assert looked_up(reg, url="u")["count"] == 2
    reg.hello(b"reader", {"peer_id": "r", "listen": "10.0.0.2:9", "model_id": tiny(2).model_id, "origin": True})
    assert looked_up(reg, url="u") == {"url": "u", "model_id": tiny(2).model_id, "index": 0, "count": 2,
                                       "confirmed": True}
    assert looked_up(reg, url="u", model_id=tiny(1).model_id)["model_id"] == tiny(1).model_id  # pinned
    assert looked_up(reg, url=tiny(1).model_id)["model_id"] == tiny(1).model_id  # an id: ids only
    assert looked_up(reg, url="0" * 64) is None


def test_a_url_spelled_as_a_model_id_is_refused_and_one_address_holds_few_candidates_of_a_url():
    reg = registry()
    assert "is a model id" in published(reg, tiny(1).model_id, tiny(2))
    for k in range(5):
        assert published(reg, "u", tiny(k), "10.0.0.1") == "PUBLISHED"
    assert looked_up(reg, url="u")["count"] == 2  # its own oldest made way
    reg.hello(b"r", {"peer_id": "r", "listen": "10.0.0.2:9", "model_id": tiny(3).model_id, "origin": True})
    reg.hello(b"q", {"peer_id": "q", "listen": "10.0.0.2:9", "model_id": tiny(4).model_id, "origin": True})
    assert "each confirmed" in published(reg, "u", tiny(9), "10.0.0.1")  # confirmed ones are never replaced
    for k in range(10, 20):
        published(reg, "u", tiny(k), f"10.0.1.{k}")
    cands = reg.candidates("u")
    assert len(cands) == 8 and {c.model_id for c in cands[:2]} == {tiny(3).model_id, tiny(4).model_id}


def test_the_table_makes_room_with_an_unproven_swarm_first_and_caps_swarms_per_address():
    reg = registry(max_swarms=3, max_opened=2)
    assert published(reg, "a", tiny(1), "10.0.0.1") == "PUBLISHED"
    assert published(reg, "b", tiny(2), "10.0.0.1") == "PUBLISHED"
    assert "at most 2" in published(reg, "c", tiny(3), "10.0.0.1")
    reg.hello(b"r", {"peer_id": "r", "listen": "10.0.0.2:9", "model_id": tiny(1).model_id, "origin": True})
    reg.hello(b"m", {"peer_id": "m", "listen": "10.0.0.3:9", "model_id": tiny(2).model_id})  # live, unproven
    assert published(reg, "c", tiny(3), "10.0.0.4", operator=True) == "PUBLISHED"
    assert published(reg, "d", tiny(4), "10.0.0.5") == "PUBLISHED"  # the unproven one (2) made room
    assert sorted(reg.swarms) == sorted(m.model_id for m in (tiny(1), tiny(3), tiny(4)))
    reg.hello(b"s", {"peer_id": "s", "listen": "10.0.0.3:9", "model_id": tiny(4).model_id, "origin": True})
    assert "no room" in published(reg, "e", tiny(5), "10.0.0.6")  # the operator's (3) makes room for nobody else
    assert published(reg, "e", tiny(5), "10.0.0.4", operator=True) == "PUBLISHED"


def test_publish_from_takes_ips_and_cidrs_and_refuses_other_addresses():
    from p2pweights.errors import UserError
    from p2pweights.swarm.tracker.publishers import Publishers

    p = Publishers.parse("10.0.0.5, 10.1.0.0/16")
    assert p.allows("10.0.0.5") and p.allows("10.1.2.3") and p.operator("::ffff:10.1.2.3")
    assert not p.allows("10.0.0.6") and not p.allows("junk")
    assert Publishers.parse(None).allows("1.2.3.4") and not Publishers.parse(None).operator("1.2.3.4")
    with pytest.raises(UserError):
        Publishers.parse("10.0.0.0/33")


def test_the_agent_walks_past_a_strangers_manifest_to_the_one_its_origin_holds(procs, tmp_path, model_dir):
    """An unkeyed agent pre-warming a local origin (``--local-root``) checks each candidate the tracker lists for
    the URL: the stranger's forged one (first come, the real sizes) is passed over; its clients get the origin's
    bytes."""
    from test_agent import agent, status, until
    from test_fleet_get import published_id

    _, port = start_tracker(procs, tmp_path)
    forged_dir, forged = strangers_model(tmp_path, model_dir, "forged", same_sizes=True)
    answer, s = stranger_publishes(port, str(model_dir), forged, source="127.0.0.2")
    s.close()
    assert answer.type == Msg.PUBLISHED
    honest = published_id(publish(port, model_dir))  # the honest manifest comes second
    cache, prewarm = tmp_path / "cache", tmp_path / "prewarm.txt"
    prewarm.write_text(f"{model_dir}\n")
    a = agent(procs, tmp_path, port, cache, "--local-root", model_dir, "--prewarm", prewarm)
    assert until(lambda: status(cache).get(honest, {}).get("state") == "ready", proc=a)
    g = procs.start("get", honest, "--agent", cache, "--out", tmp_path / "out", "-q")
    assert g.wait(120) == 0, g.output()
    assert same_tree(model_dir, tmp_path / "out") == []


def test_an_unkeyed_agent_that_can_check_nothing_refuses_the_url(procs, tmp_path, model_dir):
    from test_agent import agent

    _, port = start_tracker(procs, tmp_path)
    publish(port, model_dir)
    cache = tmp_path / "cache"
    prewarm = tmp_path / "prewarm.txt"
    prewarm.write_text(f"{model_dir}\n")
    a = agent(procs, tmp_path, port, cache, "--prewarm", prewarm)  # no --local-root: it reads no local origin
    deadline = time.monotonic() + 60
    while "not one this host can trust" not in a.output():
        assert time.monotonic() < deadline, a.output()
        time.sleep(0.05)
    assert not os.path.exists(cache / "models") or not os.listdir(cache / "models")
