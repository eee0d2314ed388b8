"""Simulator: closed-form cases (star, chain, binomial root, striped, credit window),
coarsening, and the command line."""
import numpy as np
import pytest

from p2pweights.swarm import simulate as sim
from p2pweights.swarm.tracker import topology as T

MiB = 2 ** 20
S, C, B = 256 * MiB, 4 * MiB, 400e6 / 8   # 256 MiB, 4 MiB chunks, 400 Mbit/s


def run(n, topo, **kw):
    kw.setdefault("efficiency", 1.0)
    return sim.simulate(n, kw.pop("size", S), B, kw.pop("chunk", C), topo, **kw)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 40])
def test_star_takes_n_copies_of_the_seeder_uplink(n):
    r = run(n, "star")
    assert r.time_last == pytest.approx(n * S / B, rel=1e-6)
    assert r.seeder_tx_bytes == pytest.approx(n * S)
    assert r.ratio == pytest.approx(n, rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 100])
def test_chain_is_one_copy_plus_pipeline_fill(n):
    r = run(n, "chain")
    assert r.time_last == pytest.approx(S / B + (n - 1) * C / B, rel=1e-6)
    assert r.seeder_tx_bytes == pytest.approx(S)
    # peer r is done one chunk-time after peer r - 1
    assert np.allclose(np.diff(r.time_per_peer), C / B)


def test_efficiency_scales_the_uplink():
    r = sim.simulate(4, S, B, C, "chain")  # default efficiency 0.956
    assert r.time_last == pytest.approx((S + 3 * C) / (B * 0.956), rel=1e-6)
    assert r.floor == pytest.approx(S / B)


def test_chain_with_latency():
    # request takes L to reach the parent, the chunk L to come back: one extra L per hop
    L, n = 2e-3, 10
    r = run(n, "chain", latency=L)
    assert r.time_last == pytest.approx(S / B + (n - 1) * C / B + (n + 1) * L, rel=1e-6)


