"""Help that a newcomer can trust: each default said once, refused choices marked as refused with the reason,
the benchmarks' defaults shown and every flag explained."""

from __future__ import annotations

import re

import pytest

from miles import cli
from miles.bench.cli import BENCHMARKS


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # each help on its flag's line: no wrap inside a default's value


def help_text(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


HELP_COLUMN = 24  # argparse's max_help_position: help text starts here, or on the next line


def flag_helps(text: str) -> dict[str, str]:
    """{flag: its help, joined onto one line} from argparse's options listing."""
    helps: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^  (?:-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(1)
            invocation, rest = line[:HELP_COLUMN], line[HELP_COLUMN:]
            fits = len(line) > HELP_COLUMN and invocation.endswith("  ")
            helps[current] = rest.strip() if fits else ""
        elif current and line.startswith(" " * HELP_COLUMN) and line.strip():
            helps[current] = (helps[current] + " " + line.strip()).strip()
        else:
            current = None
    return helps


def test_flag_helps_reads_argparse_listing():
    col = " " * HELP_COLUMN
    text = ("options:\n  -h, --help            show\n  --a N                 first line\n" + col + "second line\n"
            "  --long-flag-name STR\n" + col + "on the next line\n  --c\n\ngroup:\n  --b                   b help\n")
    assert flag_helps(text) == {"--help": "show", "--a": "first line second line",
                                "--long-flag-name": "on the next line", "--c": "", "--b": "b help"}


def defaults_said(help_: str) -> int:
    """How many times the help states a default ("(default: X)", "Default: X")."""
    return len(re.findall(r"\(default[:,]|\bdefault:", help_, flags=re.IGNORECASE))


def test_train_help_states_each_default_at_most_once(capsys):
    helps = flag_helps(help_text(["train"], capsys))
    assert len(helps) > 40
    for flag, text in helps.items():
        assert "(default: None)" not in text, flag
        assert defaults_said(text) <= 1, (flag, text)


@pytest.mark.parametrize("flag, why", [
    ("--rollout-engine", "sglang"),
    ("--reset-optimizer-states", "no backend"),
    ("--save-local-weight-checksum", "no backend"),
    ("--enable-witness", "no backend"),
])
def test_train_help_says_which_choices_are_refused_and_why(capsys, flag, why):
    text = flag_helps(help_text(["train"], capsys))[flag]
    assert "refused" in text and why in text, text


def test_train_help_says_where_metrics_and_tensorboard_go_by_default(capsys):
    helps = flag_helps(help_text(["train"], capsys))
    assert "<run dir>/metrics.jsonl" in helps["--metrics-file"] and "--save" in helps["--metrics-file"]
    assert "./runs/<run id>" in helps["--metrics-file"]
    assert "tensorboard/ next to the metrics file" in helps["--tensorboard-dir"]


@pytest.mark.parametrize("name", [m.NAME for m in BENCHMARKS])
def test_every_bench_flag_has_help_and_shows_its_default_once(capsys, name):
    helps = flag_helps(help_text(["bench", name], capsys))
    assert len(helps) > 5
    for flag, text in helps.items():
        assert text, f"miles bench {name} {flag} has no help"
        assert "(default: None)" not in text and "(default: False)" not in text, (flag, text)
        assert defaults_said(text) <= 1, (flag, text)
    if name != "rl":  # rl's --dir is required
        assert f"(default: miles-bench-{name})" in helps["--dir"]


def test_bench_stream_shows_the_state_size_and_chunk_defaults(capsys):
    helps = flag_helps(help_text(["bench", "stream"], capsys))
    assert helps["--params"].endswith("(default: 100M)")
    assert "(default: 256)" in helps["--chunk-mb"]
    assert "(default: cuda when available)" in helps["--device"]  # said by the help itself, not repeated
