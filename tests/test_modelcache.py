"""Model cache: eviction and failure policies (pure, fake clock), and the cache through real seeders and joins."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, left_everywhere, p2pw_argv, same_tree
from p2pweights.storage.modelcache import Entry, EvictionPolicy, FailurePolicy, ModelCache
from p2pweights.sources.synth import write_synthetic_model

HOUR = 3600.0
MiB = 1 << 20


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


# ----- EvictionPolicy ------------------------------------------------------------------------------


def test_frequent_model_outlives_a_more_recent_one_unlike_lru():
    clock = Clock()
    now = clock.t
    busy = Entry("a" * 64, 10 * MiB, uses=[now - 5 * HOUR, now - 4 * HOUR, now - 3 * HOUR, now - 2 * HOUR],
                 fetch_seconds=5.0)
    once = Entry("b" * 64, 10 * MiB, uses=[now - 0.1 * HOUR], fetch_seconds=5.0)
    p = EvictionPolicy(clock, half_life=24 * HOUR)
    assert p.victims([busy, once], incoming=10 * MiB, budget=20 * MiB) == [once]  # LRU would take busy


def test_costly_refetch_is_kept_over_cheap_one_used_as_often():
    clock = Clock()
    now = clock.t
    far = Entry("c" * 64, 10 * MiB, uses=[now - HOUR], fetch_seconds=120.0)
    near = Entry("d" * 64, 10 * MiB, uses=[now - 2 * HOUR], fetch_seconds=0.5)
    near_recent = Entry("d" * 64, 10 * MiB, uses=[now - 0.5 * HOUR], fetch_seconds=0.5)
    p = EvictionPolicy(clock)
    assert p.victims([far, near], 10 * MiB, 20 * MiB) == [near]
    assert p.victims([far, near_recent], 10 * MiB, 20 * MiB) == [near_recent]  # recency does not save it


def test_size_weighs_per_byte_and_unmeasured_fetches_cost_by_size():
    clock = Clock()
    now = clock.t
    p = EvictionPolicy(clock, rate=100e6)
    small = Entry("e" * 64, 1 * MiB, uses=[now - HOUR], fetch_seconds=10.0)
    big = Entry("f" * 64, 100 * MiB, uses=[now - HOUR], fetch_seconds=10.0)
    assert p.score(small) > p.score(big)  # same refetch time, far more value per byte kept
    unmeasured = Entry("9" * 64, 100 * MiB, uses=[now])
    assert p.refetch_cost(unmeasured) == pytest.approx(100 * MiB / 100e6)
    clock.t += 24 * HOUR
    assert p.reuse(unmeasured) == pytest.approx(0.5)  # one use, one half-life ago


def test_never_evicts_in_use_or_incomplete_and_says_when_it_cannot():
    clock = Clock()
    now = clock.t
    p = EvictionPolicy(clock)
    cold_in_use = Entry("1" * 64, 10 * MiB, uses=[now - 100 * HOUR], in_use=True)
    partial = Entry("2" * 64, 10 * MiB, uses=[], complete=False)
    warm = Entry("3" * 64, 10 * MiB, uses=[now, now, now], fetch_seconds=60)
    external = Entry("4" * 64, 50 * MiB, uses=[], owned=False)  # an --out copy: not counted, never evicted
    assert p.victims([cold_in_use, partial, warm, external], 10 * MiB, 40 * MiB) == []
    assert p.victims([cold_in_use, partial, warm, external], 10 * MiB, 30 * MiB) == [warm]
    assert p.victims([cold_in_use, partial, warm, external], 10 * MiB, 20 * MiB) is None


def test_failure_backoff_doubles_and_is_capped():
    clock = Clock()
    f = FailurePolicy(clock, base=60, cap=300)
    rec = None
    waits = []
    for _ in range(5):
        rec = f.failed(rec, "disk", "not enough disk")
        waits.append(rec["until"] - clock.t)
    assert waits == [60, 120, 240, 300, 300] and rec["count"] == 5
    assert f.blocks(rec)
    clock.t += 299
    assert f.blocks(rec)
    clock.t += 2
    assert not f.blocks(rec)


# ----- through real processes ----------------------------------------------------------------------


def run(*args, env, timeout=120):
    return subprocess.run(p2pw_argv(*args), capture_output=True, text=True, env=dict(os.environ, **env), cwd=ROOT,
                          timeout=timeout)


def join(port, *args, env, timeout=120):
    return run("join", "--parent", f"127.0.0.1:{port}", "--host", "127.0.0.1", "-q", *args, env=env,
               timeout=timeout)


@pytest.fixture
def cache_env(tmp_path):
    root = tmp_path / "p2pw-cache"
    return {"P2PW_CACHE_DIR": str(root)}, root  # overrides of this process's environment


def test_join_without_out_keeps_the_copy_in_the_cache_and_a_second_join_fetches_nothing(procs, tmp_path, cache_env):
    env, root = cache_env
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=2, shards=2)
    seeder, info = procs.seeder(model, env=env)
    mid = info["model_id"]
    r = join(info["port"], "--model-id", mid, "--report", tmp_path / "r1.json", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    copy = root / "models" / mid
    assert r.stdout.strip().splitlines()[-1] == str(copy)
    assert same_tree(model, copy) == []
    assert json.loads((tmp_path / "r1.json").read_text())["received"] > 0

    # pinned: answered from the marker, nobody asked (the seeder is gone)
    seeder.popen.terminate()
    seeder.wait(30)
    r = join(info["port"], "--model-id", mid, "--report", tmp_path / "r2.json", "--connect-timeout", "1", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "fetched nothing" in r.stdout and r.stdout.strip().splitlines()[-1] == str(copy)
    assert json.loads((tmp_path / "r2.json").read_text())["received"] == 0

    # not pinned: asks the seeder which model, then serves the complete copy without fetching a chunk
    seeder, info = procs.seeder(model, env=env)
    r = join(info["port"], "--report", tmp_path / "r3.json", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    rep = json.loads((tmp_path / "r3.json").read_text())
    assert rep["received"] == 0 and rep["path"] == str(copy)
    rec = ModelCache(str(root)).record(mid)
    assert len(rec["uses"]) == 3 and rec["fetch_seconds"] > 0


def test_an_out_dir_the_cache_knows_is_used_by_a_later_join(procs, tmp_path, cache_env):
    env, root = cache_env
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=1, shards=1)
    _, info = procs.seeder(model, env=env)
    out = tmp_path / "mine"
    assert join(info["port"], "--out", out, "--model-id", info["model_id"], env=env).returncode == 0
    r = join(info["port"], "--model-id", info["model_id"], env=env)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == str(out), r.stderr
    assert not (root / "models" / info["model_id"]).exists()
    r = run("cache", "ls", env=env)
    assert info["model_id"][:16] in r.stdout and "--out" in r.stdout, r.stdout


def test_stay_on_a_complete_copy_serves_peers_from_it(procs, tmp_path, cache_env):
    env, root = cache_env
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=2, shards=2)
    _, info = procs.seeder(model, env=env)
    assert join(info["port"], "--model-id", info["model_id"], env=env).returncode == 0
    stay = procs.start("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--stay",
                       "--model-id", info["model_id"], "--report", tmp_path / "stay.json", env=env)
    stay.wait_line("staying to serve")
    assert json.loads((tmp_path / "stay.json").read_text())["received"] == 0
    # the staying peer holds its copy: the cache will not evict it
    assert [e.in_use for e in ModelCache(str(root)).entries()] == [True]
    other = dict(env, P2PW_CACHE_DIR=str(tmp_path / "other-cache"))
    r = join(info["port"], "--model-id", info["model_id"], "--out", tmp_path / "third", env=other)
    assert r.returncode == 0, r.stderr
    assert same_tree(model, tmp_path / "third") == []


def seed_and_fetch(procs, tmp_path, env, name, seed, size_mb=1.0):
    model = tmp_path / name
    write_synthetic_model(model, size_mb=size_mb, shards=1, seed=seed)
    seeder, info = procs.seeder(model, env=env)
    return seeder, info


def test_eviction_under_a_small_size_removes_what_the_score_says_never_one_in_use(procs, tmp_path, cache_env):
    env, root = cache_env
    ids, seeders = {}, {}
    for name, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
        seeders[name], info = seed_and_fetch(procs, tmp_path, env, name, seed)
        ids[name] = (info["port"], info["model_id"])
    size = sum(os.path.getsize(tmp_path / "a" / n) for n in os.listdir(tmp_path / "a"))
    budget = str(int(size * 2.5))  # room for two models
    env = dict(env, P2PW_CACHE_SIZE=budget)
    port, mid = ids["a"]
    assert join(port, "--model-id", mid, env=env).returncode == 0
    for _ in range(3):  # a is used again and again (from the cache), then b is fetched: LRU would evict a
        assert "fetched nothing" in join(port, "--model-id", mid, env=env).stdout
    port, mid = ids["b"]
    assert join(port, "--model-id", mid, env=env).returncode == 0

    cache = ModelCache(str(root), size=int(budget))
    expected = cache.eviction.victims(cache.entries(), size, int(budget))
    assert len(expected) == 1
    port, mid = ids["c"]
    r = join(port, "--model-id", mid, env=env)
    assert r.returncode == 0, r.stderr
    kept = {ids["a"][1], ids["b"][1]} - {expected[0].model_id}
    assert sorted(os.listdir(root / "models")) == sorted(kept | {ids["c"][1]})  # exactly the policy's victim
    if expected[0].model_id == ids["a"][1]:  # measured fetch times made a cheaper to refetch than b: fetch it back
        assert join(ids["a"][0], "--model-id", ids["a"][1], env=env).returncode == 0

    # a seeder serving a's cached copy holds it: d's join must evict the other one, whatever the score says
    a_copy = root / "models" / ids["a"][1]
    holder, _ = procs.seeder(a_copy, env=env)
    assert [e.in_use for e in ModelCache(str(root)).entries() if e.model_id == ids["a"][1]] == [True]
    other = next(m for m in os.listdir(root / "models") if m != ids["a"][1])
    for _ in range(3):
        assert "fetched nothing" in join(ids["c"][0], "--model-id", other, env=env).stdout
    port, mid = ids["d"]
    r = join(port, "--model-id", mid, env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(root / "models")) == sorted([ids["a"][1], ids["d"][1]])
    assert same_tree(tmp_path / "a", a_copy) == []

    # nothing evictable: b cannot be joined under this size while a and d are in use
    holder2, _ = procs.seeder(root / "models" / ids["d"][1], env=env)
    port, mid = ids["b"]
    r = join(port, "--model-id", mid, env=env)
    assert r.returncode == 1 and r.stderr.count("p2pw: error:") == 1 and "in use" in r.stderr, r.stderr


def test_cache_ls_rm_gc(procs, tmp_path, cache_env):
    env, root = cache_env
    ids = []
    for name, seed in (("a", 1), ("b", 2)):
        _, info = seed_and_fetch(procs, tmp_path, env, name, seed)
        assert join(info["port"], "--model-id", info["model_id"], env=env).returncode == 0
        ids.append(info["model_id"])
    r = run("cache", "ls", env=env)
    assert r.returncode == 0 and all(m[:16] in r.stdout for m in ids), r.stdout
    r = run("cache", "rm", ids[0][:8], env=env)
    assert r.returncode == 0 and str(root / "models" / ids[0]) in r.stdout, r.stderr
    assert not (root / "models" / ids[0]).exists()
    r = run("cache", "rm", "ffffffff", env=env)
    assert r.returncode == 1 and r.stderr.startswith("p2pw: error:") and "no model" in r.stderr
    (root / "models" / "stray-partial").mkdir()
    size = sum(os.path.getsize(tmp_path / "b" / n) for n in os.listdir(tmp_path / "b"))
    r = run("cache", "gc", "--cache-size", str(size // 2), env=env)
    assert r.returncode == 0, r.stderr
    assert "evicted " + ids[1][:16] in r.stdout and "stray-partial" in r.stdout
    assert os.listdir(root / "models") == []
    assert "0 copies" in run("cache", "ls", env=env).stdout


def test_failures_that_repeat_are_not_retried_within_the_backoff(procs, tmp_path, cache_env):
    env, root = cache_env
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=1, shards=1)
    seeder, info = procs.seeder(model, env=env)
    port, mid = info["port"], info["model_id"]

    # refused: the seeder serves another model
    wrong = "0123456789abcdef"
    r = join(port, "--model-id", wrong, env=env)
    assert r.returncode == 1 and "mismatch" in r.stderr
    # not enough disk: the model is larger than the whole cache
    r = join(port, "--model-id", mid, "--cache-size", "4096", env=env)
    assert r.returncode == 1 and "not enough disk" in r.stderr, r.stderr
    assert not (root / "models" / mid).exists()

    seeder.popen.terminate()
    seeder.wait(30)  # nobody to ask: a remembered failure answers at once
    for wanted, reason in ((wrong, "mismatch"), (mid, "not enough disk")):
        r = join(port, "--model-id", wanted, "--connect-timeout", "1", env=env)
        assert r.returncode == 1 and r.stderr.count("p2pw: error:") == 1, r.stderr
        assert reason in r.stderr and "remembered" in r.stderr and "--retry-now" in r.stderr, r.stderr
        r = join(port, "--model-id", wanted, "--connect-timeout", "1", "--retry-now", env=env)
        assert r.returncode == 1 and "no answer" in r.stderr, r.stderr
    r = run("cache", "ls", env=env)
    assert "not retried until" in r.stdout

    # not enough disk is tied to where: the same model into another directory is fetched (and forgotten)
    seeder, info = procs.seeder(model, env=env)
    r = join(info["port"], "--model-id", mid, "--out", tmp_path / "elsewhere", env=env)
    assert r.returncode == 0, r.stderr
    assert same_tree(model, tmp_path / "elsewhere") == []
    assert [k for k, _ in ModelCache(str(root)).failed.records()] == [wrong]
    # after the backoff, it is tried again
    short = dict(env, P2PW_FAILURE_BACKOFF="0")
    r = join(info["port"], "--model-id", wrong, env=short)
    assert r.returncode == 1 and "mismatch" in r.stderr and "remembered" not in r.stderr, r.stderr


def test_every_source_failing_checksums_is_remembered(procs, tmp_path, cache_env):
    env, root = cache_env
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=2, shards=1)
    bad_env = dict(env, P2PW_FAULTS="corrupt=1.0,seed=1")
    seeder, info = procs.seeder(model, "--chunk-size", "64KiB", env=bad_env)
    r = join(info["port"], "--model-id", info["model_id"], env=env, timeout=120)
    assert r.returncode == 1 and "checksums" in r.stderr and r.stderr.count("p2pw: error:") == 1, r.stderr
    left_everywhere(info["port"])  # the next join's plan names the bad seeder alone, not the join that ended
    r = join(info["port"], "--model-id", info["model_id"], "--report", tmp_path / "r.json", env=env)
    assert r.returncode == 1 and "remembered" in r.stderr and "checksums" in r.stderr, r.stderr
    assert not (tmp_path / "r.json").exists()


def test_two_joins_of_one_model_on_a_host_fetch_it_once(procs, tmp_path, cache_env):
    """The second waits for the first (which holds the copy's lock exclusively while writing), then reads it."""
    env, root = cache_env
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=2, shards=2)
    _, info = procs.seeder(model, "--chunk-size", "64KiB", env=dict(env, P2PW_FAULTS="delay_send=20"))
    joins = [procs.start("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q",
                         "--model-id", info["model_id"], "--report", tmp_path / f"r{i}.json", env=env)
             for i in range(2)]
    for j in joins:
        assert j.wait(120) == 0, j.output()
    received = [json.loads((tmp_path / f"r{i}.json").read_text())["received"] for i in range(2)]
    n_chunks = -(-sum(os.path.getsize(model / n) + 4096 for n in os.listdir(model)) // (64 << 10))
    assert sorted(received)[0] == 0 and 0 < sorted(received)[1] <= n_chunks
    assert same_tree(model, root / "models" / info["model_id"]) == []


def test_an_unwritable_cache_folder_only_matters_to_a_join_that_needs_it(procs, tmp_path):
    model = tmp_path / "model"
    write_synthetic_model(model, size_mb=1, shards=1)
    _, info = procs.seeder(model)
    (tmp_path / "a-file").write_text("not a directory")
    env = {"P2PW_CACHE_DIR": str(tmp_path / "a-file" / "cache")}  # cannot be made, even by root
    r = join(info["port"], "--model-id", info["model_id"], "--out", tmp_path / "copy", env=env)
    assert r.returncode == 0 and "not remembered" in r.stderr, r.stderr
    assert same_tree(model, tmp_path / "copy") == []
    r = join(info["port"], "--model-id", info["model_id"], env=env)
    assert r.returncode == 1 and r.stderr.count("p2pw: error:") == 1 and "P2PW_CACHE_DIR" in r.stderr, r.stderr



def test_processes_sharing_a_cache_never_rename_each_others_half_written_files(tmp_path):
    """Processes writing one cache file at once (joiners sharing a cache) all succeed; the file is whole."""
    target = tmp_path / "index" / "m.manifest.json"
    target.parent.mkdir()
    script = (
        "import sys\n"
        "from p2pweights.storage.cache import write_text_atomically\n"
        "for i in range(300):\n"
        "    write_text_atomically(sys.argv[1], sys.argv[2] * 4096)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(target), str(k)], cwd=ROOT)
             for k in range(4)]
    try:
        assert [p.wait(timeout=60) for p in procs] == [0] * 4
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = target.read_text()
    assert len(text) == 4096 and len(set(text)) == 1
    assert os.listdir(target.parent) == ["m.manifest.json"]


def test_a_join_s_record_forgets_out_folders_that_are_gone(tmp_path):
    # every join rewrites the model's record under the index lock: --out folders made and deleted by the
    # thousand (a bench host had 2,359) made that 285 KB of JSON, 0.1-0.2 s of CPU per join
    from p2pweights.sources.chunker import build

    (tmp_path / "m.bin").write_bytes(os.urandom(300_000))
    manifest = build(str(tmp_path / "m.bin"), chunk_size=64 << 10)[0]
    cache = ModelCache(str(tmp_path / "cache"))
    outs = [tmp_path / f"out{i}" for i in range(3)]
    for out in outs[:2]:
        out.mkdir()
        cache.remember(manifest, str(out))
    outs[0].rmdir()
    outs[2].mkdir()
    cache.remember(manifest, str(outs[2]))
    assert [c["path"] for c in cache.record(manifest.model_id)["copies"]] == [str(outs[1]), str(outs[2])]
