"""Hostile manifests: a join, a seeder or the cache given a manifest built to harm refuses it with one error
line, and nothing is written outside the folder it writes into.

A fake seeder (a real ZeroMQ ROUTER speaking the wire protocol) answers a real ``p2pw join`` with a
manifest each test builds; its model id is pinned with ``--model-id``, so pinning is shown not to help."""
import json
import os
import subprocess
import threading

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import p2pw_argv
from test_cli_input import assert_one_line_error, run
from p2pweights.sources.chunker import build
from p2pweights.sources.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, canonical, sha256
from p2pweights.storage.cache import PARTIAL, CacheError, DiskCache, copy_paths
from p2pweights.storage.paths import PathError, inside
from p2pweights.wire import protocol
from p2pweights.wire.protocol import Msg

COMMIT = "a" * 40


def model_id(doc: dict) -> str:
    return sha256(canonical({k: v for k, v in doc.items() if k != "model_id"})).hexdigest()


def small_doc(tmp_path, files=(("config.json", b"{}"), ("w.bin", b"\1" * 9000))) -> dict:
    """A good manifest of a small checkpoint, as a dict to tamper with."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for name, data in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    m = build(src, 4096)[0]
    return m.body()


class FakeSeeder:
    """A ROUTER on loopback that answers every HELLO with WELCOME carrying ``payload`` as the manifest."""

    def __init__(self, payload: bytes):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.payload, self.stop = payload, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        addr = f"127.0.0.1:{self.port}"
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            if protocol.decode(frames[1:]).type == Msg.HELLO:
                welcome = protocol.control(Msg.WELCOME, rank=1, stripes=1, tracker=addr,
                                           parents=[{"addr": addr, "stripe": 0, "rank": 0}])
                self.sock.send_multipart([frames[0], welcome, self.payload])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def fake_seeder():
    started = []

    def start(doc_or_bytes):
        payload = doc_or_bytes if isinstance(doc_or_bytes, bytes) else canonical(doc_or_bytes)
        started.append(FakeSeeder(payload))
        return started[-1]
    yield start
    for s in started:
        s.close()


def join(seeder, model, *args, env=None):
    full_env = dict(os.environ, **(env or {}))
    argv = p2pw_argv("join", "--parent", f"127.0.0.1:{seeder.port}", "--model-id", model, "-q",
                     "--connect-timeout", "20", *map(str, args))
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=full_env)


def files_under(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs} | \
        {os.path.relpath(os.path.join(d, x), root) for d, xs, _ in os.walk(root) for x in xs}


# ----- one test per defect ------------------------------------------------------------------------


def test_a_manifest_cannot_write_outside_the_hf_cache(tmp_path, fake_seeder):
    doc = small_doc(tmp_path)
    doc["files"][1]["name"] = "../../../../escaped.bin"
    for f in doc["files"]:
        f["etag"] = "e" + f["name"].replace("/", "").replace(".", "")[:10]
    doc["origin"] = {"repo": "org/model", "commit": COMMIT, "revision": "../../../escaped-ref"}
    hub, outside = tmp_path / "box" / "hub", tmp_path / "box"
    hub.mkdir(parents=True)
    before = files_under(outside)
    r = join(fake_seeder(doc), model_id(doc), "--hf-cache", env={"HF_HUB_CACHE": str(hub)})
    assert_one_line_error(r, "escaped.bin")
    assert files_under(outside) - before <= {p for p in files_under(outside) if p.startswith("hub")}
    assert not (tmp_path / "escaped.bin").exists() and not list(tmp_path.rglob("escaped*"))


def test_two_files_under_one_name_are_refused(tmp_path, fake_seeder):
    doc = small_doc(tmp_path, files=(("w.bin", b"\1" * 5000), ("x.bin", b"\2" * 5000)))
    doc["files"][1]["name"] = "./w.bin"
    r = join(fake_seeder(doc), model_id(doc), "--out", tmp_path / "out", "--no-cache")
    assert_one_line_error(r, "plain relative path")
    doc["files"][1]["name"] = "w.bin"
    r = join(fake_seeder(doc), model_id(doc), "--out", tmp_path / "out", "--no-cache")
    assert_one_line_error(r, "two files are named 'w.bin'")
    assert not (tmp_path / "out" / "w.bin").exists()


def test_an_edited_manifest_with_overlapping_files_is_refused_by_the_seeder(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "a.bin").write_bytes(b"\1" * 8192)
    (model / "b.bin").write_bytes(b"\2" * 8192)
    assert run("manifest", model, "-o", tmp_path / "m.json").returncode == 0
    doc = json.loads((tmp_path / "m.json").read_text())
    doc["files"][1]["offset"] = doc["files"][0]["offset"]  # b.bin mapped over a.bin
    doc["model_id"] = model_id(doc)
    (tmp_path / "m.json").write_text(json.dumps(doc))
    r = run("seed", model, "--manifest", tmp_path / "m.json", "--port", "0", timeout=60)
    assert_one_line_error(r, "overlaps the file before it")


def test_a_pinned_join_hashes_an_oversized_manifest_before_parsing_it(tmp_path, fake_seeder):
    doc = small_doc(tmp_path)
    hostile = b'{"version":1,"tensors":[' + b"{}," * (4 << 20) + b"{}]}"  # 12 MiB: millions of objects
    r = join(fake_seeder(hostile), model_id(doc), "--out", tmp_path / "out", "--no-cache")
    assert_one_line_error(r, "model id mismatch")


def test_an_unpinned_manifest_of_millions_of_objects_stops_at_the_object_limit():
    hostile = b'{"version":1,"tensors":[' + b"{}," * (2 << 20) + b"{}]}"
    with pytest.raises(ManifestError, match="more than 1048576 objects"):
        Manifest.from_json(hostile)
    with pytest.raises(ManifestError, match="exceeds the 64 MiB limit"):
        Manifest.from_json(b" " * (MAX_MANIFEST_BYTES + 1))


def test_a_canonical_payload_is_required_when_pinned(tmp_path):
    doc = small_doc(tmp_path)
    pretty = json.dumps(doc, indent=2).encode()  # the same content, not the bytes the id hashes
    with pytest.raises(ManifestError, match="model id mismatch"):
        Manifest.from_wire(pretty, model_id(doc))
    assert Manifest.from_wire(canonical(doc), model_id(doc)).model_id == model_id(doc)


@pytest.mark.parametrize("name, needle", [
    ("a\0b.bin", "NUL"), ("/etc/passwd", "plain relative path"), ("a//b", "plain relative path"),
    (".p2pw/complete.json", "inside .p2pw/"), ("", "non-empty string"), ("x" * 300, "longer than 255"),
])
def test_bad_file_names_are_one_error_line(tmp_path, name, needle):
    doc = small_doc(tmp_path)
    doc["files"][1]["name"] = name
    doc["model_id"] = model_id(doc)
    (tmp_path / "m.json").write_text(json.dumps(doc))
    assert_one_line_error(run("verify", tmp_path / "src", "--manifest", tmp_path / "m.json"), needle)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["files"][1].update(size=10 ** 9), "past the blob"),
    (lambda d: d["files"][1].update(offset=4097), "alignment"),
    (lambda d: d["files"][1].update(name="config.json/w.bin"), "both a file and the folder"),
    (lambda d: d.update(chunks=["zz" * 8] * len(d["chunks"])), "hex digits"),
    (lambda d: d.update(tensors=[{"name": "t", "dtype": "F32", "shape": [4], "offset": 0, "nbytes": 16,
                                  "file": "nope"}]), "does not list"),
    (lambda d: d.update(tensors=[{"name": "t", "dtype": "F32", "shape": [4], "offset": d["total_size"],
                                  "nbytes": 16}]), "outside its file"),
    (lambda d: d.update(origin={"repo": "org/m", "commit": "a" * 40, "revision": "../x"}), "branch or tag"),
    (lambda d: d.update(origin={"repo": "../m", "commit": "a" * 40}), "not ORG/NAME"),
    (lambda d: d.update(surprise=1), "unknown field"),
])
def test_malformed_fields_are_refused(tmp_path, edit, needle):
    doc = small_doc(tmp_path)
    edit(doc)
    with pytest.raises(ManifestError, match=needle):
        Manifest.from_json(json.dumps(doc))


def test_a_resume_moves_a_wrong_sized_final_file_aside_before_touching_it(tmp_path):
    m = Manifest.from_json(canonical(small_doc(tmp_path)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "w.bin").write_bytes(b"precious")  # a final name, the wrong size: not this model's file yet
    cache = DiskCache(m, str(out))
    try:
        assert not (out / "w.bin").exists()
        assert (out / ("w.bin" + PARTIAL)).read_bytes()[:8] == b"precious"
    finally:
        cache.close()


def test_a_symlinked_folder_or_file_in_the_copy_cannot_lead_writes_outside(tmp_path):
    m = Manifest.from_json(canonical(small_doc(tmp_path, files=(("sub/w.bin", b"\1" * 5000),))))
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "sub").symlink_to(elsewhere)
    with pytest.raises(CacheError, match="escapes"):
        copy_paths(m, str(out))
    (out / "sub").unlink()
    (out / "sub").mkdir()
    victim = elsewhere / "victim"
    victim.write_bytes(b"\0" * 5000)  # the right size: kept as a final file, and must not be opened through
    (out / "sub" / "w.bin").symlink_to(victim)
    with pytest.raises(CacheError, match="cannot create the local copy"):
        DiskCache(m, str(out))
    assert victim.read_bytes() == b"\0" * 5000


def test_inside_resolves_symlinks_on_the_way(tmp_path):
    (tmp_path / "root").mkdir()
    assert inside(str(tmp_path / "root"), "a/b") == str(tmp_path / "root" / "a" / "b")
    (tmp_path / "root" / "link").symlink_to("/")
    with pytest.raises(PathError):
        inside(str(tmp_path / "root"), "link/etc/passwd")
    with pytest.raises(PathError):
        inside(str(tmp_path / "root"), "../x")


# ----- fuzzing ------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2 ** 40) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
names = st.sampled_from(["w.bin", "./w.bin", "../w.bin", "/w.bin", "a/../w.bin", "a//w.bin", "", ".p2pw/x",
                         "a\0b", "config.json", "sub/w.bin", "sub", "\\..\\w.bin", "w.bin/", ".", ".."])


edits = st.lists(st.tuples(st.sampled_from(["files.name", "files.offset", "files.size", "top", "tensor", "origin",
                                            "chunks"]), json_values, names), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=edits)
def test_fuzzed_manifests_are_refused_or_write_only_inside_the_copy(tmp_path_factory, edits):
    tmp = tmp_path_factory.mktemp("fuzz")
    doc = small_doc(tmp, files=(("config.json", b"{}"), ("w.bin", b"\1" * 9000), ("sub/x.bin", b"\2" * 100)))
    for where, value, name in edits:
        f = doc["files"][hash(str(value)) % len(doc["files"])]
        if where == "files.name":
            f["name"] = name
        elif where in ("files.offset", "files.size"):
            f[where.split(".")[1]] = value
        elif where == "top":
            doc[str(value)[:6] or "total_size"] = value
        elif where == "tensor":
            doc["tensors"] = [value]
        elif where == "origin":
            doc["origin"] = value
        else:
            doc["chunks"] = [value] * len(doc["chunks"])
    try:
        m = Manifest.from_json(json.dumps(doc))
    except ManifestError:
        return
    out = tmp / "out"
    out.mkdir()
    cache = DiskCache(m, str(out))
    cache.close()
    real = os.path.realpath(out)
    for d, dirs, fs in os.walk(tmp):
        for x in dirs + fs:
            p = os.path.realpath(os.path.join(d, x))
            assert p.startswith(str(tmp)), p
    assert all(os.path.realpath(p).startswith(real + os.sep) for p in copy_paths(m, str(out)))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400) | json_values.map(lambda v: json.dumps(v).encode()))
def test_from_json_raises_only_manifest_errors(data):
    try:
        Manifest.from_json(data)
    except ManifestError:
        pass
