"""Trust: only key holders join, the wire shows nothing with CURVE on, the pinned model only, forged chunks caught."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import xxhash
import zmq

from p2pweights.failpoints import forgery

from p2pweights.wire import protocol
from p2pweights.sources.manifest import Manifest
from p2pweights.wire.protocol import Msg

CHUNK = 256 << 10


def run_p2pw(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pweights", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def write_model(path, size=3 * CHUNK + 1000, seed=1) -> bytes:
    data = bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    forgery.prepare(data)  # chunk 0 starts the blob: ready for an xxh3-preserving forgery
    path.write_bytes(data)
    return bytes(data)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.bin"
    return path, write_model(path)


@pytest.fixture
def fleet_keys(tmp_path):
    for name in ("k1", "k2"):
        r = run_p2pw("keygen", tmp_path / name)
        assert r.returncode == 0, r.stderr
    return tmp_path / "k1", tmp_path / "k2"


def nothing_written(out) -> bool:
    return not os.path.exists(out) or not os.listdir(out)


def test_keygen_refuses_to_overwrite_and_secret_is_private(fleet_keys):
    k1, _ = fleet_keys
    assert oct(os.stat(k1 / "fleet.key_secret").st_mode & 0o777) == "0o600"
    r = run_p2pw("keygen", k1)
    assert r.returncode == 1 and "already holds a fleet key" in r.stderr


def test_only_key_holders_join(procs, tmp_path, model, fleet_keys):
    path, data = model
    k1, k2 = fleet_keys
    seeder, info = procs.seeder(path, "--chunk-size", CHUNK, "--key", k1)
    seeder.wait_line(r"join with: p2pw join --parent \S+ --model-id [0-9a-f]{64} --key " + str(k1))
    for key, why in ((None, "requires encrypted links"), (k2, "refused our encryption handshake")):
        out = tmp_path / f"out-{key and key.name}"
        extra = ["--key", key] if key else []
        r = run_p2pw("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "--out", out, "-q",
                     "--connect-timeout", 10, *extra, timeout=30)
        assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert nothing_written(out)
    # a raw client without the key gets nothing for HELLO or ATTACH
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.connect(f"tcp://127.0.0.1:{info['port']}")
        d.send(protocol.control(Msg.HELLO, peer_id="thief", listen="127.0.0.1:1"))
        d.send(protocol.control(Msg.ATTACH, peer_id="thief", rank=1, model_id=info["model_id"]))
        d.send(protocol.request([0]))
        assert not d.poll(1000)
        d.close(0)
    finally:
        ctx.term()
    out = tmp_path / "good"
    j = procs.join(info["port"], out, "--key", k1, "--model-id", info["model_id"])
    assert j.wait(60) == 0, j.output()
    assert (out / "model.bin").read_bytes() == data


class Relay:
    """A TCP proxy that records every byte it forwards, both ways."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.wire = bytearray()
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self.socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.wire += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()
        for s in self.socks:
            s.close()


def leaked_windows(data: bytes, wire: bytes) -> int:
    """How many 32-aligned 32-byte blocks of ``data`` occur anywhere in ``wire``.

    Every 64-byte window of ``data`` contains one such block, so zero means no
    64-byte window of the data is on the wire.
    """
    blocks = {data[i:i + 32] for i in range(0, len(data) - 31, 32)}
    return sum(wire[i:i + 32] in blocks for i in range(len(wire) - 31))


@pytest.mark.parametrize("curve", [True, False])
def test_wire_reveals_nothing_with_curve(procs, tmp_path, model, fleet_keys, curve):
    path, data = model
    key = ["--key", fleet_keys[0]] if curve else []
    seeder, info = procs.seeder(path, "--chunk-size", CHUNK, *key)
    relay = Relay(info["port"])  # the joiner reaches the seeder (tracker and its rank-0 parent) only through it
    try:
        out = tmp_path / "out"
        j = procs.join(relay.port, out, *key)
        assert j.wait(60) == 0, j.output()
        assert (out / "model.bin").read_bytes() == data
        with relay.lock:
            wire = bytes(relay.wire)
    finally:
        relay.close()
    assert len(wire) > len(data)
    leaks = leaked_windows(data, wire)
    if curve:
        assert leaks == 0 and info["model_id"].encode() not in wire
    else:
        assert leaks > len(data) // 64  # the same check does see plaintext chunks


