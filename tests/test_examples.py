"""The examples run as a user runs them (a subprocess each) and prove their outputs equal the original model's."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT

EXAMPLES = {"transformers_load.py": ["--delay-ms", "5"], "execute_while_load.py": ["--delay-ms", "2"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_runs_and_tokens_equal(example, tmp_path):
    if example == "transformers_load.py":
        pytest.importorskip("transformers", reason="transformers is in the test extra")
    env = dict(os.environ, P2PW_CACHE_DIR=str(tmp_path / "catalog"), TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", example), "--device", "cpu",
                             *EXAMPLES[example]], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)  # the example and the seeder it started
            proc.wait(10)
    assert proc.returncode == 0, out
    assert "tokens equal" in out.splitlines(), out
