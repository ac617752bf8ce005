"""Measured figures have one home, the Summary table of docs/benchmarks.md: a ratio that README.md or a user
doc quotes against a baseline there must be one the Summary states, and `miles train --help` quotes no
measurement at all (help outlives benchmarks)."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
# "0.312x Megatron's CPU offload", "0.510 x the step without a tier": a ratio to a named baseline
RATIO = re.compile(r"(\d+\.\d+) ?x (Megatron's CPU offload|the step without a tier|the no-tier step)")
SAME_BASELINE = {"the step without a tier": "the no-tier step"}


def _summary() -> str:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    return text[text.index("## Summary"):text.index("\n## ", text.index("## Summary") + 1)]


def _ratios(text: str) -> set[tuple[str, str]]:
    return {(value, SAME_BASELINE.get(baseline, baseline)) for value, baseline in RATIO.findall(text)}


def test_quoted_ratios_are_the_summarys():
    summary = _ratios(_summary())
    assert ("0.312", "Megatron's CPU offload") in summary, "the Summary's latest whole-tier figure"
    docs = [REPO / "README.md", *sorted((REPO / "docs" / "advanced").glob("*.md"))]
    for doc in docs:
        for ratio in _ratios(doc.read_text()):
            assert ratio in summary, f"{doc.name} quotes {ratio[0]}x {ratio[1]}, which docs/benchmarks.md's Summary does not"


def test_the_help_quotes_no_measurement():
    from miles.config.arguments import build_parser

    text = build_parser().format_help()
    assert not RATIO.search(text) and "%" not in text, "help texts point to docs/benchmarks.md instead"
