"""The documentation stays short, current and free of lab-notebook words.

- docs/cli.md is what ``docs/gen_cli.py`` makes of the parser now;
- every page under docs/ is under 400 lines, the README under 300;
- no file git tracks speaks of work by its numbered working sittings ("stop" or "stops" and a
  number); a duration ("stop 5 s", "stop after 10 seconds") is not one.
"""
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

ROOT = Path(ROOT)
DOCS = ROOT / "docs"
NUMBERED_STOP = re.compile(r"\bstops? [0-9]+\b(?!(?:[.,][0-9]+)? ?(?:s|ms|seconds?|minutes?|min|h|hours?)\b)",
                           re.IGNORECASE)


def test_cli_reference_is_generated_from_the_current_parser():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "cli.md").read_text() == gen.render(), "docs/cli.md is out of date: run python docs/gen_cli.py"


def test_every_docs_page_is_under_400_lines_and_the_readme_under_300():
    pages = sorted(DOCS.glob("*.md"))
    assert pages, "no pages under docs/"
    long = {p.name: n for p in pages if (n := len(p.read_text().splitlines())) >= 400}
    assert not long, f"pages of 400 lines or more: {long}"
    assert len((ROOT / "README.md").read_text().splitlines()) < 300


def test_the_pattern_tells_a_numbered_stop_from_a_duration():
    n = 42  # spelled with a field, so that this file does not say it
    for said in (f"Stop {n}: the finals", f"since stop {n}", f"stops {n}-{n + 1}", f"(stops {n} and {n + 1})"):
        assert NUMBERED_STOP.search(said), said
    for said in ("stop 5 s", "stop 10 seconds", "stops 3 ms later", "non-stop", "a stop of the bed"):
        assert not NUMBERED_STOP.search(said), said


def test_no_tracked_file_names_a_numbered_stop():
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    found = []
    for name in filter(None, files.decode().split("\0")):
        path = ROOT / name
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # removed in the working tree, or binary
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if NUMBERED_STOP.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
