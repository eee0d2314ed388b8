"""A fleet whose tracker goes away: real ``p2pw tracker`` and ``p2pw get`` processes, moto as the bucket.

The tracker is killed mid-broadcast and not restarted: hosts that can read the
origin go back to it for what no partner holds, split among them so the origin
is read about once, and every copy completes, byte for byte.  A get with no
tracker, no peer and no origin fails with one line after ``--give-up-after``.
Assertions are on bytes, exit codes and counts, never on time; every process is
ended by PID in teardown (the ``procs`` fixture), pass or fail.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import same_tree
from test_fleet_get import get, progress, publish, published_id, report, size_of, start_tracker

pytestmark = pytest.mark.timeout(240) if hasattr(pytest.mark, "timeout") else []


def slow_proxy(s3, port: int, delay: float):
    """A recording proxy in front of moto whose every ranged GET waits ``delay`` s first (a slow bucket)."""
    proxy = s3.FaultProxy(port, [])
    take = proxy.take

    def slow(path, ranged):
        if ranged is not None:
            time.sleep(delay)
        return take(path, ranged)

    proxy.take = slow
    return proxy


def outage(procs, tmp_path, model_dir, delay: float, back_after: float | None):
    """3 gets with credentials, the tracker killed once chunks arrived and restarted ``back_after`` s later (None:
    never): every copy complete, byte for byte, and the origin read about once in all."""
    s3 = pytest.importorskip("test_s3")
    moto = s3.MotoServer()
    proxy = None
    try:
        s3.upload(moto.client(), model_dir, "outage", "model/")
        url = "s3://outage/model"
        tracker, port = start_tracker(procs, tmp_path)
        mid = published_id(publish(port, url, env=s3.s3_env(moto.url)))
        proxy = slow_proxy(s3, moto.port, delay)
        gets = [get(procs, url, port, tmp_path / f"h{k}", "--model-id", mid, "--s3-range-size", "256KiB",
                    env=s3.s3_env(proxy.url)) for k in range(3)]
        deadline = time.monotonic() + 60
        while not any(progress(tmp_path / f"h{k}").get("bytes") for k in range(3)):
            assert time.monotonic() < deadline and gets[0].popen.poll() is None, gets[0].output()
            time.sleep(0.05)
        assert all(g.popen.poll() is None for g in gets)  # mid-broadcast: no copy complete yet
        os.kill(tracker.pid, signal.SIGKILL)
        tracker.popen.wait(10)
        if back_after is not None:
            time.sleep(back_after)  # (a pause, not a measure: what is asserted is bytes and exit codes)
            start_tracker(procs, tmp_path, port=port, name="tracker2")  # empty: rebuilt from the members
        for g in gets:
            assert g.wait(150) == 0, g.output()
        for k in range(3):
            assert same_tree(model_dir, tmp_path / f"h{k}") == []
        reads = [report(tmp_path / f"h{k}") for k in range(3)]
        assert all(r["origin_reader"] and r["bad_chunks"] == 0 for r in reads)
        assert sum(r["origin_bytes_read"] for r in reads) <= 1.5 * size_of(model_dir)  # the origin read about once
    finally:
        if proxy is not None:
            proxy.close()
        moto.close()


def test_a_tracker_gone_for_good_mid_broadcast_costs_no_get_its_copy(procs, tmp_path, model_dir):
    outage(procs, tmp_path, model_dir, 0.4, None)


def test_a_tracker_back_mid_broadcast_takes_the_readers_back_and_the_origin_is_still_read_about_once(
        procs, tmp_path, model_dir):
    outage(procs, tmp_path, model_dir, 1.0, 7.0)  # back after the readers went back to source


def test_a_get_with_no_tracker_no_peer_and_no_origin_fails_with_one_line(procs, tmp_path, model_dir):
    tracker, port = start_tracker(procs, tmp_path)
    mid = published_id(publish(port, model_dir))
    lone = get(procs, model_dir, port, tmp_path / "lone", "--no-origin", "--model-id", mid, "--give-up-after", "3")
    deadline = time.monotonic() + 60
    while not (tmp_path / "lone" / ".p2pw").exists():  # joined: its copy is laid out
        assert time.monotonic() < deadline and lone.popen.poll() is None, lone.output()
        time.sleep(0.05)
    os.kill(tracker.pid, signal.SIGKILL)
    tracker.popen.wait(10)
    assert lone.wait(120) == 1, lone.output()
    lines = [ln for ln in lone.output().splitlines() if ln.startswith("p2pw: error:")]
    assert len(lines) == 1 and "Traceback" not in lone.output(), lone.output()


# ----- the pure rule: what a reader reads while its tracker is away -----------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def bits(*chunks) -> int:
    return sum(1 << i for i in set(chunks))


def test_the_tracker_is_away_after_a_few_silent_seconds_or_its_timeout_if_shorter():
    from p2pweights.swarm.policy.backtosource import AWAY_AFTER, tracker_away

    assert not tracker_away(10.0, 10.0 + AWAY_AFTER, 10.0)
    assert tracker_away(10.0, 10.1 + AWAY_AFTER, 10.0)
    assert tracker_away(10.0, 11.5, 1.0)


def test_readers_split_what_nobody_holds_by_blocks_and_each_reads_only_its_own():
    from p2pweights.swarm.policy.backtosource import BackToSource

    picks = {me: BackToSource(16, Clock(), block=4).reads(me, [r for r in (1, 5, 9) if r != me], 0)
             for me in (1, 5, 9)}
    assert picks == {1: [0, 1, 2, 3, 12, 13, 14, 15], 5: [4, 5, 6, 7], 9: [8, 9, 10, 11]}


def test_what_we_or_a_partner_hold_is_not_read():
    from p2pweights.swarm.policy.backtosource import BackToSource

    assert BackToSource(8, Clock(), block=4).reads(1, [], bits(0, 2, 5)) == [1, 3, 4, 6, 7]


def test_a_chunk_is_asked_of_the_origin_once_per_host_shares_included():
    from p2pweights.swarm.policy.backtosource import BackToSource

    b = BackToSource(8, Clock(), block=4)
    assert b.first_asks([0, 1, 1]) == [0, 1]  # a tracker's share, read before it went away
    assert b.reads(1, [], 0) == [2, 3, 4, 5, 6, 7]
    assert b.reads(1, [], 0) == []  # not yet landed: still not asked again
    assert b.first_asks([1, 2]) == []  # nor by the tracker's next share, once it is back
    b.failed(2)  # unless its read failed
    assert b.first_asks([1, 2]) == [2]


def test_a_stuck_readers_blocks_are_dealt_to_the_others_and_one_making_progress_keeps_them():
    from p2pweights.swarm.policy.backtosource import STUCK_AFTER, BackToSource

    clock = Clock()
    b = BackToSource(12, clock, block=2)  # readers 1, 2, 3: blocks 0..5 -> 1, 2, 3, 1, 2, 3
    assert b.reads(1, [2, 3], 0) == [0, 1, 6, 7]
    clock.t = STUCK_AFTER + 1  # 2 read chunk 2; 3 read nothing
    assert b.reads(1, [2, 3], bits(2)) == [4, 5]  # 3's blocks (4-5, 10-11) dealt to 1 and 2; 2 keeps its own
    clock.t = 2 * STUCK_AFTER + 2  # now 2 is stuck too: everything nobody holds is ours
    assert b.reads(1, [2, 3], bits(2)) == [3, 8, 9, 10, 11]


def test_a_reader_whose_blocks_are_all_held_is_not_stuck():
    from p2pweights.swarm.policy.backtosource import STUCK_AFTER, BackToSource

    clock = Clock()
    b = BackToSource(4, clock, block=2)
    assert b.reads(1, [2], 0) == [0, 1]
    clock.t = 10 * STUCK_AFTER
    assert b.reads(1, [2], bits(2, 3)) == []
