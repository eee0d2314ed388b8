"""User mistakes at the command line: one clear error line and a non-zero exit, never a traceback.

Argument values argparse owns (a port, a count) end as argparse's usage error (exit 2); everything else as
one ``p2pw: error: ...`` line (exit 1)."""
import json
import os
import socket
import subprocess

from conftest import ROOT, p2pw_argv


def run(*args, cwd=ROOT, env=None, timeout=60):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(p2pw_argv(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)


def assert_one_line_error(r, needle, prefix="p2pw: error:"):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), r.stderr
    assert needle in lines[0], lines[0]


def assert_usage_error(r, needle):
    """argparse's answer to a bad argument value: exit 2, its usage, and one error line naming the argument."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and needle in errors[0], r.stderr


def good_manifest(tmp_path) -> dict:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(os.urandom(10000))
    r = run("manifest", tmp_path / "model", "-o", tmp_path / "good.json")
    assert r.returncode == 0, r.stderr
    return json.loads((tmp_path / "good.json").read_text())


# ----- cases that once ended in a traceback or a zero exit ----------------------------------------


def test_manifest_chunk_size_over_the_limit(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"x" * 5000)
    assert_one_line_error(run("manifest", tmp_path / "w.bin", "--chunk-size", "1TiB"), "up to 256 MiB")


def test_verify_a_manifest_of_random_bytes(tmp_path):
    (tmp_path / "m.json").write_bytes(b"\x86\xff\x00" + os.urandom(2000))
    (tmp_path / "copy").mkdir()
    assert_one_line_error(run("verify", tmp_path / "copy", "--manifest", tmp_path / "m.json"), "malformed manifest")


def test_verify_a_manifest_with_a_malformed_file_table_or_model_id(tmp_path):
    doc = good_manifest(tmp_path)
    bad = dict(doc, files=[1, 2])
    del bad["model_id"]
    (tmp_path / "files.json").write_text(json.dumps(bad))
    r = run("verify", tmp_path / "model", "--manifest", tmp_path / "files.json")
    assert_one_line_error(r, "a file entry is int, not an object")
    (tmp_path / "id.json").write_text(json.dumps(dict(doc, model_id=5)))
    assert_one_line_error(run("verify", tmp_path / "model", "--manifest", tmp_path / "id.json"), "fails its own hash")


def test_unpack_an_index_whose_tensors_are_not_a_list(tmp_path):
    from p2pweights.sources.synth import write_synthetic_model

    write_synthetic_model(tmp_path / "model", size_mb=1, shards=1)
    assert run("pack", tmp_path / "model", "-o", tmp_path / "packed").returncode == 0
    index = tmp_path / "packed" / "model.p2pw.json"
    index.write_text(json.dumps(dict(json.loads(index.read_text()), tensors=5)))
    r = run("pack", "--unpack", tmp_path / "packed", "-o", tmp_path / "out.safetensors")
    assert_one_line_error(r, "tensors must be a list")


def test_an_empty_key_directory_name_is_refused_not_the_current_directory(tmp_path):
    assert_one_line_error(run("keygen", "", cwd=tmp_path), "key directory name is empty")
    assert os.listdir(tmp_path) == []
    assert_one_line_error(run("status", "127.0.0.1:1", "--key", "", "--timeout", "1"), "key directory name is empty")


def test_status_address_that_is_no_address():
    for addr in ("127.0.0.1:-1", "127.0.0.1:99999", "a b:5", ""):
        assert_one_line_error(run("status", addr, "--timeout", "1"), f"bad address {addr!r}")


def test_seed_and_join_ports_and_counts_out_of_range(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"x" * 5000)
    assert_usage_error(run("seed", tmp_path / "w.bin", "--port", "99999"), "argument --port: bad port '99999'")
    assert_usage_error(run("seed", tmp_path / "w.bin", "--probe-port", "70000"), "argument --probe-port")
    assert_usage_error(run("join", "--parent", "127.0.0.1:1", "--window", "0"), "argument --window")
    assert_usage_error(run("seed", tmp_path / "w.bin", "--topology", "auto", "--expect", "-3"), "argument --expect")


def test_simulate_kill_of_a_rank_that_is_no_peer():
    r = run("simulate", "--nodes", "8", "--size", "256MiB", "--uplink", "400Mbit", "--kill", "99@0.5")
    assert_one_line_error(r, "RANK must be a peer (1-8)", prefix="p2pw simulate: error:")


def test_simulate_more_peers_than_it_models():
    """10^8 peers ran for hours, growing its memory, before it said anything."""
    r = run("simulate", "--nodes", "100000000", "--size", "1GB", "--uplink", "1Gbit", timeout=30)
    assert_one_line_error(r, "runs up to 1,000,000 peers", prefix="p2pw simulate: error:")


def test_cache_with_a_corrupt_record_a_stray_model_or_a_bad_backoff():
    root = os.environ["P2PW_CACHE_DIR"]
    os.makedirs(os.path.join(root, "index"), exist_ok=True)
    with open(os.path.join(root, "index", "ab" * 32 + ".json"), "w") as f:
        json.dump({"copies": [1], "uses": "x"}, f)  # torn or hand-edited: ignored, as a missing one is
    r = run("cache", "ls")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert_one_line_error(run("cache", "ls", "abab"), "p2pw cache ls takes no MODEL")
    assert_one_line_error(run("cache", "ls", env={"P2PW_FAILURE_BACKOFF": "soon"}), "P2PW_FAILURE_BACKOFF")


def test_cache_never_deletes_a_folder_outside_models_that_a_record_calls_owned(tmp_path):
    root, victim = os.environ["P2PW_CACHE_DIR"], tmp_path / "precious"
    victim.mkdir()
    (victim / "data").write_bytes(b"keep me")
    model_id = "cd" * 32
    os.makedirs(os.path.join(root, "index"), exist_ok=True)
    with open(os.path.join(root, "index", model_id + ".json"), "w") as f:  # hand-edited: "owned" outside models/
        json.dump({"bytes": 7, "copies": [{"path": str(victim), "owned": True}], "uses": [1.0]}, f)
    r = run("cache", "rm", model_id[:16])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (victim / "data").read_bytes() == b"keep me"  # forgotten by the cache, not deleted
    assert not os.path.exists(os.path.join(root, "index", model_id + ".json"))


def test_seed_and_join_on_a_host_that_is_no_address_here(tmp_path):
    """A failed bind left its socket open and the context's term() waited for it: both hung, silent."""
    (tmp_path / "w.bin").write_bytes(os.urandom(5000))
    for host in ("notahost", "192.0.2.77"):  # no such name; an address of no interface here (TEST-NET-1)
        assert_one_line_error(run("seed", tmp_path / "w.bin", "--host", host, "--port", "0", timeout=30),
                              f"cannot listen on {host}:0: no interface of this host has that name or address")
    assert_one_line_error(run("join", "--parent", "127.0.0.1:9", "--host", "notahost", "--out", tmp_path / "o",
                              timeout=30), "cannot listen on notahost:0")


