"""Every `miles train` invocation in scripts/launch_*.sh parses with `miles train`'s own parser and passes its
validation (on a pretend GPU machine), and each launcher's sizing command runs `miles plan` on the same layout.
A launcher for a model `miles train` cannot run yet (GLM-5.2-744B needs TP8/PP4) runs only `miles plan` for
the layout it needs and refuses, saying why, without starting Ray."""

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ArgumentError, Environment, build_parser, validate_args
from miles.sizing.cli import main as plan_main
from miles.sizing.presets import QWEN3_30B_A3B

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
LAUNCHERS = sorted(SCRIPTS.glob("launch_*.sh"))
# Launchers that refuse to train until `miles train` supports their layout -> what their refusal names.
REFUSING = {"launch_glm5_744b.sh": "tensor and pipeline parallel size 1 only"}
TRAINING = [p for p in LAUNCHERS if p.name not in REFUSING]


def logical_lines(text: str) -> list[str]:
    """Lines with continuations joined and whole-line comments dropped."""
    lines, current = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        lines.append(current + raw)
        current = ""
    return lines


def shell_variables(lines: list[str]) -> tuple[dict, dict]:
    """Scalars (`NAME=${NAME:-default}`, `NAME=value`) and arrays (`NAME=( ... )` over several lines)."""
    scalars, arrays, array = {}, {}, None
    for line in lines:
        s = line.split(" #")[0].strip()
        if array is not None:
            if s == ")":
                array = None
            elif s and not s.startswith("#"):
                arrays[array] += shlex.split(s)
            continue
        if m := re.fullmatch(r"([A-Z_]+)=\(", s):
            array = m.group(1)
            arrays[array] = []
        elif m := re.fullmatch(r"([A-Z_]+)=\$\{\1:-(.*)\}", s):
            scalars[m.group(1)] = m.group(2)
    return scalars, arrays


def substitute(command: str, scalars: dict, arrays: dict) -> list[str]:
    def arithmetic(m):
        return str(eval(re.sub(r"[A-Z_]+", lambda v: scalars[v.group(0)], m.group(1)), {}))  # noqa: S307

    command = re.sub(r"\$\(\((.*?)\)\)", arithmetic, command)
    command = re.sub(r'"\$\{([A-Z_]+)\[@\]\}"', lambda m: " ".join(shlex.quote(a) for a in arrays[m.group(1)]), command)
    expanded = []
    for token in shlex.split(command):
        expanded.append(re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: scalars[m.group(1)], token))
    return expanded


def invocations(path: Path, program: str) -> list[list[str]]:
    """argv (after `program`) of every line that runs `program`, with variables substituted."""
    lines = logical_lines(path.read_text())
    scalars, arrays = shell_variables(lines)
    arrays = {k: [re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: scalars[m.group(1)], a) for a in v] for k, v in arrays.items()}
    found = []
    for line in lines:
        if line.strip().startswith(program + " "):
            found.append(substitute(line.strip()[len(program):], scalars, arrays))
    return found


def sizing_commands(path: Path) -> list[list[str]]:
    """The `python -m miles.sizing.cli ...` lines of the launcher's header comment."""
    text = re.sub(r"\\\n#\s*", " ", path.read_text())
    return [shlex.split(m.group(1)) for m in re.finditer(r"python -m miles\.sizing\.cli (.*)", text)]


def flags(argv: list[str]) -> set[str]:
    return {a.split("=")[0] for a in argv if a.startswith("--")}


def gpu_machine() -> Environment:
    """Validation as on a GPU node with everything installed and the launcher's paths present."""
    return dataclasses.replace(Environment(), python_version=(3, 12), cuda_available=lambda: True,
                               has_module=lambda name: True, path_exists=lambda p: True, is_dir=lambda p: True,
                               is_file=lambda p: True, check_prompt_data=lambda p: None,
                               dir_writable=lambda p: True, disk_free_bytes=lambda p: 1 << 60,
                               read_json=lambda p: QWEN3_30B_A3B,  # launch_qwen3_30b_a3b.sh's model
                               filesystem_id=lambda p: 0,
                               cpu_count=lambda: 128, host_memory_available=lambda: 1 << 41)


def test_there_are_launchers_for_both_reference_models():
    assert {p.name for p in LAUNCHERS} >= {"launch_qwen3_30b_a3b.sh", "launch_glm5_744b.sh"}


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.name)
def test_every_miles_train_invocation_passes_validation(path):
    runs = invocations(path, "miles train")
    assert runs, f"{path.name} runs no `miles train`"
    for argv in runs:
        args = build_parser().parse_args(argv)  # an unknown flag exits here
        assert {"--stream-optimizer-state-to-disk", "--offload-train-target", "--colocate"} <= flags(argv)
        assert (args.train_backend, args.offload_train_target) == ("megatron", "disk")
        validate_args(args, gpu_machine())


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.name)
def test_the_sizing_command_plans_the_launched_layout(path, capsys):
    (plan,) = sizing_commands(path)
    (train,) = invocations(path, "miles train")
    args, _ = build_parser().parse_known_args(train)
    nodes, gpus = int(plan[plan.index("--nodes") + 1]), int(plan[plan.index("--gpus-per-node") + 1])
    assert nodes * gpus == args.num_train_ranks
    assert int(plan[plan.index("--ep") + 1]) == args.expert_model_parallel_size
    assert plan_main(plan) == 0
    assert "->  " in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(REFUSING))
def test_a_launcher_for_an_unsupported_layout_plans_it_and_refuses_without_starting_ray(name, tmp_path, capsys):
    path = SCRIPTS / name
    assert not invocations(path, "miles train") and not invocations(path, "ray start")
    (documented,) = sizing_commands(path)
    (planned,) = invocations(path, "miles plan")
    assert planned == documented  # the header's plan is the one it runs
    # run it, with `miles` answering as the real one and a `ray` that records being called
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "miles").write_text(f"#!/bin/sh\nexec {sys.executable} -m miles.cli \"$@\"\n")
    (bin_dir / "ray").write_text(f"#!/bin/sh\necho called > {tmp_path}/ray-called\n")
    for tool in ("miles", "ray"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "->  " in proc.stdout and "TP8 PP4 DP1 EP8" in proc.stdout  # the plan of the layout it needs
    (refusal,) = proc.stderr.strip().splitlines()
    assert REFUSING[name] in refusal and "TP8 x PP4" in refusal
    assert not (tmp_path / "ray-called").exists()
