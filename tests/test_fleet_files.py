"""Nothing a join or the agent writes lands outside its root, and nothing it reads is outside what it was told
to trust: HF cache blobs named by their bytes, a ``.p2pw`` state folder opened without following links, the
agent's local origins only under ``--local-root``.  Real processes, real files."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time

import pytest

from conftest import ROOT, p2pw_argv, same_tree
from test_cli_input import assert_one_line_error
from p2pweights.storage import hfcache

REPO = "org/model"
C1, C2 = "1" * 40, "2" * 40


def run(*args, env=None, timeout=120, cwd=ROOT):
    return subprocess.run(p2pw_argv(*args), capture_output=True, text=True, env=dict(os.environ, **(env or {})),
                          cwd=cwd, timeout=timeout)


def hub_repo(hub, commit, files: dict[str, bytes], names: dict[str, str] | None = None, ref="main"):
    """A repo in a hub cache: each file a blob (named by its sha256, or ``names[file]``), a snapshot, a ref."""
    root = hub / hfcache.repo_folder(REPO)
    for rel, data in files.items():
        name = (names or {}).get(rel) or hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / name).write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / "blobs" / name, link.parent), link)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return root


def tree(root) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            out[rel] = ("-> " + os.readlink(p)) if os.path.islink(p) else (
                open(p, "rb").read() if os.path.isfile(p) else "dir")
    return out


# ----- the HF cache: blobs named by their bytes, refs only as asked -------------------------------------------


def test_hub_names_are_the_sha256_of_an_lfs_file_and_the_git_blob_sha1_of_a_small_one():
    data = b"hello\n"
    reads = lambda: iter([data, b""])  # noqa: E731

    def reader():
        chunks = reads()

        def read(buf):
            c = next(chunks)
            buf[:len(c)] = c
            return len(c)
        return read
    assert hfcache.hub_name("a" * 64, len(data), reader()) == hashlib.sha256(data).hexdigest()
    assert hfcache.hub_name("b" * 40, len(data), reader()) == "ce013625030ba8dba906f756967f9e9ca394464a"  # git's


def test_ref_rules():
    o = {"repo": REPO, "commit": C2, "revision": "main"}
    assert hfcache.ref_to_write(o, "v2", current=C1) == "v2"  # asked for: written, whatever the manifest says
    assert hfcache.ref_to_write(o, C2, current=None) is None  # a commit asked for: no ref
    assert hfcache.ref_to_write(o, None, current=C1) is None  # never moved by a manifest nobody asked for
    assert hfcache.ref_to_write(o, None, current=None) == "main"  # a ref the host lacks
    assert hfcache.ref_to_write(o, None, current=C2) == "main"  # (again: idempotent)
    assert hfcache.ref_to_write({"repo": REPO, "commit": C2}, None, current=None) is None
    assert hfcache.asked_revision(f"{REPO}@v2", REPO) == "v2" and hfcache.asked_revision(REPO, REPO) == "main"
    assert hfcache.asked_revision("other/repo", REPO) is None and hfcache.asked_revision(None, REPO) is None


def test_a_manifest_reusing_a_trusted_blobs_etag_cannot_overwrite_it_nor_move_main(procs, tmp_path):
    good, evil = b"\1" * 20000, b"\2" * 20000
    trusted = hashlib.sha256(good).hexdigest()
    victim_hub, stranger_hub = tmp_path / "hub", tmp_path / "stranger-hub"
    root = hub_repo(victim_hub, C1, {"config.json": b"{}", "model.bin": good})
    # the stranger's snapshot of another commit: other bytes, in a blob named by the trusted file's etag
    hub_repo(stranger_hub, C2, {"config.json": b"{}", "model.bin": evil}, names={"model.bin": trusted})
    _, info = procs.seeder(REPO, "--chunk-size", "4KiB", env={"HF_HUB_CACHE": str(stranger_hub)})
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--hf-cache", victim_hub,
            "--connect-timeout", "20", env={"HF_HUB_CACHE": str(victim_hub)})
    assert r.returncode == 0, r.stderr
    assert (root / "blobs" / trusted).read_bytes() == good  # kept
    assert (root / "snapshots" / C1 / "model.bin").read_bytes() == good
    assert (root / "refs" / "main").read_text() == C1  # not moved to the stranger's commit
    link = root / "snapshots" / C2 / "model.bin"  # the stranger's bytes: under the name they hash to
    assert os.path.basename(os.readlink(link)) == hashlib.sha256(evil).hexdigest() and link.read_bytes() == evil


def test_publishing_again_keeps_a_blob_of_the_same_bytes_and_replaces_a_planted_one(tmp_path):
    """A blob that is there already is kept when its bytes are its name's; a link or other bytes under that name
    are replaced by the verified store file."""
    data = b"\3" * 5000
    name = hashlib.sha256(data).hexdigest()
    root = tmp_path / "repo"
    (root / "blobs").mkdir(parents=True)
    store = root / "blobs" / f"{name}.p2pw-x-0"
    store.write_bytes(data)
    outside = tmp_path / "outside"
    outside.write_bytes(b"\4" * 5000)
    os.symlink(outside, root / "blobs" / name)
    assert hfcache.place_blob(str(root), str(store), name) == f"blobs/{name}"
    assert not (root / "blobs" / name).is_symlink() and (root / "blobs" / name).read_bytes() == data
    assert outside.read_bytes() == b"\4" * 5000
    other = root / "blobs" / f"{name}.p2pw-y-0"  # another copy of the same bytes: the blob there is kept
    other.write_bytes(data)
    kept = os.stat(root / "blobs" / name).st_ino
    assert hfcache.place_blob(str(root), str(other), name) == f"blobs/{name}"
    assert os.stat(root / "blobs" / name).st_ino == kept != os.stat(other).st_ino
    (root / "blobs" / name).unlink()  # other bytes under the name: replaced by the verified store file
    (root / "blobs" / name).write_bytes(b"\5" * 5000)
    assert hfcache.place_blob(str(root), str(other), name) == f"blobs/{name}"
    assert (root / "blobs" / name).read_bytes() == data
    assert os.stat(root / "blobs" / name).st_ino == os.stat(other).st_ino


# ----- the .p2pw state folder: no link followed out of --out --------------------------------------------------


@pytest.mark.parametrize("planted", [".p2pw", ".p2pw/lock"])
def test_a_planted_state_symlink_in_out_is_one_error_and_nothing_outside_is_touched(procs, tmp_path, model_dir,
                                                                                      planted):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "chunks-precious").write_bytes(b"keep me")
    (outside / "complete.json").write_text("{}")
    before = tree(outside)
    out = tmp_path / "out"
    out.mkdir()
    if planted == ".p2pw":
        os.symlink(outside, out / ".p2pw")
    else:
        (out / ".p2pw").mkdir()
        os.symlink(outside / "lock", out / ".p2pw" / "lock")
    _, info = procs.seeder(model_dir, "--chunk-size", "64KiB")
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--out", out,
            "--connect-timeout", "20", timeout=90)
    assert r.returncode == 1, r.stderr
    assert_one_line_error(r, "symlink")
    assert tree(outside) == before  # nothing written, made or deleted there
    assert same_tree(model_dir, out) != []  # and no copy was made


def test_a_copy_in_a_real_state_folder_still_completes_and_replaces_linked_state_files(procs, tmp_path, model_dir):
    """A link planted for a state file written by rename (the marker) is replaced, not written through."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "marker").write_text("mine")
    out = tmp_path / "out"
    (out / ".p2pw").mkdir(parents=True)
    os.symlink(outside / "marker", out / ".p2pw" / "complete.json")
    _, info = procs.seeder(model_dir, "--chunk-size", "64KiB")
    r = run("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q", "--out", out,
            "--connect-timeout", "20", timeout=90)
    assert r.returncode == 0, r.stderr
    assert same_tree(model_dir, out) == [] and (outside / "marker").read_text() == "mine"
    assert not (out / ".p2pw" / "complete.json").is_symlink()
    assert json.loads((out / ".p2pw" / "complete.json").read_text())["model_id"] == info["model_id"]


