"""Hugging Face cache layout in and out: a model built by transformers, seeded by repo id from one hub cache,
joined with --hf-cache into another, loaded offline by from_pretrained with equal outputs."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, p2pw_argv, same_tree

pytest.importorskip("transformers")

REPO = "test-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a fake commit hash, as the hub would name it

LOAD = r"""
import sys, torch
from transformers import AutoModelForCausalLM
src, repo = sys.argv[1], sys.argv[2]
ids = torch.tensor([[1, 5, 9, 17, 33, 65, 2]])
a = AutoModelForCausalLM.from_pretrained(src).eval()
b = AutoModelForCausalLM.from_pretrained(repo).eval()  # by repo id, from HF_HUB_CACHE, offline
with torch.no_grad():
    la, lb = a(ids).logits, b(ids).logits
print("EQUAL" if torch.equal(la, lb) else f"DIFFERENT max {(la - lb).abs().max().item()}")
"""


def build_tiny_llama(path):
    """A 2-layer Llama with random weights, written by transformers itself, plus a nested extra file."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(path)
    os.makedirs(path / "extra", exist_ok=True)
    (path / "extra" / "notes.txt").write_text("nested files keep their place\n")
    (path / "extra" / "config-copy.json").write_bytes((path / "config.json").read_bytes())  # one blob, two paths
    (path / "extra" / "empty-a").write_bytes(b"")
    (path / "extra" / "empty-b").write_bytes(b"")


def into_hub_cache(src, hub, repo=REPO, commit=COMMIT):
    """Lay ``src`` out as the hub does: blobs named by their sha256 (the etag), relative snapshot links, a ref."""
    root = hub / ("models--" + repo.replace("/", "--"))
    etags = {}
    for d, _, names in os.walk(src):
        for n in names:
            full = os.path.join(d, n)
            rel = os.path.relpath(full, src)
            data = open(full, "rb").read()
            etag = hashlib.sha256(data).hexdigest()
            etags[rel] = etag
            (root / "blobs").mkdir(parents=True, exist_ok=True)
            (root / "blobs" / etag).write_bytes(data)
            link = root / "snapshots" / commit / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(root / "blobs" / etag, link.parent), link)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return root, etags


def run(*args, env, timeout=120):
    return subprocess.run(p2pw_argv(*args), capture_output=True, text=True, env=dict(os.environ, **env), cwd=ROOT,
                          timeout=timeout)


@pytest.fixture
def tiny(tmp_path):
    src = tmp_path / "src"
    build_tiny_llama(src)
    hub_a = tmp_path / "hub-a"
    root, etags = into_hub_cache(src, hub_a)
    return src, hub_a, root, etags


def test_seed_by_repo_id_join_into_hf_cache_and_load_offline(procs, tmp_path, tiny):
    src, hub_a, root_a, etags = tiny
    hub_b = tmp_path / "hub-b"
    env = {"P2PW_CACHE_DIR": str(tmp_path / "p2pw-cache"), "HF_HUB_CACHE": str(hub_a)}
    seeder, info = procs.seeder(REPO, env=env)
    seeder.wait_line(f"is commit {COMMIT}")
    mid = info["model_id"]

    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--model-id", mid,
            "--hf-cache", hub_b, "--report", tmp_path / "r1.json", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    root_b = hub_b / "models--test-org--tiny-llama"
    snap = root_b / "snapshots" / COMMIT
    assert r.stdout.strip().splitlines()[-1] == str(snap)
    assert json.loads((tmp_path / "r1.json").read_text())["received"] > 0

    # the receiver's layout: blobs by etag, relative links into them, the ref
    blobs = set(os.listdir(root_b / "blobs"))
    assert blobs >= set(etags.values())
    assert all(b.rsplit(".", 1)[0] in etags.values() for b in blobs - set(etags.values()))  # a duplicate's store
    for rel, etag in etags.items():
        link = snap / rel
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))
        assert os.path.realpath(link) == str(root_b / "blobs" / etag)
        assert (root_b / "blobs" / etag).read_bytes() == (src / rel).read_bytes()
    assert (root_b / "refs" / "main").read_text() == COMMIT

    # the manifest says where it came from; each file's etag is its blob's name
    m = json.loads((tmp_path / "p2pw-cache" / "index" / f"{mid}.manifest.json").read_text())
    assert m["origin"] == {"repo": REPO, "commit": COMMIT, "revision": "main"}
    assert {f["name"]: f["etag"] for f in m["files"]} == etags

    # from_pretrained by repo id, offline, from the receiver's cache: the same outputs as the original
    load = subprocess.run([sys.executable, "-c", LOAD, str(src), REPO], capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_b)), timeout=300)
    assert load.stdout.strip().splitlines()[-1:] == ["EQUAL"], load.stdout + load.stderr

    # a second join on this host fetches nothing: pinned, from the marker alone; unpinned, after the handshake
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--model-id", mid,
            "--hf-cache", hub_b, "--report", tmp_path / "r2.json", env=env)
    assert r.returncode == 0 and "fetched nothing" in r.stdout, r.stderr + r.stdout
    assert json.loads((tmp_path / "r2.json").read_text())["received"] == 0
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q",
            "--hf-cache", hub_b, "--report", tmp_path / "r3.json", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    assert json.loads((tmp_path / "r3.json").read_text())["received"] == 0

    # HF_HOME/hub is the default hub cache when HF_HUB_CACHE is unset
    home = tmp_path / "hf-home"
    env_home = dict(env, HF_HUB_CACHE="", HF_HOME=str(home))
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--model-id", mid,
            "--hf-cache", env=env_home)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (home / "hub" / "models--test-org--tiny-llama" / "refs" / "main").read_text() == COMMIT


