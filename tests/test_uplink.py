"""The uplink probe's two ends on loopback: real sockets, the sink's limits, the kernel's timing."""
import socket
import struct
import threading
import time

import pytest

from conftest import free_port, same_tree

from p2pweights.swarm.node.uplink import ProbeSink, UplinkTiming, probe_in_background, split_host_port, time_uplink, timing_from

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sink():
    s = ProbeSink("127.0.0.1", connections=4, max_bytes=1 << 20, idle=0.5)
    yield s
    s.close()


def wait_for(predicate):
    while not predicate():  # the test's timeout bounds this
        time.sleep(0.01)


def closed_by_peer(conn: socket.socket) -> bool:
    """True once the other end has closed ``conn`` (it reads EOF or a reset)."""
    conn.settimeout(30)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_probe_s_bytes_all_reach_the_sink_and_its_kernel_times_them(sink):
    timing = time_uplink("127.0.0.1", sink.port, 1 << 20)
    assert timing.rate > 0 and timing.took > 0
    wait_for(lambda: sink.drained == 1 << 20)
    assert sink.drained == 1 << 20


def test_probes_in_background_report_their_result_or_none_when_nothing_listens(sink):
    got = []
    done = threading.Event()
    probe_in_background("127.0.0.1", sink.port, 4096, lambda t: (got.append(t), done.set()))
    assert done.wait(30) and isinstance(got[0], UplinkTiming)
    done.clear()
    probe_in_background("127.0.0.1", free_port(), 4096, lambda t: (got.append(t), done.set()))
    assert done.wait(30) and got[1] is None


def test_the_sink_closes_a_connection_that_sends_too_much_and_keeps_draining_others(sink):
    with socket.create_connection(("127.0.0.1", sink.port)) as hog:
        with pytest.raises(OSError):  # reset once the sink closed it with bytes unread
            for _ in range(100):
                hog.sendall(bytes(256 << 10))
    timing = time_uplink("127.0.0.1", sink.port, 64 << 10)
    assert timing.rate > 0


def test_the_sink_closes_idle_and_surplus_connections_and_stays_up(sink):
    idle = [socket.create_connection(("127.0.0.1", sink.port)) for _ in range(4)]
    try:
        wait_for(lambda: len(sink._open) == 4)
        with socket.create_connection(("127.0.0.1", sink.port)) as surplus:
            assert closed_by_peer(surplus)  # beyond its 4 at once: closed unread
        assert all(closed_by_peer(c) for c in idle)  # silent for longer than its idle limit
    finally:
        for c in idle:
            c.close()
    with socket.create_connection(("127.0.0.1", sink.port)) as c:
        c.sendall(b"garbage that is not a probe")
    assert time_uplink("127.0.0.1", sink.port, 4096).rate > 0


def test_timing_comes_from_the_kernel_s_busy_time_less_its_receive_window_stalls_else_the_wall_clock():
    info = bytearray(192)
    struct.pack_into("<Q", info, 120, 1 << 20)  # tcpi_bytes_acked
    struct.pack_into("<QQ", info, 168, 24_000, 4_000)  # tcpi_busy_time, tcpi_rwnd_limited (us)
    assert timing_from(bytes(info), 1 << 20, wall=0.5) == UplinkTiming((1 << 20) / 0.02, 0.02)
    assert timing_from(bytes(info[:104]), 1 << 20, wall=0.5) == UplinkTiming((1 << 20) / 0.5, 0.5)  # an old kernel
    struct.pack_into("<QQ", info, 168, 0, 0)  # faster than a jiffy
    assert timing_from(bytes(info), 1 << 20, wall=0.004) == UplinkTiming((1 << 20) / 0.004, 0.004)


def test_addresses_split_into_host_and_port():
    assert split_host_port("10.0.0.1:7420") == ("10.0.0.1", 7420)
    assert split_host_port("tcp://[::1]:7420") == ("::1", 7420)
    with pytest.raises(ValueError):
        split_host_port("no-port")


def test_joiners_time_their_uplinks_against_the_seeder_s_probe_port(procs, tmp_path, model_dir):
    seeder, info = procs.seeder(model_dir, "--probe-port", free_port())
    joins = [procs.join(info["port"], tmp_path / f"o{k}") for k in range(2)]
    for k, j in enumerate(joins):
        assert j.wait(60) == 0, j.output()
        assert same_tree(model_dir, tmp_path / f"o{k}") == []
    for rank in (1, 2):  # each probe reached the sink on that port and was reported
        seeder.wait_line(rf"peer rank {rank} probe [\d.]+ MB/s over \d+ ms")