# ----- the agent: local origins only under --local-root -----------------------------------------------------


def test_the_agent_reads_a_local_origin_only_under_a_local_root_and_never_a_relative_name(procs, tmp_path):
    from conftest import Proc
    from p2pweights.sources.synth import write_synthetic_model
    from p2pweights.wire import local
    from test_fleet_get import CHUNK, start_tracker

    _, port = start_tracker(procs, tmp_path)
    allowed, outside, relative = tmp_path / "allowed" / "a", tmp_path / "outside" / "b", tmp_path / "tmp" / "x"
    for i, path in enumerate((allowed, outside, relative)):
        write_synthetic_model(path, size_mb=1, shards=1, seed=i + 1)
    for url in (allowed, outside, "tmp/x"):  # anyone may publish a manifest under any URL
        r = run("manifest", url, "--chunk-size", CHUNK, "--tracker", f"127.0.0.1:{port}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    cache, prewarm, ready = tmp_path / "cache", tmp_path / "prewarm", tmp_path / "agent.json"
    prewarm.write_text(f"{allowed}\n{outside}\n")
    ag = Proc(p2pw_argv("agent", "--tracker", f"127.0.0.1:{port}", "--cache", cache, "--host", "127.0.0.1",
                        "--ready", ready, "--prewarm", prewarm, "--local-root", tmp_path / "allowed",
                        "--connect-timeout", "5"), cwd=tmp_path)  # tmp/x exists relative to where it runs
    procs.started.append(ag)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert ag.popen.poll() is None and time.monotonic() < deadline, ag.output()
        time.sleep(0.05)
    with pytest.raises(local.AgentError, match="not one this host can trust"):  # a repo id, never a path: the
        local.ask(str(cache), {"op": "get", "model": "tmp/x"}, timeout=60)  # agent can check its manifest by nothing
    ag.wait_line(f"not reading the origin {outside} here")
    ag.wait_line("not reading the origin tmp/x here")

    def models():
        return {m["url"]: m for m in local.ask(str(cache), {"op": "status"}, timeout=10)["models"]}
    deadline = time.monotonic() + 120
    while models().get(str(allowed), {}).get("state") != "ready":
        assert ag.popen.poll() is None and time.monotonic() < deadline, ag.output()
        time.sleep(0.1)
    seen = models()
    assert seen[str(allowed)]["origin_bytes_read"] > 0 and same_tree(allowed, seen[str(allowed)]["path"]) == []
    assert seen.get(str(outside), {}).get("origin_bytes_read", 0) == 0
    assert seen.get(str(outside), {}).get("state") != "ready"
    assert seen.get("tmp/x", {}).get("origin_bytes_read", 0) == 0


def test_origin_rules(tmp_path):
    from p2pweights.agent.rules import origin_of

    (tmp_path / "root" / "m").mkdir(parents=True)
    os.symlink(tmp_path, tmp_path / "root" / "up")
    roots = [str(tmp_path / "root")]
    assert origin_of("s3://b/k", []) == ("s3", "s3://b/k")
    assert origin_of(str(tmp_path / "root" / "m"), roots) == ("path", str(tmp_path / "root" / "m"))
    assert origin_of(str(tmp_path / "root" / "m"), [])[0] is None  # no --local-root: no local path at all
    assert origin_of(str(tmp_path / "root" / "up" / "x"), roots)[0] is None  # a link out of the root
    assert origin_of(str(tmp_path / "rootx"), roots)[0] is None  # a sibling that shares the prefix
    assert origin_of("~/m", roots, home=lambda p: str(tmp_path / "root") + p[1:]) == \
        ("path", str(tmp_path / "root" / "m"))
    assert origin_of("tmp/x", roots) == ("hub", "tmp/x")  # a relative name is a repo id, never a path
    assert origin_of("./m", roots)[0] is None and origin_of("../m", roots)[0] is None
