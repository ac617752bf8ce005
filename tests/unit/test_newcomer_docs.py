"""What a newcomer reads first: the README's commands on its first screen, after how to get there, with what
they cost; the map naming every `miles bench`; megatron.md not calling what it documents unsupported."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_SCREEN_LINES = 40
README = (REPO / "README.md").read_text()
MAIN_JOB = "miles train --stream-optimizer-state-to-disk --offload-train-target=disk"
TESTS = "python -m pytest -q tests"


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_the_readme_shows_both_commands_on_its_first_screen_after_saying_to_clone_and_cd():
    job, tests = _line_of(README, MAIN_JOB), _line_of(README, TESTS)
    assert job <= FIRST_SCREEN_LINES and tests <= FIRST_SCREEN_LINES, (job, tests)
    before = "\n".join(README.splitlines()[:job]).lower()
    assert "clone" in before and "cd" in before


def test_the_readme_states_one_expected_time_for_the_job_and_one_for_the_tests():
    head = "\n".join(README.splitlines()[:_line_of(README, TESTS)])
    durations = re.findall(r"\d+(?:\.\d+)?(?:-\d+)? ?(?:min|minutes)\b", head)
    assert len(durations) == 3, durations  # the install, the job, the tests


def test_the_maps_bench_line_names_every_benchmark():
    from miles.bench.cli import BENCHMARKS

    map_ = README[README.index("## Map of the code"):]
    bench = map_[map_.index("miles/bench/"):map_.index("miles/sizing/")]
    assert all(f"`{m.NAME}`" in bench or f"bench {m.NAME}`" in bench for m in BENCHMARKS), bench


def test_megatrons_not_supported_list_leaves_out_what_the_doc_supports():
    doc = (REPO / "docs" / "advanced" / "megatron.md").read_text()
    section = doc[doc.index("## Not supported"):doc.index("\n## ", doc.index("## Not supported") + 1)]
    assert "MLA" not in section and "sequence parallelism" not in section.lower()
    for sentence in re.split(r"(?<=\.)\s", section):
        if re.search(r"tensor (?:or|and) pipeline parallelism", sentence, re.IGNORECASE):
            assert "--experimental-model-parallel" in sentence, sentence
