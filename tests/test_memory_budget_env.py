"""``P2PW_MEMORY_BUDGET`` that is not a size: one error line and exit 1, from a join that reached a real seeder."""
import os
import subprocess

import pytest

from conftest import ROOT, p2pw_argv


@pytest.mark.timeout(120)
def test_a_memory_budget_that_is_not_a_size_is_one_error_line(procs, model_dir):
    _, info = procs.seeder(model_dir)
    env = dict(os.environ, P2PW_MEMORY_BUDGET="abc")
    r = subprocess.run(p2pw_argv("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q",
                                 "--no-cache"), capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "p2pw: error: P2PW_MEMORY_BUDGET='abc': bad size 'abc': use e.g. 100GiB, 512M, 1048576"], r.stderr


@pytest.mark.timeout(120)
def test_a_memory_budget_in_units_is_taken(procs, model_dir, tmp_path):
    _, info = procs.seeder(model_dir)
    env = dict(os.environ, P2PW_MEMORY_BUDGET="1MiB")  # smaller than the model: a temporary file backs the blob
    r = subprocess.run(p2pw_argv("join", "--parent", f"127.0.0.1:{info['port']}", "--host", "127.0.0.1", "-q",
                                 "--no-cache"), capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
