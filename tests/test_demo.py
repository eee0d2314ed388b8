"""``p2pw demo``, the README's first command: a seeder and peers as real processes on loopback.

The demo runs its own processes and ends them itself; the timeout here bounds a demo that hangs
(``subprocess.run`` kills it), and every file it writes lives under the test's temporary folder.
"""
import os
import subprocess

import pytest

from conftest import ROOT, p2pw_argv, same_tree


def demo(*args, env=None):
    return subprocess.run(p2pw_argv("demo", "--peers", 2, "--size-mb", 8, *args), capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


@pytest.mark.timeout(150)
def test_demo_verifies_every_copy_and_removes_its_temporary_folder(tmp_path):
    r = demo(env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr + r.stdout
    assert "demo: every copy verified (the model and copies are removed; --workdir DIR keeps them)" in r.stdout
    assert [line.split()[0] for line in r.stdout.splitlines() if line.startswith("peer")][1:] == ["peer1", "peer2"]
    assert not list(tmp_path.glob("p2pw-demo-*"))  # 8 MiB of model and 2 copies: nothing left behind


@pytest.mark.timeout(150)
def test_demo_with_a_workdir_keeps_byte_identical_copies_there(tmp_path):
    work = tmp_path / "work"
    r = demo("--workdir", work)
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"(the model and copies are in {work})" in r.stdout
    for peer in ("peer1", "peer2"):
        assert same_tree(work / "model", work / peer) == []