def test_wrong_model_id_writes_nothing(procs, tmp_path, model):
    path, _ = model
    seeder, info = procs.seeder(path, "--chunk-size", CHUNK)
    out = tmp_path / "out"
    wrong = ("0" if info["model_id"][0] != "0" else "1") + info["model_id"][1:]
    for mid, why in ((wrong, "model id mismatch"), (info["model_id"][:8], "bad model id")):
        r = run_p2pw("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "--out", out, "-q",
                     "--model-id", mid, timeout=30)
        assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert nothing_written(out)


class FakeTracker:
    """A ROUTER that answers any HELLO with WELCOME(``welcome``) and ``manifest_json``."""

    def __init__(self, manifest_json: bytes, **welcome):
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self.port = sock.bind_to_random_port("tcp://127.0.0.1")
        fields = dict(rank=1, parents=[{"rank": 0, "addr": "", "stripe": 0}], stripes=1, tracker="")
        fields.update(welcome)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(sock, fields, manifest_json), daemon=True)
        self.thread.start()

    def _serve(self, sock, fields, manifest_json):
        while not self.stop.is_set():
            if sock.poll(50):
                ident, *_ = sock.recv_multipart()
                sock.send_multipart([ident, protocol.control(Msg.WELCOME, **fields), manifest_json])
        sock.close(0)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.ctx.term()


@pytest.mark.parametrize("case", ["other-model", "many-stripes", "huge-chunks"])
def test_joiner_checks_what_a_lying_tracker_sends(tmp_path, model, case):
    """The pin is checked by the joiner itself, before any byte is written, even if the tracker ignores it."""
    from p2pweights.api import P2PError, join
    from p2pweights.sources.chunker import build

    path, _ = model
    m, _, _ = build(path, CHUNK)
    pinned = m.model_id
    welcome = {}
    if case == "other-model":
        m.chunks[0] = "0" * 16
    elif case == "many-stripes":
        welcome = dict(stripes=1000, parents=[{"rank": 0, "addr": "", "stripe": 0}] * 1000)
    elif case == "huge-chunks":
        m.chunk_size, m.total_size, m.chunks = 1 << 40, 1 << 40, ["0" * 16]
    tracker = FakeTracker(m.to_json().encode(), **welcome)
    out = tmp_path / "out"
    try:
        with pytest.raises(P2PError, match="model id mismatch|malformed WELCOME|chunk size"):
            join(f"127.0.0.1:{tracker.port}", host="127.0.0.1", out=str(out), connect_timeout=10,
                 model_id=pinned if case == "other-model" else None).close()
    finally:
        tracker.close()
    assert nothing_written(out)


@pytest.mark.parametrize("hash_name,caught", [("sha256", True), ("xxh3_64", False)])
def test_forged_chunk_with_valid_xxh3(procs, tmp_path, model, hash_name, caught):
    path, data = model
    forged = forgery.forge(data[:CHUNK])
    assert forged != data[:CHUNK] and xxhash.xxh3_64_hexdigest(bytes(forged)) == xxhash.xxh3_64_hexdigest(data[:CHUNK])
    seeder, info = procs.seeder(path, "--chunk-size", CHUNK, "--hash", hash_name,
                                env={forgery.ENV: "0"})
    out, report = tmp_path / "out", tmp_path / "report.json"
    j = procs.join(info["port"], out, "--report", report)
    assert j.wait(60) == 0, j.output()
    rep = json.loads(report.read_text())
    got = (out / "model.bin").read_bytes()
    if caught:  # dropped, fetched again, the true bytes land
        assert rep["bad_chunks"] == 1 and got == data
    else:  # the threat model: xxh3 alone does not stop a peer that forges on purpose
        assert rep["bad_chunks"] == 0 and got[:CHUNK] == bytes(forged)


def test_blake3_without_package_is_a_clear_error(monkeypatch):
    from p2pweights.sources.manifest import ManifestError, chunk_hasher

    monkeypatch.setitem(sys.modules, "blake3", None)
    with pytest.raises(ManifestError, match="needs the blake3 package"):
        chunk_hasher("blake3")


def test_strong_hashes_verify(tmp_path, model):
    from p2pweights.sources.chunker import build
    from p2pweights.sources.manifest import chunk_hasher

    path, data = model
    for name in ("sha256", "blake2b"):
        m, _, _ = build(path, CHUNK, name)
        assert Manifest.from_json(m.to_json()).hash == name
        assert m.chunks[1] == chunk_hasher(name)(data[CHUNK:2 * CHUNK])
