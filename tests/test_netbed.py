"""The emulated-host testbed (bench/netbed): a cap exists, teardown is complete."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "netbed"))

import testbed  # noqa: E402
from testbed import ForeignNamespaceError, Testbed, check_cap, flows, list_netns  # noqa: E402
from testbed import TCP_GOODPUT_FRACTION  # noqa: E402

_ok, _why = Testbed.available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")


def _ours(run_id: str) -> list[str]:
    return [n for n in list_netns() if run_id in n]


@pytest.mark.timeout(120)
def test_uplink_is_capped():
    with Testbed(3, rate_mbit=100) as tb:
        assert tb.addr(0) == "10.77.0.1" and tb.addr(2) == "10.77.0.3"
        res = check_cap(tb, seconds=1.5)
    ratio = res["single"]["mbit"] / 100
    # Generous: only says that a cap exists and is roughly the asked rate.
    assert 0.7 <= ratio <= 1.05, res
    assert res["dual"]["mbit"] / 100 <= 1.05, res


@pytest.mark.timeout(120)
def test_a_flow_that_starts_late_gets_its_share_of_the_uplink():
    # One FIFO under the cap starves the late flow (TCP small queues keep it at
    # a couple of packets behind the early flow's queue: about 5 of 100 Mbit/s
    # here); a host's fq_codel would not, and neither may the bed.
    with Testbed(3, rate_mbit=100) as tb:
        res = flows(tb, [(0, 1), (0, 2)], seconds=3.0, port=5241, stagger=1.0)
    late = res["per_flow_mbit"][1]
    assert late >= 0.3 * 100 * TCP_GOODPUT_FRACTION, res


@pytest.mark.timeout(120)
def test_teardown_removes_only_its_namespaces():
    with Testbed(2, rate_mbit=100) as tb:
        run_id = tb.run_id
        names = set(_ours(run_id))
        assert names == {f"p2pwnb-{run_id}-sw", f"p2pwnb-{run_id}-h0",
                         f"p2pwnb-{run_id}-h1"}
        p = tb.popen(0, ["sleep", "600"])
    assert _ours(run_id) == []
    assert p.poll() is not None  # the process it started was killed


@pytest.mark.timeout(120)
def test_teardown_on_exception():
    with pytest.raises(ZeroDivisionError):
        with Testbed(2, rate_mbit=100) as tb:
            run_id = tb.run_id
            assert len(_ours(run_id)) == 3
            1 / 0
    assert _ours(run_id) == []


@pytest.mark.timeout(120)
def test_refuses_foreign_namespace():
    foreign = f"p2pwnb-{testbed.secrets.token_hex(3)}-h0"  # looks like ours, is not
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        with Testbed(1, rate_mbit=100) as tb:
            with pytest.raises(ForeignNamespaceError):
                tb.delete_netns(foreign)
        assert foreign in list_netns()
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=True)


@pytest.mark.timeout(120)
def test_latency_without_netem_is_a_clear_error():
    try:
        with Testbed(1, rate_mbit=100, latency_ms=5):
            pass  # this kernel has netem: nothing to check
    except testbed.NetemUnavailable as exc:
        assert "netem" in str(exc)


@pytest.mark.timeout(120)
def test_per_host_rate():
    """rates={1: 25}: host 1's class holds 25 Mbit/s, the others 100; its flow stays under 25."""
    with Testbed(3, rate_mbit=100, rates={1: 25}) as tb:
        assert [tb.class_rate(i) for i in range(3)] == [100_000_000, 25_000_000, 100_000_000]
        assert tb.rate_of(1) == 25 and tb.rate_of(2) == 100
        slow = flows(tb, [(1, 2)], seconds=1.5, port=5301)
        tb.set_rates({2: 50})                       # changed in place, host 1 back to the default
        assert [tb.class_rate(i) for i in range(3)] == [100_000_000, 100_000_000, 50_000_000]
    # Generous lower bound (a shared 2-core machine); the cap itself is a hard upper bound.
    assert 0.5 * 25 <= slow["mbit"] <= 25 * 1.05, slow
    assert slow["tx_bytes"] >= slow["bytes"]        # frame bytes include the headers


def test_cpu_plan_gives_each_host_cores_of_its_own_or_none():
    from testbed import cpu_plan

    assert cpu_plan(3, cores=range(16)) == {0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10], 2: [11, 12, 13, 14, 15]}
    assert cpu_plan(9, 1, cores=range(16)) == {i: [1 + i] for i in range(9)}
    assert cpu_plan(9, cores=range(2)) == {}  # this VM: every host shares both cores
    assert cpu_plan(2, 2, cores=range(4)) == {}  # asked for more than fit


@pytest.mark.timeout(60)
def test_a_pinned_host_runs_on_its_cores_only():
    import os
    import time

    cores = sorted(os.sched_getaffinity(0))
    with Testbed(2, rate_mbit=100, cpus={1: [cores[-1]]}) as tb:
        pinned, free = tb.popen(1, ["sleep", "30"]), tb.popen(0, ["sleep", "30"])
        for p in (pinned, free):  # ``ip netns exec`` (and taskset) exec the command: the PID stays
            deadline = time.monotonic() + 10
            while Path(f"/proc/{p.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
                time.sleep(0.01)
        assert os.sched_getaffinity(pinned.pid) == {cores[-1]}
        assert os.sched_getaffinity(free.pid) == set(cores)


@pytest.mark.timeout(120)
def test_per_destination_ceiling():
    """dest_ceils={0: 25}: each of host 0's destination classes has ceil 25 Mbit/s, its uplink stays 100;
    one flow stays under 25, two to different hosts together pass it; other hosts keep their fair classes."""
    with Testbed(3, rate_mbit=100, dest_ceils={0: 25}) as tb:
        assert tb.class_rate(0) == 100_000_000
        assert [tb.class_ceil(0, j) for j in (1, 2)] == [25_000_000, 25_000_000]
        assert [tb.class_ceil(1, j) for j in (0, 2)] == [100_000_000, 100_000_000]
        one = flows(tb, [(0, 1)], seconds=1.5, port=5321)
        two = flows(tb, [(0, 1), (0, 2)], seconds=1.5, port=5331)
        tb.set_rate(0, 200)                         # changed in place: the ceilings stay
        assert tb.class_rate(0) == 200_000_000 and tb.class_ceil(0, 2) == 25_000_000
    assert one["mbit"] <= 25 * 1.05, one
    assert all(m <= 25 * 1.05 for m in two["per_flow_mbit"]), two
    assert two["mbit"] > 25 * 1.05, two             # the ceiling is per destination, not the host's
    with pytest.raises(ValueError, match="fair=True"):
        Testbed(2, dest_ceils={0: 25}, fair=False)
