"""One download per host: a second local reader of a folder being written attaches to that copy."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import p2pweights
from p2pweights.storage import localcopy
from p2pweights.sources.synth import write_synthetic_model

from conftest import p2pw_argv

CHUNK = 64 << 10


@pytest.fixture
def seeded(tmp_path):
    src = tmp_path / "src"
    write_synthetic_model(str(src), 2, shards=2, dtype="F32", seed=3)
    s = p2pweights.seed(str(src), port=0, host="127.0.0.1", chunk_size=CHUNK)
    yield s
    s.close()


def test_a_second_join_into_the_same_folder_attaches_and_fetches_nothing(seeded, tmp_path):
    out = str(tmp_path / "copy")
    first = p2pweights.join(f"127.0.0.1:{seeded.port}", host="127.0.0.1", out=out, device="cpu")
    second = p2pweights.join(f"127.0.0.1:{seeded.port}", host="127.0.0.1", out=out, device="cpu")
    try:
        assert isinstance(second, localcopy.Attached) and not isinstance(first, localcopy.Attached)
        names = []
        for name, t in second.iter_tensors(timeout=60):
            names.append(name)
            assert torch.equal(t.view(torch.int32), first.wait_tensor(name, 60).view(torch.int32))  # bits: random F32 has NaNs
        assert sorted(names) == sorted(t["name"] for t in first.manifest.tensors)
        first.wait(60)
        assert seeded.stats.bytes_sent <= seeded.manifest.total_size * 1.05  # one copy (and some headers)
    finally:
        second.close()
        first.close()
    # the copy is complete and nobody holds it: read at once, without the swarm
    seeded.close()
    with localcopy.attach(out, device="cpu") as again:
        assert again.progress["complete"]
        assert sorted(again.state_dict()) == sorted(names)


def test_an_attached_reader_sees_each_chunk_the_writer_publishes_and_fails_when_it_stops(seeded, tmp_path):
    out = str(tmp_path / "copy")
    held = localcopy.claim(out)
    assert held.mode == "write"
    other = localcopy.claim(out)  # another fd: as another process sees it
    assert other.mode == "attach" and localcopy.writer_active(out)
    m = seeded.manifest
    for f in m.files:  # the writer's preallocated files
        with open(os.path.join(out, f["name"]) + ".partial", "wb") as fh:
            fh.truncate(f["size"])
    progress = held.publish(m)
    reader = localcopy.Attached(out)
    try:
        with pytest.raises(TimeoutError):
            reader.wait_range(0, m.chunk_size, timeout=0.2)
        progress.put(0, None)
        reader.wait_range(0, m.chunk_size, timeout=5)
        held.release()  # the writer stops short
        with pytest.raises(localcopy.WriterGone, match="stopped with 1 of"):
            reader.wait(timeout=10)
    finally:
        reader.close()
    assert localcopy.claim(out).mode == "write"  # free again: the next one resumes it


def test_p2pw_join_twice_into_one_folder_downloads_once(seeded, tmp_path):
    out = tmp_path / "copy"
    argv = p2pw_argv("join", "--parent", f"127.0.0.1:{seeded.port}", "--host", "127.0.0.1", "--out", str(out),
                     "--no-cache")
    slow = dict(os.environ, P2PW_FAULTS="delay_recv=20")  # the first takes a second or so: the second comes meanwhile
    procs = [subprocess.Popen(argv + ["--report", str(tmp_path / "r0.json")], env=slow, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)]
    try:
        deadline = time.monotonic() + 30
        while not (out / ".p2pw" / "attach.json").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        procs.append(subprocess.Popen(argv + ["--report", str(tmp_path / "r1.json")], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.poll() is None and p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    reports = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(2)]
    assert [bool(r.get("attached")) for r in reports] == [False, True], outputs
    assert "following its progress, fetching nothing" in outputs[1]
    assert seeded.stats.bytes_sent <= seeded.manifest.total_size * 1.05
    assert (out / ".p2pw" / "complete.json").exists() and not (out / ".p2pw" / "attach.json").exists()
