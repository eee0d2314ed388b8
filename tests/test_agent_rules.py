"""The node agent's decisions alone (pure): who may use its socket, which requests it refuses, the pre-warm
list, what it may evict, its readiness; and the standalone tracker's rule that late arrivals partner with
complete holders first."""
from __future__ import annotations

import os

import pytest

from p2pweights.agent.rules import PrewarmFile, changes, prewarm_lines, readiness, victims
from p2pweights.storage.modelcache import Entry, EvictionPolicy
from p2pweights.swarm.tracker.rootless import RootlessTracker, complete_holders
from p2pweights.swarm.tracker.topology import make
from p2pweights.swarm.tracker.tracker import PARTNERS
from p2pweights.wire import local


# ----- the socket's decisions -------------------------------------------------------------------------------

def test_the_agents_user_root_and_the_named_group_are_admitted_nobody_else():
    assert local.admit(1000, 1000, [], agent_uid=1000, group=None) is None
    assert local.admit(0, 0, [], agent_uid=1000, group=None) is None
    assert "uid 1001" in local.admit(1001, 1001, [27], agent_uid=1000, group=None)
    assert local.admit(1001, 500, [], agent_uid=1000, group=500) is None  # primary group
    assert local.admit(1001, 1001, [500], agent_uid=1000, group=500) is None  # supplementary group
    assert local.admit(1001, 1001, [27], agent_uid=1000, group=500) is not None


def test_a_local_path_outside_the_cache_is_refused_urls_and_ids_are_not(tmp_path):
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    os.symlink("/etc", cache / "escape")
    assert "outside the agent's cache" in local.refusal("/etc/shadow", str(cache))
    assert local.refusal("../../etc", str(cache)) is not None
    assert local.refusal(str(cache / "escape" / "passwd"), str(cache)) is not None  # a symlink out of the cache
    assert local.refusal(str(cache / "models" / "x"), str(cache)) is None
    for model in ("s3://bucket/llama", "Qwen/Qwen2.5-0.5B", "3f2a" * 16, "3f2a3f2a3f2a3f2a"):
        assert local.refusal(model, str(cache)) is None


@pytest.mark.parametrize("doc, error", [
    ({}, "unknown op"), ({"op": "rm"}, "unknown op"), ({"op": "get"}, "needs"), ({"op": "get", "model": " "}, "needs"),
    ({"op": "get", "model": 7}, "needs"), ({"op": "get", "model": "a\0b"}, "needs"),
])
def test_malformed_requests_are_one_error(doc, error):
    with pytest.raises(local.AgentError, match=error):
        local.parse(doc)


def test_requests_round_trip_as_one_json_line():
    line = local.encode({"op": "get", "model": "s3://b/m"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert local.parse(local.decode(line[:-1])) == ("get", "s3://b/m")
    assert local.parse({"op": "status"}) == ("status", None)
    for bad in (b"[1]", b"{", b"\xff"):
        with pytest.raises(local.AgentError):
            local.decode(bad)


def test_the_agent_directory_comes_from_the_flag_else_the_environment():
    assert local.agent_dir("/a", {"P2PW_AGENT": "/b"}) == "/a"
    assert local.agent_dir(None, {"P2PW_AGENT": "/b"}) == "/b"
    assert local.agent_dir(None, {}) is None


# ----- the pre-warm list ------------------------------------------------------------------------------------

def test_prewarm_lines_skip_blanks_and_comments_and_repeat_nothing():
    text = "# models\ns3://b/llama\n\n  Qwen/Qwen2.5-0.5B  \ns3://b/llama\n#s3://b/old\n"
    assert prewarm_lines(text) == ["s3://b/llama", "Qwen/Qwen2.5-0.5B"]
    assert changes(["a", "b"], ["b", "c"]) == (["c"], ["a"])


def test_the_prewarm_file_is_read_again_only_when_it_changed(tmp_path):
    path = tmp_path / "prewarm"
    f = PrewarmFile(str(path))
    assert f.poll() is None  # no file: nothing listed, nothing changed
    path.write_text("a\n")
    assert f.poll() == ["a"]
    assert f.poll() is None
    new = tmp_path / "prewarm.new"
    new.write_text("a\nb\n")
    os.replace(new, path)  # as a ConfigMap's volume is updated
    assert f.poll() == ["a", "b"]
    path.unlink()
    assert f.poll() == []


# ----- eviction and readiness -------------------------------------------------------------------------------

def entry(model_id, bytes=100, uses=(0.0,), in_use=True, complete=True):
    return Entry(model_id, bytes, list(uses), fetch_seconds=1.0, complete=complete, in_use=in_use,
                 path=f"/c/models/{model_id}")


def test_models_the_agent_serves_may_be_evicted_unless_kept_or_held_by_another_process():
    policy = EvictionPolicy(clock=lambda: 0.0)
    entries = [entry("a", uses=[0.0] * 5), entry("b"), entry("c"), entry("d", in_use=False)]
    # a, b, c: the agent serves them (its own lock makes them look in use); d: nobody holds it
    chosen = victims(entries, kept={"b"}, closable={"a", "b"}, incoming=150, budget=400, policy=policy)
    assert sorted(e.model_id for e in chosen) == ["a", "d"]  # c: held by another process; b: on the list
    assert victims(entries, kept={"a", "b"}, closable={"a", "b"}, incoming=250, budget=400, policy=policy) is None
    assert victims(entries, kept=set(), closable=set(), incoming=0, budget=400, policy=policy) == []


def test_the_agent_is_ready_once_every_prewarm_model_is():
    assert readiness({}) == (True, {})
    assert readiness({"s3://b/a": "ready", "s3://b/b": "fetching"}) == (False, {"s3://b/b": "fetching"})


# ----- late arrivals (the standalone tracker) ---------------------------------------------------------------

def test_a_late_arrival_partners_with_the_complete_holders_first():
    t = RootlessTracker(make("forest:2"), "", clock=lambda: 0.0)
    early = [t.join(f"p{i}", f"127.0.0.1:{7000 + i}") for i in range(8)]
    for m in early[:5]:
        t.done(m.rank)
    t.take_moved()
    late = t.join("late", "127.0.0.1:7100")
    holders = [m.rank for m in early[:5]]
    assert len(late.partners) == PARTNERS
    assert set(late.partners) <= set(holders)  # every partner holds the whole model
    assert set(t.take_moved()) >= set(late.partners)  # each holder is told of its new partner
    # the next one goes first to the holder feeding the fewest unfinished partners
    order = complete_holders(t.members, t.roster.live, rank=-1)
    assert order[0] not in late.partners and set(order) == set(holders)
    second = t.join("later", "127.0.0.1:7101")
    assert second.partners[0] == order[0]


def test_with_no_complete_holder_a_newcomer_is_partnered_as_before():
    from p2pweights.swarm.tracker.tracker import Tracker

    t = RootlessTracker(make("forest:2"), "", clock=lambda: 0.0)
    plain = Tracker(make("forest:2"), "", clock=lambda: 0.0)
    members = [t.join(f"p{i}", f"127.0.0.1:{7000 + i}") for i in range(8)]
    same = [plain.join(f"p{i}", f"127.0.0.1:{7000 + i}") for i in range(8)]
    assert [m.partners for m in members] == [m.partners for m in same]  # the seeded tracker's random partners
    assert complete_holders(t.members, t.roster.live, members[-1].rank) == []