def test_seconds_and_counts_out_of_range():
    for args, flag in ((("join", "--parent", "127.0.0.1:9", "--give-up-after", "nan"), "--give-up-after"),
                       (("join", "--parent", "127.0.0.1:9", "--connect-timeout", "-1"), "--connect-timeout"),
                       (("join", "--parent", "127.0.0.1:9", "--progress-every", "0"), "--progress-every"),
                       (("status", "127.0.0.1:9", "--timeout", "-1"), "--timeout"),
                       (("seed", ".", "--exit-after", "-2"), "--exit-after")):
        assert_usage_error(run(*args), flag)


def test_cache_rm_and_gc_of_an_unreadable_record():
    """A torn or hand-edited record: rm exited 0 saying nothing and kept it; gc kept it for ever."""
    root = os.environ["P2PW_CACHE_DIR"]
    index, own = os.path.join(root, "index"), os.path.join(root, "models", "ef" * 32)
    os.makedirs(index, exist_ok=True)
    os.makedirs(own)
    with open(os.path.join(own, "part"), "wb") as f:
        f.write(b"partial")
    for m in ("ef" * 32, "fe" * 32, "fa" * 32):
        with open(os.path.join(index, m + ".json"), "w") as f:
            f.write('{"copies": [1], "uses": "x"}')
    r = run("cache", "rm", "efef")
    assert r.returncode == 0 and r.stdout.strip() == f"p2pw: removed {own}", r.stdout + r.stderr
    r = run("cache", "rm", "fefe")
    assert r.returncode == 0 and "forgot fefe: the cache kept no copy of it" in r.stdout, r.stdout + r.stderr
    r = run("cache", "gc")
    assert r.returncode == 0 and "dropped the unreadable record" in r.stdout and "fa" * 32 in r.stdout, r.stdout
    assert not os.path.exists(own)
    assert sorted(n for n in os.listdir(index) if n.endswith(".json")) == []


def test_report_and_ready_files_in_a_missing_folder_are_refused_before_any_work(tmp_path):
    """A join downloaded the whole model, then failed on its --report naming a temporary file."""
    missing = tmp_path / "nowhere" / "r.json"
    assert_usage_error(run("join", "--parent", "127.0.0.1:9", "--report", missing), "--report")
    assert_usage_error(run("seed", tmp_path, "--ready", missing), "--ready")
    assert_usage_error(run("seed", tmp_path, "--report", missing), "--report")


def test_hosts_that_are_no_name_or_address():
    """A host 'bad!!' was taken, and a join advertised 'HOST:PORT' to its peers with its own port appended."""
    assert_one_line_error(run("status", "bad!!:7420", "--timeout", "1"), "bad address 'bad!!:7420'")
    for advertise in ("bad!!", "10.0.0.5:7000"):
        assert_one_line_error(run("join", "--parent", "127.0.0.1:9", "--advertise", advertise), "bad --advertise")


# ----- cases that were already right, kept so ------------------------------------------------------


def test_status_nobody_listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nobody listens once closed
    assert_one_line_error(run("status", f"127.0.0.1:{port}", "--timeout", "1"), "no answer from")


def test_manifest_of_a_missing_path_or_random_bytes_named_safetensors(tmp_path):
    assert_one_line_error(run("manifest", tmp_path / "nope"), "no such file or directory")
    (tmp_path / "r.safetensors").write_bytes(os.urandom(5000))
    assert_one_line_error(run("manifest", tmp_path / "r.safetensors"), "r.safetensors")
    assert_one_line_error(run("verify", tmp_path, "--manifest", tmp_path / "nope.json"), "cannot read manifest")