def test_seed_a_revision_and_a_plain_checkpoint_keeps_its_model_id(procs, tmp_path, tiny):
    src, hub_a, root_a, etags = tiny
    (root_a / "refs" / "v1").write_text(COMMIT)
    env = {"P2PW_CACHE_DIR": str(tmp_path / "p2pw-cache"), "HF_HUB_CACHE": str(hub_a)}
    seeder, info = procs.seeder(f"{REPO}@v1", env=env)
    hub_b = tmp_path / "hub-b"
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--hf-cache", hub_b,
            env=env)
    assert r.returncode == 0, r.stderr
    assert (hub_b / "models--test-org--tiny-llama" / "refs" / "v1").read_text() == COMMIT

    # the same files as a plain directory: no origin, no etags, the id they always had
    plain = json.loads(run("manifest", src, env=env).stdout)
    assert "origin" not in plain and not any("etag" in f for f in plain["files"])
    from p2pweights.sources.manifest import Manifest
    assert Manifest.from_json(json.dumps(plain)).model_id == plain["model_id"] != info["model_id"]
    # a join of a plain checkpoint cannot be written as an HF cache: one clear line
    _, plain_info = procs.seeder(src, env=env)
    r = run("join", "--parent", f"127.0.0.1:{plain_info['port']}", "--host", "127.0.0.1", "-q",
            "--hf-cache", tmp_path / "hub-c", env=env)
    assert r.returncode == 1 and r.stderr.count("p2pw: error:") == 1 and "Hugging Face" in r.stderr, r.stderr


def test_repo_ids_that_do_not_resolve_are_one_error_line(tmp_path, tiny):
    src, hub_a, root_a, etags = tiny
    env = {"P2PW_CACHE_DIR": str(tmp_path / "p2pw-cache"), "HF_HUB_CACHE": str(hub_a)}
    for arg, words in ((f"{REPO}@nope", "no revision 'nope'"), ("other-org/absent", "not in the Hugging Face cache"),
                       ("no/such/thing", "no such file or directory")):
        r = run("seed", arg, "--port", "0", env=env, timeout=60)
        assert r.returncode == 1 and r.stderr.count("p2pw: error:") == 1 and words in r.stderr, (arg, r.stderr)


def test_seed_a_local_dir_download(procs, tmp_path, tiny):
    """``huggingface_hub`` ``local_dir`` downloads keep metadata under .cache/huggingface/: not served."""
    src, *_ = tiny
    local = tmp_path / "local"
    subprocess.run(["cp", "-r", str(src), str(local)], check=True)
    meta = local / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "model.safetensors.metadata").write_text(f"{COMMIT}\n{'ab' * 32}\n1700000000.0\n")
    env = {"P2PW_CACHE_DIR": str(tmp_path / "p2pw-cache")}
    _, info = procs.seeder(local, env=env)
    out = tmp_path / "copy"
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--out", out, env=env)
    assert r.returncode == 0, r.stderr
    assert same_tree(src, out) == [] and not (out / ".cache").exists()


def test_snapshot_and_ref_appear_only_once_every_blob_is_complete(procs, tmp_path, tiny):
    src, hub_a, root_a, etags = tiny
    env = {"P2PW_CACHE_DIR": str(tmp_path / "p2pw-cache"), "HF_HUB_CACHE": str(hub_a)}
    _, info = procs.seeder(REPO, "--chunk-size", "64KiB", env=dict(env, P2PW_FAULTS="delay_send=300"))
    hub_b = tmp_path / "hub-b"
    root_b = hub_b / "models--test-org--tiny-llama"
    peer = procs.start("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q",
                       "--hf-cache", hub_b, env=env)
    partial_seen = 0
    while peer.popen.poll() is None:
        published = (root_b / "refs").exists() or (root_b / "snapshots").exists()  # looked at first: no race
        blobs = os.listdir(root_b / "blobs") if (root_b / "blobs").is_dir() else []
        if any(b.endswith(".partial") for b in blobs):
            partial_seen += 1
            assert not published, blobs
        time.sleep(0.02)
    assert peer.wait(60) == 0, peer.output()
    assert partial_seen > 0
    assert (root_b / "refs" / "main").read_text() == COMMIT and (root_b / "snapshots" / COMMIT).is_dir()
