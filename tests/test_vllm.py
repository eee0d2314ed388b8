"""A real vLLM (CPU) with ``--load-format p2pweights``: the same tokens and embeddings as its default loader.

Every engine runs in its own process in the vLLM venv (.venv-vllm, built by .ci/run from tests/vllm/);
without that venv these tests skip.  Reference outputs come from vLLM's default loader reading the same
files, in a separate process."""
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINE = ROOT / "tests" / "vllm" / "engine.py"
RUN_TIMEOUT = 300

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM venv at {PYTHON} (bash .ci/run builds it)")]


@pytest.fixture(scope="module")
def env():
    rpc = tempfile.mkdtemp(prefix="p2pw-vllm-rpc-")
    e = dict(os.environ, VLLM_RPC_BASE_PATH=rpc, PYTHONPATH=str(ROOT), VLLM_CONFIGURE_LOGGING="1",
             TOKENIZERS_PARALLELISM="false")
    for k in [k for k in e if k.startswith("P2PW_")]:
        del e[k]
    yield e
    shutil.rmtree(rpc, ignore_errors=True)


SHM = Path("/dev/shm")
SHM_LEFT = ("psm_", "sem.mp-")  # multiprocessing's shared memory and semaphores, which vLLM's processes make


def shm_names() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(SHM_LEFT)} if SHM.is_dir() else set()


def mapped(names: set[str]) -> set[str]:
    """Those of ``names`` (in /dev/shm) that some process still maps."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")) if names else ():
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    name = line.rstrip("\n").rsplit("/", 1)[-1].removesuffix(" (deleted)")
                    if "/dev/shm/" in line and name in names:
                        found.add(name)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module", autouse=True)
def shared_memory_removed():
    """vLLM's processes, killed, leave their shared-memory segments in /dev/shm (hundreds of MB each): remove
    those that appeared during these tests, once no process maps them (an engine core may end a moment after
    the group it was started in)."""
    before = shm_names()
    yield
    deadline = time.monotonic() + 30
    while (left := shm_names() - before) and mapped(left) and time.monotonic() < deadline:
        time.sleep(0.5)
    for name in left - mapped(left):
        try:
            (SHM / name).unlink()
        except OSError:
            pass


def start(argv, env, pipe: bool = False) -> subprocess.Popen:
    """A process in a group of its own (vLLM starts an engine core and workers under it); its output goes to
    a file (``p.log``), or a pipe with ``pipe``: an engine core outliving the engine must not hold a pipe open."""
    log = None if pipe else tempfile.NamedTemporaryFile("w+", prefix="p2pw-vllm-", suffix=".log", delete=False)
    p = subprocess.Popen([str(PYTHON), *map(str, argv)], env=env, stdout=subprocess.PIPE if pipe else log,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    p.log = log and log.name
    if log:
        log.close()
    return p


def end(p: subprocess.Popen) -> None:
    """End ``p`` and whatever it started (its process group, by its PID), whether or not ``p`` itself ended."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(10)


