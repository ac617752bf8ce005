"""A newcomer's bad command line: refused in one line that names the fault (an unknown flag with the flag it was
probably meant as, before a required one it was meant as) and points to --help, without the usage; `miles
plan` refuses before importing torch; `miles plan` and `miles bench rl` take the same preset names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from miles.cli import main

HEAVY_MODULES = ("torch", "transformers", "ray")

# main(argv) in a fresh interpreter: its exit code and which heavy modules the refusal imported
_PROBE = """
import json, sys
from miles.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY_MODULES,)


def run_in_fresh_interpreter(argv: list[str], cwd) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert done.stdout.strip(), done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [
    ["plan", "--bogus"],
    ["plan", "--preset", "nosuch"],
    ["plan", "--preset", "glm5-744b", "--tp", "0"],
    ["plan", "--params", "1.5B", "--gpus-per-node", "3", "--tp", "2"],  # a layout refused after parsing
    ["plan", "--config", "missing.json"],
], ids=lambda argv: " ".join(argv))
def test_a_bad_plan_argument_is_refused_before_torch_is_imported(argv, tmp_path):
    result = run_in_fresh_interpreter(argv, tmp_path)
    assert result == {"code": 2, "heavy": []}, result


def _refusal(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, typo, meant", [
    (["train", "--eps-clp", "0"], "--eps-clp", "--eps-clip"),
    (["plan", "--preset", "glm5-744b", "--gpu-per-node", "1"], "--gpu-per-node", "--gpus-per-node"),
    (["bench", "stream", "--parms", "1e6"], "--parms", "--params"),
    (["bench", "rl", "--preset", "llama-tiny", "--dir", "{tmp}/bench", "--rolouts", "3"], "--rolouts", "--rollouts"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_typo_is_one_line_naming_the_flag_meant_and_pointing_to_help(argv, typo, meant, tmp_path, capsys):
    err = _refusal([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    assert f"{typo}: did you mean {meant}?" in err and "--help" in err, err
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("argv, named", [
    (["plan", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "rl", "--preset", "llama-tiny", "--dri", "{tmp}/bench"], "--dri: did you mean --dir?"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_an_unknown_flag_is_named_before_the_required_one_it_was_meant_as(argv, named, tmp_path, capsys):
    err = _refusal([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert len(err.splitlines()) == 1 and named in err and "required" not in err, err


def test_plan_and_bench_rl_take_the_same_preset_names_and_the_old_plan_names():
    from miles.bench import rl
    from miles.arg_parser import SuggestingParser
    from miles.models import RANDOM_MODEL_PRESETS
    from miles.sizing.cli import build_parser as plan_parser

    bench = SuggestingParser(prog="miles bench rl")
    rl.add_arguments(bench)
    for name in RANDOM_MODEL_PRESETS:  # every model the bench writes, the planner sizes under the same name
        assert plan_parser().parse_args(["--preset", name]).preset == name
        assert bench.parse_args(["--preset", name, "--dir", "/tmp/unused"]).preset == name
    for old, new in (("llama-9.2b-random", "llama-9.2b"), ("glm5-2b-random", "glm5-2b"),
                     ("qwen3.5-moe-1b-random", "qwen3.5-moe-1b")):
        assert plan_parser().parse_args(["--preset", old]).preset == new
        assert bench.parse_args(["--preset", old, "--dir", "/tmp/unused"]).preset == new


def test_bench_rl_refuses_a_published_models_shape_naming_the_planner(capsys):
    from miles.bench import rl
    from miles.arg_parser import SuggestingParser

    bench = SuggestingParser(prog="miles bench rl")
    rl.add_arguments(bench)
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "glm5-744b", "--dir", "/tmp/unused"])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "miles plan --preset glm5-744b" in err and "--hf-checkpoint" in err, err


def test_the_planner_sizes_random_presets_with_the_vocabulary_they_are_written_with():
    pytest.importorskip("tokenizers")
    from miles.models import build_tiny_tokenizer
    from miles.sizing.presets import PRESETS

    vocab = len(build_tiny_tokenizer())
    assert {PRESETS[name]["vocab_size"] for name in ("llama-1b", "qwen3-moe-tiny", "glm5-2b", "llama-9.2b")} == {vocab}
