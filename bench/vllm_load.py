"""vLLM engine start to first generated token: ``--load-format p2pweights`` against the default loader.

Three ways to the same model (a random-init Llama, float32, a few hundred MB), same engine arguments
(tests/vllm/engine.py), each timed from the moment the first process starts to the first token:

- ``default``: vLLM's default loader reading the files already on local disk (the floor);
- ``join+default``: ``p2pw join --out DIR`` from the swarm, then the default loader reading DIR;
- ``p2pweights``: ``--load-format p2pweights``, the engine's weights straight from the swarm.

The swarm has two peers before vLLM comes: the seeder and one peer holding the model (``p2pw join --stay``).
Needs the vLLM venv (.venv-vllm, built by .ci/run).  ``python bench/vllm_load.py [--repeat N] [--hidden H
--layers L]``; prints a Markdown table (median, min-max, ratio to ``default``)."""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINE = ROOT / "tests" / "vllm" / "engine.py"


def start(argv, env, **kw) -> subprocess.Popen:
    return subprocess.Popen([str(PYTHON), *map(str, argv)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def end(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(10)


def until(p: subprocess.Popen, pattern: str, timeout: float = 600) -> re.Match:
    deadline, seen = time.monotonic() + timeout, []
    for line in p.stdout:
        m = re.search(pattern, line)
        if m:
            return m
        seen = (seen + [line])[-20:]
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"no {pattern!r} from {p.args}:\n{''.join(seen)}")


def first_token(model: Path, env, extra: list[str] = ()) -> float:
    """Wall clock (time.time) of the first generated token of an engine on ``model``."""
    p = start([ENGINE, "generate", model, "--tokens", "1", *extra], env)
    try:
        doc = json.loads(until(p, r"^RESULT (.*)$").group(1))
        return doc["first_at"]
    finally:
        end(p)


def config_only(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return dst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    if not PYTHON.exists():
        raise SystemExit(f"no vLLM venv at {PYTHON}: bash .ci/run builds it")
    work = Path(tempfile.mkdtemp(prefix="p2pw-vllm-bench-"))
    env = dict(os.environ, VLLM_RPC_BASE_PATH=str(work / "rpc"), PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    (work / "rpc").mkdir()
    procs = []
    try:
        model = work / "model"
        subprocess.run([str(PYTHON), str(ENGINE), "llama", str(model), "--hidden", str(args.hidden),
                        "--layers", str(args.layers)], env=env, check=True, capture_output=True)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        seeder = start(["-m", "p2pweights", "seed", model, "--host", "127.0.0.1", "--port", "0"],
                       dict(env, P2PW_CACHE_DIR=str(work / "cache")))
        procs.append(seeder)
        parent = until(seeder, r"join --parent (\S+)").group(1)
        peer = start(["-m", "p2pweights", "join", "--parent", parent, "--host", "127.0.0.1", "--out", work / "peer",
                      "--no-cache", "--stay"], env)
        procs.append(peer)
        until(peer, r"staying to serve")
        times: dict[str, list[float]] = {"default": [], "join+default": [], "p2pweights": []}
        for _ in range(args.repeat):
            t0 = time.time()
            times["default"].append(first_token(model, env) - t0)
            host = config_only(model, work / "host")
            t0 = time.time()
            subprocess.run([str(PYTHON), "-m", "p2pweights", "join", "--parent", parent, "--host", "127.0.0.1",
                            "--out", str(host), "--no-cache", "--quiet"], env=env, check=True, capture_output=True,
                           timeout=600)
            times["join+default"].append(first_token(host, env) - t0)
            host = config_only(model, work / "host")
            t0 = time.time()
            times["p2pweights"].append(first_token(host, env, ["--load-format", "p2pweights", "--extra",
                                                               json.dumps({"parent": parent})]) - t0)
        base = statistics.median(times["default"])
        print(f"model: random-init Llama, float32, {size / 1e6:.0f} MB in safetensors; {args.repeat} runs each; "
              f"seconds from the first process's start to the first generated token")
        print("| load | median s | min-max s | ratio to default |")
        print("| --- | --- | --- | --- |")
        for name, ts in times.items():
            print(f"| {name} | {statistics.median(ts):.1f} | {min(ts):.1f}-{max(ts):.1f} | "
                  f"{statistics.median(ts) / base:.2f} |")
    finally:
        for p in procs:
            end(p)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
