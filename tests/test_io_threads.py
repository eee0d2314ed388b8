"""libzmq's I/O threads (``--io-threads``): the default rule, the override, and joins carrying their bytes on
two I/O threads that end byte-exact, forwarding no corrupt chunk (disk and tmpfs)."""
import json

import pytest
import zmq

from conftest import forwarding_joins
from test_cli_input import assert_usage_error, run
from test_workers import where  # noqa: F401  (the disk and tmpfs fixture)

from p2pweights.wire.context import default_io_threads, node_context


def test_default_io_threads_one_per_four_cores_from_one_to_eight(monkeypatch):
    monkeypatch.delenv("P2PW_IO_THREADS", raising=False)
    assert [default_io_threads(c) for c in (1, 2, 3, 4, 7, 8, 16, 32, 64, 256)] == [1, 1, 1, 1, 1, 2, 4, 8, 8, 8]
    monkeypatch.setenv("P2PW_IO_THREADS", "3")
    assert default_io_threads(2) == 3
    monkeypatch.setenv("P2PW_IO_THREADS", "0")
    assert default_io_threads(64) == 1  # libzmq needs one to move any byte
    monkeypatch.setenv("P2PW_IO_THREADS", "lots")
    assert default_io_threads(16) == 4  # not a count: the rule


def test_a_node_context_has_the_io_threads_asked_for():
    for n in (1, 3):
        ctx = node_context(n)
        try:
            assert ctx.get(zmq.IO_THREADS) == n
        finally:
            ctx.term()


def test_forwarding_joins_on_two_io_threads_end_exact(procs, tmp_path, where):  # noqa: F811
    """Two joins on 2 I/O threads each, forwarding to each other and corrupting a fifth of what they send: both
    copies exact, every bad chunk fetched again."""
    _, reports = forwarding_joins(procs, tmp_path, where, "--io-threads", 2)
    for r in reports:
        assert r["io_threads"] == 2 and r["refetched"] == r["bad_chunks"]


def test_io_threads_must_be_a_positive_count(tmp_path):
    assert_usage_error(run("join", "--parent", "127.0.0.1:1", "--io-threads", "0"), "--io-threads")
    assert_usage_error(run("seed", str(tmp_path), "--io-threads", "x"), "--io-threads")