def test_window_of_one_waits_a_round_trip_per_chunk():
    L = 5e-3
    r = run(1, "star", latency=L, window=1)
    assert r.time_last == pytest.approx((S // C) * (C / B + 2 * L), rel=1e-6)
    r8 = run(1, "star", latency=L, window=8)  # a full window hides the round trip
    assert r8.time_last == pytest.approx(S / B + 2 * L, rel=1e-6)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_binomial_costs_about_the_root_fanout(n):
    fanout = n.bit_length()  # the root's children: 1, 2, 4, ... <= n
    r = run(n, "binomial")
    assert fanout <= r.ratio <= fanout * 1.05   # plus a few chunk-times of fill
    assert r.seeder_tx_bytes == pytest.approx(fanout * S)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_striped_is_near_its_head_bound(n):
    # striped:2 after the tracker's adoptions: the seeder sends one copy (full rounds),
    # a head uploads at most (k + 1)/k = 1.5 copies (two head children and one leaf)
    r = run(n, "striped:2")
    assert r.seeder_tx_bytes == pytest.approx(1.0 * S)
    assert 1.0 <= r.ratio <= (1.5 if n >= 6 else 1.0) * 1.10
    assert r.stripes == 2


def test_kary_interior_uploads_k_copies():
    r = run(40, "kary:3")
    assert 3 <= r.ratio <= 3 * 1.06


def test_single_peer_is_the_floor_for_every_topology():
    for name in ("binomial", "chain", "star", "kary:4", "striped:2", "striped:4"):
        assert run(1, name).ratio == pytest.approx(1.0, rel=1e-6), name


def test_ragged_last_chunk_and_tiny_models():
    r = run(3, "chain", size=10 * MiB + 123, chunk=C)
    assert r.time_last == pytest.approx((10 * MiB + 123 + 2 * C) / B, rel=1e-6)
    r = run(5, "striped:4", size=C, chunk=C)   # fewer chunks than stripes
    assert np.all(r.time_per_peer > 0)


@pytest.mark.parametrize("name", ["chain", "binomial", "kary:2", "striped:2", "striped:4"])
def test_coarsened_run_agrees_with_the_exact_one(name):
    exact = run(300, name, budget=10 ** 9)
    coarse = run(300, name, budget=3_000)
    assert coarse.coarsened > 1 and exact.coarsened == 1
    assert coarse.time_last == pytest.approx(exact.time_last, rel=0.02)


def test_auto_and_topology_objects():
    assert run(8, "auto").topology == "chain"
    assert run(100, "auto").topology == "striped:2"
    assert run(8, T.KAry(2)).topology == "kary:2"


def test_result_summary_and_report():
    r = run(16, "striped:2")
    s = r.summary
    assert s["min"] <= s["median"] <= s["max"] == r.time_last
    assert len(r.time_per_peer) == 16
    text = r.report()
    assert "ratio" in text and "striped:2" in text and "seeder" in text


def test_bad_arguments():
    with pytest.raises(ValueError):
        sim.simulate(0, S, B, C, "chain")
    with pytest.raises(ValueError):
        sim.simulate(4, S, -1, C, "chain")
    with pytest.raises(ValueError):
        sim.simulate(4, S, B, C, "nope")


def test_units():
    assert sim.parse_size("256MiB") == 256 * MiB
    assert sim.parse_size("140GB") == 140 * 10 ** 9
    assert sim.parse_size("4MiB") == 4 * MiB
    assert sim.parse_size("1048576") == MiB
    assert sim.parse_rate("400Mbit") == pytest.approx(50e6)
    assert sim.parse_rate("400Mbps") == pytest.approx(50e6)
    assert sim.parse_rate("1Gbit/s") == pytest.approx(125e6)
    assert sim.parse_rate("50MB/s") == pytest.approx(50e6)
    assert sim.parse_rate("50MiB/s") == pytest.approx(50 * MiB)
    assert sim.parse_duration("1ms") == pytest.approx(1e-3)
    assert sim.parse_duration("200us") == pytest.approx(2e-4)
    assert sim.parse_duration("0.5") == 0.5
    for bad in ("lots", "4Mb", "3parsecs"):
        with pytest.raises(ValueError):
            sim.parse_size(bad)
    with pytest.raises(ValueError):
        sim.parse_rate("fast")


def test_cli(capsys):
    rc = sim.main(["--nodes", "16", "--size", "256MiB", "--uplink", "400Mbit", "--chunk", "4MiB",
                   "--topology", "kary:4", "--latency", "1ms"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "kary:4" in out and "floor" in out and "ratio" in out and "depth 2" in out
    rc = sim.main(["--nodes", "4", "--size", "lots", "--uplink", "400Mbit"])
    assert rc == 2
    assert "error" in capsys.readouterr().err


def test_forest_plan_sends_one_copy_from_the_seeder_and_stays_near_the_floor():
    r = sim.simulate(8, 256 << 20, 50e6, 1 << 20, "forest:2")
    assert r.seeder_tx_bytes == 256 << 20
    assert r.ratio < 1.1


def test_slow_hosts_cost_only_their_share_of_the_uplinks():
    from p2pweights.swarm.simulate import slow_uplinks

    even = sim.simulate(16, 256 << 20, 50e6, 1 << 20, "forest:2")
    ups = slow_uplinks(16, 50e6, 2 / 16, 0.25)
    assert sorted(ups)[:2] == [12.5e6, 12.5e6]
    slow = sim.simulate(16, 256 << 20, 50e6, 1 << 20, "forest:2", uplinks=ups)
    # the fluid bound: 15 copies over the peers' uplinks (14 full, 2 at a quarter)
    assert slow.time_last >= even.time_last
    assert slow.ratio < even.ratio * 1.15


def test_each_demoted_host_serves_one_unplaced_pair_and_the_forwarders_the_rest():
    from p2pweights.swarm.simulate import _busiest

    size, k, r = 1000.0, 2, 10.0
    alone = _busiest(size, k, 4, np.array([]), r, 8)  # no spare slot: 8 forwarders share 4 half-stripes
    assert alone == (size + 4 * size / k / 8) / r
    spares = np.array([2.5, 2.5])  # two hosts at a quarter of the forwarders' rate
    t = _busiest(size, k, 4, spares, r, 8)
    assert size / r < t < alone
    assert t == pytest.approx((size + (4 * size / k - 2 * 2.5 * t) / 8) / r)  # they serve while it works
    assert _busiest(size, k, 2, np.array([1e6, 1e6]), r, 8) == size / r  # at most a stripe each: all of it


def test_a_killed_peer_costs_the_rest_of_the_model_over_the_re_placed_plan():
    calm = sim.simulate(8, 256 << 20, 50e6, 1 << 20, "forest:2")
    hit = sim.simulate(8, 256 << 20, 50e6, 1 << 20, "forest:2", failures=[(1, 1 / 3)])
    assert np.isnan(hit.time_per_peer[0]) and not np.isnan(hit.time_per_peer[1:]).any()
    assert calm.time_last <= hit.time_last < 1.3 * calm.time_last


def test_simulate_cli_takes_slow_hosts_and_kills(capsys):
    from p2pweights.swarm.simulate import main

    assert main(["--nodes", "16", "--size", "64MiB", "--uplink", "400Mbit", "--slow", "0.125:0.25",
                 "--kill", "3@0.5"]) == 0
    out = capsys.readouterr().out
    assert "ratio" in out and "nan" not in out  # the killed peer has no finish time: the survivors' are shown
    assert main(["--nodes", "4", "--size", "64MiB", "--uplink", "400Mbit", "--uplinks", "1Gbit,2Gbit"]) == 2


def test_peers_joining_after_the_launch_finish_that_much_later(capsys):
    # startup: the time a process takes to start and reach the tracker, which a user waits for too
    from p2pweights.swarm.simulate import main

    for kw in ({}, {"uplinks": [50e6] * 7 + [12.5e6]}, {"failures": [(2, 1 / 3)]}):
        now = sim.simulate(8, 256 << 20, 50e6, 1 << 20, "forest:2", **kw)
        late = sim.simulate(8, 256 << 20, 50e6, 1 << 20, "forest:2", startup=0.4, **kw)
        assert late.time_last == pytest.approx(now.time_last + 0.4)
        assert np.allclose(late.time_per_peer, now.time_per_peer + 0.4, equal_nan=True)
        assert late.ratio == pytest.approx(late.time_last / now.floor)
    with pytest.raises(ValueError, match="startup"):
        sim.simulate(8, S, B, C, "forest:2", startup=-1)
    assert main(["--nodes", "8", "--size", "64MiB", "--uplink", "400Mbit", "--startup", "400ms"]) == 0
    assert "joining 0.400 s after the launch" in capsys.readouterr().out