def finish(p: subprocess.Popen, timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
    """Wait for ``p`` (a file-logged process) to exit, end its group, and return its exit status and output."""
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        code = p.poll()
        end(p)
        out = Path(p.log).read_text(errors="replace")
        os.unlink(p.log)
    if code is None:
        pytest.fail(f"vLLM run still going after {timeout} s:\n{out[-4000:]}")
    return code, out


def run(argv, env, timeout: float = RUN_TIMEOUT) -> tuple[dict, str]:
    """Run engine.py to the end; its RESULT line and its output."""
    code, out = finish(start([ENGINE, *argv], env), timeout)
    assert code == 0, out[-20000:]
    found = re.search(r"^RESULT (.*)$", out, re.M)
    assert found, out[-6000:]
    return json.loads(found.group(1)), out


@pytest.fixture(scope="module")
def models(tmp_path_factory, env):
    d = tmp_path_factory.mktemp("vllm")
    for what in ("llama", "minilm"):
        code, out = finish(start([ENGINE, what, d / what], env), 120)
        assert code == 0, out[-4000:]
    return d


@pytest.fixture(scope="module")
def reference(models, env):
    tokens, _ = run(["generate", models / "llama"], env)
    vectors, _ = run(["embed", models / "minilm"], env)
    return {"tokens": tokens["tokens"], "embeddings": vectors["embeddings"]}


@pytest.fixture
def seeder(env, tmp_path):
    started = []

    def seed(path, faults: str | None = None) -> str:
        e = dict(env, **({"P2PW_FAULTS": faults} if faults else {}))
        p = start(["-m", "p2pweights", "seed", path, "--host", "127.0.0.1", "--port", "0", "--chunk-size", "262144"],
                  e | {"P2PW_CACHE_DIR": str(tmp_path / "cache")}, pipe=True)
        started.append(p)
        deadline = time.monotonic() + 60
        for line in p.stdout:
            m = re.search(r"join --parent (\S+)", line)
            if m:
                return m.group(1)
            assert time.monotonic() < deadline, "the seeder did not start"
        pytest.fail("the seeder ended before serving")
    yield seed
    for p in started:
        end(p)


def config_only(src: Path, dst: Path) -> Path:
    """A model folder as a host has it before any weights: the config and tokenizer files only."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return dst


def test_generated_tokens_equal_the_default_loaders_with_chunks_corrupted_in_transit(models, reference, seeder,
                                                                                       env, tmp_path):
    parent = seeder(models / "llama", faults="corrupt=0.02,seed=3")  # a chunk in fifty sent is damaged
    host = config_only(models / "llama", tmp_path / "host")
    got, out = run(["generate", host, "--load-format", "p2pweights",
                    "--extra", json.dumps({"parent": parent})], env)
    assert got["tokens"] == reference["tokens"]
    assert "(joined the swarm)" in out and "first tensor" in out  # the stage report, in vLLM's log
    assert (host / ".p2pw" / "complete.json").exists()


def test_two_engines_on_one_host_share_one_download(models, reference, seeder, env, tmp_path):
    parent = seeder(models / "llama")
    host = config_only(models / "llama", tmp_path / "host")
    e = dict(env, P2PW_PARENT=parent)  # the environment fallback, as a Kubernetes pod sets it
    procs = [start([ENGINE, "generate", host, "--load-format", "p2pweights"], e) for _ in range(2)]
    try:
        results = [finish(p) for p in procs]
    finally:
        for p in procs:
            end(p)
    assert [code for code, _ in results] == [0, 0], [out[-4000:] for _, out in results]
    outs = [out for _, out in results]
    for out in outs:
        assert json.loads(re.search(r"^RESULT (.*)$", out, re.M).group(1))["tokens"] == reference["tokens"]
    assert sorted("(joined the swarm)" in out for out in outs) == [False, True]  # one download for the host
    assert sum("attached to this host's copy" in out for out in outs) == 1


def test_embeddings_equal_the_default_loaders(models, reference, seeder, env, tmp_path):
    parent = seeder(models / "minilm")
    host = config_only(models / "minilm", tmp_path / "host")
    got, _ = run(["embed", host, "--load-format", "p2pweights", "--extra", json.dumps({"parent": parent})], env)
    assert got["embeddings"] == reference["embeddings"]


def test_a_complete_copy_loads_without_a_parent_and_bad_options_fail(models, reference, seeder, env, tmp_path):
    parent = seeder(models / "llama")
    host = config_only(models / "llama", tmp_path / "host")
    code, out = finish(start(["-m", "p2pweights", "join", "--parent", parent, "--out", host, "--no-cache"], env), 120)
    assert code == 0, out
    got, out = run(["generate", host, "--load-format", "p2pweights"], env)  # pre-warmed: no parent needed
    assert got["tokens"] == reference["tokens"] and "(attached to this host's copy)" in out
    code, out = finish(start([ENGINE, "generate", host, "--load-format", "p2pweights",
                              "--extra", json.dumps({"parnet": parent})], env))
    assert code != 0 and "unknown p2pweights option 'parnet'" in out
