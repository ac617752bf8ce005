"""Every `miles ...` command in README.md and docs/ parses, and every `miles train` one also validates.

Commands are the lines of fenced ```bash blocks and the `$ `-prompted lines of any block, with lines
continued by a backslash joined; a line chained with `&&`, `;` or `|` contributes each `miles` part.
Paths in the docs (/nvme/..., /ckpt/...) are the reader's, so validation runs against a pretend machine
where every path exists and is writable; a command that needs megatron or a GPU gets a pretend GPU.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from miles.config import build_parser
from miles.preflight import Environment, validate_args
from pretend_machine import pretend_file

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
CHAIN = re.compile(r"\s*(?:&&|\|\||;|\|)\s*")
# the module entry points the docs use, as the `miles` subcommand they stand for
MODULE_ALIASES = {"miles.bench.stream": ["bench", "stream"], "miles.bench.checkpoint": ["bench", "checkpoint"],
                  "miles.sizing.cli": ["plan"]}


def _joined_lines(lines: list[str]) -> list[str]:
    out, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append(pending + line)
            pending = ""
    return out


def shell_commands(text: str) -> list[str]:
    """The shell lines of a markdown text: all of a ```bash block, the `$ ` lines of other blocks."""
    commands, block, lang = [], None, ""
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if fence and block is None:
            block, lang = [], fence.group(1)
        elif line.strip() == "```" and block is not None:
            joined = _joined_lines(block)
            commands += [l.strip() for l in joined if l.strip()] if lang in ("bash", "sh", "shell") else \
                [l.strip()[2:] for l in joined if l.strip().startswith("$ ")]
            block = None
        elif block is not None:
            block.append(line)
    return commands


def miles_invocations(command: str) -> list[list[str]]:
    """argv after `miles` for each `miles ...` / `python -m miles....` part of a shell line."""
    found = []
    for part in CHAIN.split(command):
        if part.startswith("#"):
            continue
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            continue
        while words and ENV_ASSIGNMENT.match(words[0]):  # RAY_ADDRESS=... miles train
            words = words[1:]
        if words[:1] == ["miles"]:
            found.append(words[1:])
        elif words[:2] in (["python", "-m"], ["python3", "-m"]) and len(words) > 2 and words[2] in MODULE_ALIASES:
            found.append(MODULE_ALIASES[words[2]] + words[3:])
    return found


def _all_invocations() -> list[tuple[str, list[str]]]:
    return [(f"{doc.relative_to(REPO)}: {' '.join(argv)[:80]}", argv)
            for doc in DOCS for cmd in shell_commands(doc.read_text()) for argv in miles_invocations(cmd)]


INVOCATIONS = _all_invocations()

LLAMA_TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "vocab_size": 128, "intermediate_size": 128}  # any --hf-checkpoint's config.json


PRETEND_MACHINE = dict(
    cuda_available=lambda: False, has_module=lambda m: True, path_exists=lambda p: True, is_dir=lambda p: True,
    is_file=pretend_file, check_prompt_data=lambda p: None, dir_writable=lambda p: True,
    disk_free_bytes=lambda p: 1 << 60, filesystem_id=lambda p: 0, read_json=lambda p: LLAMA_TINY, run_id="docs",
    cpu_count=lambda: 1024, host_memory_available=lambda: 1 << 50,  # any machine's size
)
PRETEND_GPU = dict(PRETEND_MACHINE, cuda_available=lambda: True, python_version=(3, 12))


def _bench_parser(name: str) -> argparse.ArgumentParser:
    from miles.bench.cli import BENCHMARKS

    module = next(m for m in BENCHMARKS if m.NAME == name)
    parser = argparse.ArgumentParser(prog=f"miles bench {name}")
    module.add_arguments(parser)
    return parser


def _parse(parser: argparse.ArgumentParser, args: list[str]):
    try:
        return parser.parse_args(args)
    except SystemExit as e:  # --help exits 0; a bad flag exits 2 after printing why
        assert e.code == 0 and "--help" in args, f"does not parse: {args}"
        return None


def test_the_docs_hold_miles_commands():
    subcommands = {argv[0] for _, argv in INVOCATIONS}
    assert {"train", "bench", "plan"} <= subcommands, subcommands


def test_extraction_joins_continuations_and_splits_chains():
    text = ("```bash\npip install x && miles train --tiny-model \\\n    --num-rollout 2\nRAY_ADDRESS=h:1 miles train\n```\n"
            "```\n$ miles plan --params 1B\nout\n```\n")
    assert [a for c in shell_commands(text) for a in miles_invocations(c)] == [
        ["train", "--tiny-model", "--num-rollout", "2"], ["train"], ["plan", "--params", "1B"]]


@pytest.mark.parametrize("where,argv", INVOCATIONS, ids=[w for w, _ in INVOCATIONS])
def test_doc_command_parses_and_validates(where, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths of a doc command resolve under the test's tmp dir
    sub, args = argv[0], argv[1:]
    if sub == "train":
        ns = _parse(build_parser(), args)
        if ns is not None:
            gpu = "megatron" in args or any(a.startswith("--train-backend=megatron") for a in args)
            env = Environment(**(PRETEND_GPU if gpu else PRETEND_MACHINE), scratch_root=str(tmp_path))
            validate_args(ns, env)
    elif sub == "bench":
        assert args and not args[0].startswith("-") or "--help" in args, f"{where}: which benchmark?"
        if args[0] != "--help":
            _parse(_bench_parser(args[0]), args[1:])
    elif sub == "plan":
        from miles.sizing.cli import build_parser as plan_parser

        _parse(plan_parser(), args)
    else:
        pytest.fail(f"{where}: unknown subcommand {sub!r}")
