"""The pull scheduler decides as recorded: seeded scenarios (``pull_scenarios``) replayed against
``tests/data/pull_decisions.json``, every request, stall, cancel and drop the same chunks to the same
links; a change there is a change of policy, recorded again on purpose."""
import json

import pytest

import pull_scenarios

RECORDED = json.loads(pull_scenarios.FIXTURE.read_text())


def test_the_corpus_covers_every_scenario():
    assert sorted(map(int, RECORDED)) == list(range(pull_scenarios.SCENARIOS))


@pytest.mark.parametrize("seed", range(0, pull_scenarios.SCENARIOS, 20))
def test_the_scheduler_decides_as_recorded(seed):
    for block in range(seed, seed + 20):
        got, want = pull_scenarios.run(block), RECORDED[str(block)]
        first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        assert got == want, f"scenario {block} departs at decision {first}: " \
                            f"{got[first:first + 1]} where {want[first:first + 1]} was recorded"
