"""The copy on a joiner's disk, end to end: every file (dot-files too), default skips listed, --exclude,
the completion marker, a restart into a complete copy (served at once; --verify full re-hashes), and copies
into tmpfs."""
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import forwarding_joins, same_tree

from p2pweights.sources.synth import write_synthetic_model
from p2pweights.storage.cache import memory_backed

CHUNK = "64KiB"


def hf_local_dir(root):
    """A model as huggingface_hub leaves it in a local_dir: dot-files, .git/, .cache/huggingface/."""
    write_synthetic_model(root, size_mb=2, shards=2)
    (root / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (root / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text("x")
    (root / "original").mkdir()
    (root / "original" / "params.json").write_text("{}")
    return root


def test_every_file_is_copied_and_the_skipped_are_listed(procs, tmp_path):
    src = hf_local_dir(tmp_path / "model")
    seeder, info = procs.seeder(src, "--chunk-size", CHUNK, "--exclude", "original/")
    line = seeder.wait_line(r"^p2pw: not served: ").string
    for skipped in (".git/", ".cache/huggingface/", "original/"):
        assert skipped in line, line
    peer = procs.join(info["port"], tmp_path / "copy", "--model-id", info["model_id"])
    assert peer.wait(60) == 0, peer.output()
    assert (tmp_path / "copy" / ".gitattributes").read_bytes() == (src / ".gitattributes").read_bytes()
    for gone in (".git", ".cache", "original"):
        assert not (tmp_path / "copy" / gone).exists()
    (tmp_path / "expect").mkdir()
    for name in os.listdir(src):
        if name not in (".git", ".cache", "original"):
            os.link(src / name, tmp_path / "expect" / name)
    assert same_tree(tmp_path / "expect", tmp_path / "copy") == []
    marker = json.loads((tmp_path / "copy" / ".p2pw" / "complete.json").read_text())
    assert marker["model_id"] == info["model_id"] and ".gitattributes" in [f["name"] for f in marker["files"]]


def test_restart_into_a_complete_copy_serves_at_once(procs, tmp_path):
    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=2, shards=2)
    seeder, info = procs.seeder(src, "--chunk-size", CHUNK)
    copy = tmp_path / "copy"
    first = procs.join(info["port"], copy, "--report", tmp_path / "1.json")
    assert first.wait(60) == 0, first.output()
    n_chunks = -(-info["total_size"] // 65536)
    # a byte changed behind p2pw's back with size and mtime kept: only a re-hash can tell
    shard = copy / "model-00002-of-00002.safetensors"
    st = shard.stat()
    raw = bytearray(shard.read_bytes())
    raw[st.st_size // 2] ^= 0xFF
    shard.write_bytes(raw)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))

    again = procs.join(info["port"], copy, "--report", tmp_path / "2.json", "--model-id", info["model_id"])
    assert again.wait(60) == 0, again.output()
    assert "complete in" in again.output() and "(its marker matches): fetched nothing" in again.output()
    r = json.loads((tmp_path / "2.json").read_text())
    assert r["received"] == 0 and r["resumed"] == n_chunks, r  # nothing fetched, nothing re-hashed

    full = procs.join(info["port"], copy, "--report", tmp_path / "3.json", "--verify", "full")
    assert full.wait(60) == 0, full.output()
    r = json.loads((tmp_path / "3.json").read_text())
    assert r["resumed"] == n_chunks - 1 and r["received"] == 1, r  # the changed chunk found and fetched again
    assert same_tree(src, copy) == []


def test_a_fifo_in_the_checkpoint_is_one_error_line_naming_it(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=1, shards=1)
    os.mkfifo(src / "pipe")
    os.symlink("/etc/hostname", src / "escape")
    for cmd in (["seed", src, "--port", "0"], ["manifest", src]):
        r = subprocess.run([sys.executable, "-m", "p2pweights", *map(str, cmd)], capture_output=True, text=True,
                           timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("p2pw: error:"), r.stderr
        assert "pipe (fifo)" in lines[0] and "escape (symlink leaving the tree" in lines[0], lines[0]


def test_manifest_exclude_leaves_files_out(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=1, shards=1)
    (src / "notes.md").write_text("x")
    r = subprocess.run([sys.executable, "-m", "p2pweights", "manifest", src, "--exclude", "*.md"],
                       capture_output=True, text=True, timeout=60)
    names = [f["name"] for f in json.loads(r.stdout)["files"]]
    assert r.returncode == 0 and "notes.md" not in names and "config.json" in names, names


def test_library_join_into_a_complete_copy_loads_tensors(tmp_path):
    """A copy served from its marker still feeds a loader: every chunk is handed to the sinks."""
    import p2pweights

    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=1, shards=1)
    with p2pweights.seed(src, port=0, host="127.0.0.1") as s:
        with p2pweights.join(f"127.0.0.1:{s.port}", host="127.0.0.1", out=str(tmp_path / "c")) as d:
            d.wait(60)
        with p2pweights.join(f"127.0.0.1:{s.port}", host="127.0.0.1", out=str(tmp_path / "c"), device="cpu") as d:
            assert d.cache.complete
            sd = d.state_dict(timeout=60)
            assert d.stats.chunks_received == 0 and "lm_head.weight" in sd


@pytest.fixture
def shm():
    """A fresh directory on tmpfs (/dev/shm), removed afterwards."""
    if not memory_backed("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm here")
    path = Path(f"/dev/shm/p2pw-copy-test-{os.getpid()}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_joins_into_tmpfs_forwarding_to_each_other_write_exact_copies_and_report_their_threads(procs, tmp_path, shm):
    # each join corrupts a fifth of the chunks it forwards: none may reach the other's files
    _, reports = forwarding_joins(procs, tmp_path, shm)
    for r in reports:
        assert r["ring"] is None  # tmpfs: verified in the network buffer, written once (no slot, no O_DIRECT)
        assert set(r["threads"]) >= {"loop", "zmq_io", "workers"} and r["threads"]["loop"] >= 0
        assert r["loop_us_per_chunk"] is not None and r["loop_us_per_chunk"] >= 0
        assert r["loop_passes"] >= 1


def test_memory_backed_tells_tmpfs_from_other_filesystems(shm):
    assert memory_backed(str(shm)) and memory_backed(str(shm / "not" / "made")) and not memory_backed("/proc")


def test_a_copy_in_memory_allocates_its_pages_as_the_bytes_arrive_one_on_disk_or_resumed_up_front(tmp_path, shm):
    # on tmpfs, allocating is clearing every page on the thread that starts the join, before the first byte
    # is asked for; a write into a hole takes the page it fills instead (the space is still checked up front)
    from p2pweights.sources.chunker import build
    from p2pweights.storage.cache import DiskCache

    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=2, shards=1)
    m = build(src, chunk_size=64 << 10)[0]
    for out, allocated in ((shm / "copy", False), (tmp_path / "copy", True), (shm / "copy", True)):
        cache = DiskCache(m, str(out))  # the second time into shm / "copy": a resume, which reads every chunk
        try:  # through the mapping (``recover``), where a page that cannot be had is a SIGBUS: allocated first
            blocks = sum(os.stat(path + ".partial").st_blocks * 512 for path in cache.paths)
            assert (blocks >= m.total_size - 4096 * len(m.files)) == allocated, (out, blocks, m.total_size)
        finally:
            cache.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs mounted for this test (root only), unmounted afterwards."""
    import subprocess

    path = tmp_path / "small"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "p2pw-test", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_tmpfs_filled_by_someone_else_mid_join_ends_it_with_one_error_and_no_unverified_file(procs, tmp_path,
                                                                                          small_tmpfs):
    # nothing reserves the pages of a copy in memory: when another writer takes them first, the join
    # says so once and exits 1, and only files that verified whole reach their final names
    src = tmp_path / "model"
    write_synthetic_model(src, size_mb=3, shards=1)
    seeder, info = procs.seeder(src, "--chunk-size", CHUNK, env={"P2PW_FAULTS": "delay_send=20"})
    out = small_tmpfs / "copy"
    peer = procs.join(info["port"], out, "--model-id", info["model_id"])
    deadline = time.monotonic() + 30
    while not any(p.stat().st_blocks for p in out.rglob("*.partial")):  # its first chunks are written
        assert time.monotonic() < deadline and peer.popen.poll() is None, peer.output()
        time.sleep(0.02)
    with open(small_tmpfs / "filler", "wb") as f:  # another pod's writer takes what is left
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass
    assert peer.wait(60) == 1, peer.output()
    errors = [line for line in peer.output().splitlines() if line.startswith("p2pw: error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], peer.output()
    assert "Traceback" not in peer.output()
    finals = {p.relative_to(out) for p in out.rglob("*")
              if p.is_file() and ".p2pw" not in p.parts and not p.name.endswith(".partial")}
    assert not any(p.suffix == ".safetensors" for p in finals), finals  # the shard never verified whole
    for p in finals:  # small files that verified before the space ran out: exact
        assert (out / p).read_bytes() == (src / p).read_bytes(), p
