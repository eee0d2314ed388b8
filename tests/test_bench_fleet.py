"""The broadcast benchmark's instrument (bench/fleet.py, bench/bt_peer.py): the copy check
catches a single changed byte, and the libtorrent baseline delivers byte-identical copies on
the emulated hosts, also with one leecher killed mid-transfer.

The testbed cases skip without network namespaces (not root) or without libtorrent (the
``bench`` extra); the Testbed ends every process it started and deletes its namespaces.
"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "netbed"))
sys.path.insert(0, str(ROOT / "bench"))

import fleet  # noqa: E402
from testbed import Testbed, list_netns  # noqa: E402

N = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from p2pweights.synth import write_synthetic_model

    d = tmp_path_factory.mktemp("fleet-model")
    write_synthetic_model(d / "model", size_mb=8, shards=2)
    return str(d / "model")


def test_compare_copy_names_the_first_differing_byte(model, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    fleet.compare_copy(model, str(copy), host=1)          # identical: no error
    victim = copy / "model-00002-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[123457] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(fleet.CopyMismatch, match=r"host 1: model-00002-of-00002.safetensors .* byte 123457"):
        fleet.compare_copy(model, str(copy), host=1)
    victim.write_bytes(bytes(data[:-1]))
    with pytest.raises(fleet.CopyMismatch, match="bytes, the source"):
        fleet.compare_copy(model, str(copy), host=1)
    (copy / "config.json").unlink()
    with pytest.raises(fleet.CopyMismatch, match="config.json missing"):
        fleet.compare_copy(model, str(copy), host=1)


_ok, _why = Testbed.available()
try:
    import libtorrent  # noqa: F401
    _lt = True
except ImportError:
    _lt = False


@pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")
@pytest.mark.skipif(not _lt, reason="libtorrent not installed (the bench extra)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill", [False, True], ids=["all", "kill"])
def test_libtorrent_baseline_on_three_hosts(model, tmp_path, kill):
    torrent = str(tmp_path / "model.torrent")
    t = fleet.make_torrent(model, torrent, 256 << 10)
    assert t["piece_size"] == 256 << 10 and t["pieces"] == -(-t["total_size"] // (256 << 10))
    with Testbed(N + 1, rate_mbit=50) as tb:              # 8 MiB at 50 Mbit/s: S/3 arrives well before the end
        run_id = tb.run_id
        r = fleet.run_libtorrent(tb, model, torrent, N, str(tmp_path), kill=kill, timeout=90)
    assert not [ns for ns in list_netns() if run_id in ns]
    survivors = {1, 2, 3} - ({r["killed"]["host"]} if kill else set())
    assert set(r["exits"]) == survivors                   # each exited 0 with a byte-identical copy
    assert all(r["reports"][h]["bytes"] == r["size"] for h in survivors)
    assert r["seed_tx"] >= r["size"] / 2                  # the seeder sent at least part of a copy
    if kill:
        assert r["killed"]["rx"] >= r["size"] / 3
