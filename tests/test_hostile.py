"""Hostile peers: what a stranger who can reach a node's port tries, each refused or survived.

A ``hostile.Stranger`` speaks the real protocol over a real ZeroMQ socket to a
real ``p2pw seed`` (or an in-process seeder where the test reads its tracker);
the pure tracker endpoint takes the cases that need a clock.  Every process a
test starts is ended by PID (the ``procs`` fixture), pass or fail.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hostile import Redirector, Stranger
from p2pweights.api import join, seed
from p2pweights.sources.chunker import build
from p2pweights.swarm.tracker.endpoint import TrackerEndpoint
from p2pweights.swarm.tracker.topology import make
from p2pweights.swarm.tracker.tracker import Tracker
from p2pweights.wire import protocol
from p2pweights.wire.protocol import Msg

CHUNK = 64 << 10


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, 6 * CHUNK + 123, dtype=np.uint8).tobytes())
    return path


def run_p2pw(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pweights", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single ``p2pw: error:`` line of a failed command (no traceback)."""
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("p2pw: error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def status(port) -> dict:
    r = run_p2pw("status", f"127.0.0.1:{port}", "--json", timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_hello_with_a_bogus_listen_address_is_refused_and_the_next_join_succeeds(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK)
    stranger = Stranger(info["port"])
    try:
        e = stranger.ask(Msg.HELLO, peer_id="ghost", listen="bogus")
        peer = procs.join(info["port"], tmp_path / "out")
        assert peer.wait(90) == 0, peer.output()
        assert "Traceback" not in peer.output() and (tmp_path / "out" / "model.bin").read_bytes() == model.read_bytes()
        assert e is not None and e.type == Msg.ERROR and "not HOST:PORT" in e.fields["message"]
    finally:
        stranger.close()


def test_one_connection_registers_one_member(procs, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK)
    stranger = Stranger(info["port"])
    try:
        first = stranger.ask(Msg.HELLO, peer_id="g0", listen="127.0.0.1:9")
        assert first.type == Msg.WELCOME
        for k in range(1, 20):  # made-up peer ids on the same connection
            stranger.send(Msg.HELLO, peer_id=f"g{k}", listen="127.0.0.1:9")
        assert stranger.answer(1.0).type == Msg.ERROR
        assert status(info["port"])["count"] == 1
    finally:
        stranger.close()


def test_a_hello_with_another_members_peer_id_takes_over_nothing(tmp_path, model):
    with seed(model, host="127.0.0.1", port=0, chunk_size=CHUNK) as s:
        dl = join(f"127.0.0.1:{s.port}", host="127.0.0.1", peer_id="victim", connect_timeout=10)
        stranger = Stranger(s.port)
        try:
            dl.wait(60)
            victim = s.tracker.members[dl.rank]
            listen = victim.listen
            for claim in ({}, {"rank": dl.rank}, {"rank": dl.rank, "secret": "0" * 32}):
                e = stranger.ask(Msg.HELLO, peer_id="victim", listen="10.6.6.6:1", **claim)
                assert e.type == Msg.WELCOME and e.fields["rank"] != dl.rank
                stranger.close()
                stranger = Stranger(s.port)
            assert s.tracker.members[dl.rank] is victim and victim.listen == listen and not victim.left
        finally:
            stranger.close()
            dl.close()


def test_status_without_a_key_shows_no_peer_ids(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK)
    peer = procs.join(info["port"], tmp_path / "out", "--stay")
    peer.wait_line("p2pw: done", timeout=90)
    doc = status(info["port"])
    assert doc["count"] == 1 and doc["peers"] and all("peer_id" not in p for p in doc["peers"]), doc


@pytest.mark.parametrize("target", ["bogus", "ipc:///tmp/p2pw-hostile", "tcp://127.0.0.1:0", "[::1", "h:99999"])
@pytest.mark.parametrize("command", ["join", "status"])
def test_a_redirect_to_a_bad_target_is_one_error_line(tmp_path, target, command):
    fake = Redirector(target)
    try:
        if command == "join":
            r = run_p2pw("join", "--parent", f"127.0.0.1:{fake.port}", "--host", "127.0.0.1", "--out",
                         tmp_path / "out", "--no-cache", "-q", "--connect-timeout", 10, timeout=60)
        else:
            r = run_p2pw("status", f"127.0.0.1:{fake.port}", timeout=60)
        assert "redirect target" in one_error_line(r)
        assert fake.asked == 1
    finally:
        fake.close()


def test_idle_attachers_without_a_ticket_lock_nobody_out(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK)
    strangers = [Stranger(info["port"]) for _ in range(64)]
    try:
        for s in strangers:  # each attaches and then reads nothing
            s.send(Msg.ATTACH, peer_id="idle", rank=1, model_id=info["model_id"])
        refusals = [s.answer() for s in strangers]
        peer = procs.join(info["port"], tmp_path / "out")
        assert peer.wait(90) == 0, peer.output()
        assert all(e is not None and e.type == Msg.ERROR and "not placed" in e.fields["message"] for e in refusals)
    finally:
        for s in strangers:
            s.close()


def test_connections_per_address_are_capped(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK, "--max-conns-per-host", 3)
    strangers = [Stranger(info["port"]) for _ in range(4)]
    try:
        for i, s in enumerate(strangers[:3]):  # members: each holds state at the seeder
            assert s.ask(Msg.HELLO, peer_id=f"s{i}", listen="127.0.0.1:9").type == Msg.WELCOME
        e = strangers[3].ask(Msg.HELLO, peer_id="s3", listen="127.0.0.1:9")
        assert e.type == Msg.ERROR and "too many connections from 127.0.0.1" in e.fields["message"]

    finally:
        for s in strangers:
            s.close()
    assert seeder.popen.poll() is None


def test_an_answered_status_holds_no_place_under_the_cap(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK, "--max-conns-per-host", 2)
    for _ in range(10):  # a monitor asking again and again from one host locks nobody out
        asker = Stranger(info["port"])
        try:
            assert asker.ask(Msg.STATUS).type == Msg.STATUS_REPLY
        finally:
            asker.close()
    assert seeder.popen.poll() is None


def test_an_honest_join_needs_two_connections_at_its_parent(procs, tmp_path, model):
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK, "--max-conns-per-host", 2)
    peer = procs.join(info["port"], tmp_path / "out", "--max-conns-per-host", 2)
    assert peer.wait(90) == 0, peer.output()  # its tracker link and its one chunk link


def test_a_join_that_ends_frees_its_places_under_the_cap_at_once(procs, tmp_path, model):
    # each join says BYE on its tracker link and its chunk links as it exits, so a host that joins again
    # and again (an agent, a restarted pod, pods behind one NAT address) is never locked out by its own past
    seeder, info = procs.seeder(model, "--chunk-size", CHUNK, "--max-conns-per-host", 2)
    for k in range(4):
        peer = procs.join(info["port"], tmp_path / f"out{k}")
        assert peer.wait(90) == 0, peer.output()
        assert (tmp_path / f"out{k}" / model.name).read_bytes() == model.read_bytes()
    assert seeder.popen.poll() is None


def test_only_a_ticket_the_tracker_gave_admits_an_attach(model):
    with seed(model, host="127.0.0.1", port=0, chunk_size=CHUNK) as s:
        stranger = Stranger(s.port)
        try:
            for ticket in (None, "0" * 32, s.tracker.seal.ticket(0, 4)):  # none, made up, another rank's
                e = stranger.ask(Msg.ATTACH, peer_id="x", rank=3, model_id=s.model_id, ticket=ticket)
                assert e.type == Msg.ERROR and e.fields["fatal"] and "not placed here" in e.fields["message"]
            e = stranger.ask(Msg.ATTACH, peer_id="x", rank=3, model_id=s.model_id, ticket=s.tracker.seal.ticket(0, 3))
            assert e.type == Msg.ATTACHED and not s.node.children == {}
        finally:
            stranger.close()


# ----- the tracker endpoint alone: a clock, no sockets -----------------------------------------

class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def endpoint(tmp_path, n):
    (tmp_path / "m.bin").write_bytes(bytes(range(256)) * 1024)
    clock = Clock()
    ep = TrackerEndpoint(Tracker(make("forest:2"), "10.0.0.0:7420", clock=clock),
                         build(str(tmp_path / "m.bin"), chunk_size=16 << 10)[0], clock)
    for i in range(1, n + 1):
        assert ep.hello(f"id{i}".encode(), {"peer_id": f"p{i}", "listen": f"10.0.0.{i}:7000"})
    ep.take()
    return ep, clock


def test_silent_members_expire(tmp_path):
    ep, clock = endpoint(tmp_path, 4)
    ep.member_timeout = 30.0
    for step in range(1, 8):  # 1, 2 and 3 keep reporting; 4 went silent after joining
        clock.t = 5.0 * step
        for r in (1, 2, 3):
            ep.heartbeat(f"id{r}".encode(), {"have": 0})
        ep.review()
    assert ep.tracker.members[4].left and b"id4" not in ep.members
    assert not any(ep.tracker.members[r].left for r in (1, 2, 3))


def test_a_reported_death_counts_only_about_the_reporters_own_parents_and_partners(tmp_path):
    ep, _ = endpoint(tmp_path, 8)
    t = ep.tracker
    reporter = t.members[1]
    victim = next(r for r in range(2, 9) if r not in (*reporter.parents, *reporter.partners))
    ep.orphan(b"id1", {"rank": 1, "stripe": 0, "parent": victim, "reason": "silent", "dead": True})
    assert not t.members[victim].left
    own = next(p for p in reporter.parents if p != 0) if any(reporter.parents) else reporter.partners[0]
    ep.orphan(b"id1", {"rank": 1, "stripe": 0, "parent": own, "reason": "silent", "dead": True})
    assert t.members[own].left


def test_a_restarted_member_proves_itself_with_its_secret_not_its_peer_id(tmp_path):
    ep, _ = endpoint(tmp_path, 3)
    assert ep.hello(b"new-conn", {"peer_id": "p2", "listen": "10.0.0.22:7000", "rank": 2,
                                  "secret": ep.tracker.seal.secret(2)})
    [(ident, frames)] = [x for x in ep.take() if protocol.decode(x[1]).type == Msg.WELCOME]
    welcome = protocol.decode(frames)
    assert ident == b"new-conn" and welcome.fields["rank"] == 2 and welcome.fields["secret"]
    assert ep.members.get(b"id2") is None and ep.members[b"new-conn"] == 2  # the old connection speaks for nobody
    assert ep.tracker.members[2].listen == "10.0.0.22:7000"
