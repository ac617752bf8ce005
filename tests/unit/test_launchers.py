"""Every launcher (scripts/launch_*.sh) checks its run before Ray starts: it runs `miles train ... --dry-run` (the
flags, the layout against the model, this node's disk and memory), stops there under its own --dry-run, and
otherwise starts Ray and runs the same `miles train` without --dry-run. Each command parses with `miles train`'s
own parser and passes its validation on a pretend GPU machine; each launcher's sizing command runs `miles plan` on
the layout `miles train` builds."""

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ArgumentError, build_parser
from miles.preflight import Environment, validate_args
from miles.sizing.cli import build_parser as plan_parser
from miles.sizing.cli import main as plan_main
from miles.sizing.presets import GLM5_744B, QWEN3_30B_A3B
from miles.sizing.sharding import Parallelism
from pretend_machine import pretend_file

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
LAUNCHERS = sorted(SCRIPTS.glob("launch_*.sh"))
MODEL_CONFIGS = {"launch_glm5_744b.sh": GLM5_744B, "launch_qwen3_30b_a3b.sh": QWEN3_30B_A3B}


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
                arrays[array].append(s)  # raw: substituted (arithmetic first) when used
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
    arrays = {k: [token for line in v for token in substitute(line, scalars, {})] for k, v in arrays.items()}
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


def gpu_machine(hf_config: dict) -> Environment:
    """Validation as on a GPU node with everything installed and the launcher's paths present."""
    return dataclasses.replace(Environment(), python_version=(3, 12), cuda_available=lambda: True,
                               has_module=lambda name: True, path_exists=lambda p: True, is_dir=lambda p: True,
                               is_file=pretend_file, check_prompt_data=lambda p: None,
                               dir_writable=lambda p: True, disk_free_bytes=lambda p: 1 << 60,
                               read_json=lambda p: hf_config, filesystem_id=lambda p: 0,
                               cpu_count=lambda: 256, host_memory_available=lambda: 1 << 41)


def test_there_are_launchers_for_both_reference_models():
    assert {p.name for p in LAUNCHERS} == set(MODEL_CONFIGS)


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_the_launcher_checks_the_run_it_then_starts(path):
    check, run = invocations(path, "miles train")  # the check before Ray, the run after it
    assert check == [*run, "--dry-run"]
    args = build_parser().parse_args(run)  # an unknown flag exits here
    assert {"--stream-optimizer-state-to-disk", "--offload-train-target", "--colocate"} <= flags(run)
    assert (args.train_backend, args.offload_train_target) == ("megatron", "disk")
    env = gpu_machine(MODEL_CONFIGS[path.name])
    cfg = validate_args(build_parser().parse_args(check), env)
    if cfg.parallel_layout.tp * cfg.parallel_layout.pp == 1:
        validate_args(args, env)
    else:  # refused before Ray starts, naming the flags and the opt-in, until TP/PP has run on GPUs
        with pytest.raises(ArgumentError, match="--tensor-model-parallel-size"):
            validate_args(args, env)


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_the_sizing_command_plans_the_layout_miles_train_builds(path, capsys):
    (plan,) = sizing_commands(path)
    run = invocations(path, "miles train")[-1]
    cfg = validate_args(build_parser().parse_args([*run, "--dry-run"]), gpu_machine(MODEL_CONFIGS[path.name]))
    p = plan_parser().parse_args(plan)
    par = Parallelism(tp=p.tp, pp=p.pp, dp=p.nodes * p.gpus_per_node // (p.tp * p.pp), ep=p.ep, etp=p.etp,
                      first_stage_layers=p.decoder_first_pipeline_num_layers,
                      last_stage_layers=p.decoder_last_pipeline_num_layers)
    assert par.layout() == cfg.parallel_layout
    assert plan_main(plan) == 0
    assert "->  " in capsys.readouterr().out
    for planned in invocations(path, "miles plan"):  # a plan the launcher runs is its header's
        assert planned == plan


def fake_tools(tmp_path, miles_train_rc: int = 0) -> dict:
    """`miles` and `ray` that record their calls (a `miles train` answering ``miles_train_rc``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "miles").write_text(f'#!/bin/sh\necho "miles $*" >> {log}\n'
                                   f'[ "$1" = train ] && exit {miles_train_rc}\nexit 0\n')
    (bin_dir / "ray").write_text(f'#!/bin/sh\necho "ray $*" >> {log}\n')
    (bin_dir / "python").write_text("#!/bin/sh\necho 1\n")  # the head's wait for the Ray nodes
    for tool in ("miles", "ray", "python"):
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NUM_NODES": "1"}


def calls(tmp_path) -> list[str]:
    log = tmp_path / "calls"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_dry_run_checks_this_node_and_starts_nothing(path, tmp_path):
    env = fake_tools(tmp_path)
    proc = subprocess.run(["bash", str(path), "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    made = calls(tmp_path)
    assert [c for c in made if c.startswith("miles train")] and all(c.endswith("--dry-run") for c in made
                                                                   if c.startswith("miles train"))
    assert not [c for c in made if c.startswith("ray")]


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_a_run_that_fails_its_check_never_starts_ray(path, tmp_path):
    env = fake_tools(tmp_path, miles_train_rc=2)
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert not [c for c in calls(tmp_path) if c.startswith("ray")]


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_a_checked_run_starts_ray_and_trains(path, tmp_path):
    env = fake_tools(tmp_path)
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    made = [c.split()[:2] for c in calls(tmp_path) if not c.startswith("miles plan")]
    assert made == [["miles", "train"], ["ray", "start"], ["miles", "train"]]
    assert calls(tmp_path)[-1].startswith("miles train") and not calls(tmp_path)[-1].endswith("--dry-run")


def test_the_glm5_launcher_rolls_out_on_one_sglang_server_per_node_and_takes_extra_flags(tmp_path):
    """SGLANG_URLS (one server per node, TP = the node's GPUs) and EXTRA_ARGS reach both `miles train` calls;
    what the run gets validates on the pretend GPU machine with the opt-in, and is refused without it."""
    path = SCRIPTS / "launch_glm5_744b.sh"
    urls = [f"http://node{i}:30000" for i in range(8)]
    env = {**fake_tools(tmp_path), "NUM_NODES": "8", "SGLANG_URLS": " ".join(urls),
           "EXTRA_ARGS": "--experimental-model-parallel --seed 7"}
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\necho 8\n")  # the head's wait: 8 Ray nodes alive
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    check, run = [shlex.split(c)[2:] for c in calls(tmp_path) if c.startswith("miles train")]
    assert check == [*run, "--dry-run"]
    args = build_parser().parse_args(run)
    assert (args.rollout_engine, args.sglang_tp_size, args.sglang_url) == ("sglang", 4, urls)
    assert args.experimental_model_parallel and args.seed == 7
    cfg = validate_args(args, gpu_machine(GLM5_744B))
    assert cfg.rollout.sglang_url == tuple(urls) and cfg.cluster.num_rollout_engines == 8
    without = [a for a in run if a != "--experimental-model-parallel"]
    with pytest.raises(ArgumentError, match="--experimental-model-parallel"):
        validate_args(build_parser().parse_args(without), gpu_machine(GLM5_744B))


def faithful_tools(tmp_path, launcher: str) -> dict:
    """`miles` and `python` that judge what they are given as the real ones would on a GPU node of the launcher's
    model (:func:`gpu_machine`): `miles train` validates its argv (a dry run as leniently as the real one) and
    exits 2 on what it refuses; `python scripts/check_start.py` (the launcher's check) validates its argv as a real start
    does; `python
    -c` (the head's wait for the Ray nodes) answers NUM_NODES. `ray` records its calls."""
    scalars, _ = shell_variables(logical_lines((SCRIPTS / launcher).read_text()))
    env = {**fake_tools(tmp_path), "NUM_NODES": scalars["NUM_NODES"]}  # the layout is planned on the launcher's own
    judge = tmp_path / "bin" / "judge.py"
    judge.write_text(f"""import os, sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
from test_launchers import MODEL_CONFIGS, gpu_machine
from miles.config import ArgumentError, build_parser
from miles.preflight import validate_args

def judge(argv):
    parser = build_parser(prog="miles train")
    try:
        validate_args(parser.parse_args(argv), gpu_machine(MODEL_CONFIGS[{launcher!r}]))
    except ArgumentError as e:
        parser.exit(2, f"miles train: error: {{e}}\\n")
""")
    (tmp_path / "bin" / "miles").write_text(f"""#!{sys.executable}
import sys
sys.path.insert(0, {str(judge.parent)!r})
with open({str(tmp_path / "calls")!r}, "a") as log:
    log.write("miles " + " ".join(sys.argv[1:]) + "\\n")
if sys.argv[1] == "train":
    from judge import judge
    judge(sys.argv[2:])
""")
    (tmp_path / "bin" / "python").write_text(f"""#!{sys.executable}
import os, sys
if sys.argv[1] == "-c":
    print(os.environ["NUM_NODES"])
    sys.exit(0)
with open({str(tmp_path / "calls")!r}, "a") as log:
    log.write("python " + " ".join(sys.argv[1:]) + "\\n")
sys.path.insert(0, {str(judge.parent)!r})
from judge import judge
judge(sys.argv[2:])
""")
    return env


GATE_CASES = {"glm5-tp8pp4-head": ("launch_glm5_744b.sh", "0", {}, "--experimental-model-parallel"),
              "glm5-tp8pp4-worker": ("launch_glm5_744b.sh", "1", {}, "--experimental-model-parallel"),
              "glm5-tp8pp4-opted-in": ("launch_glm5_744b.sh", "0", {"EXTRA_ARGS": "--experimental-model-parallel"}, None),
              "qwen3-tp2-head": ("launch_qwen3_30b_a3b.sh", "0", {"TP": "2"}, "--experimental-model-parallel"),
              "qwen3-tp2-worker": ("launch_qwen3_30b_a3b.sh", "1", {"TP": "2"}, "--experimental-model-parallel"),
              "qwen3": ("launch_qwen3_30b_a3b.sh", "0", {}, None)}


@pytest.mark.parametrize("launcher,node_rank,extra_env,refusal", GATE_CASES.values(), ids=GATE_CASES.keys())
def test_the_check_before_ray_refuses_what_the_start_refuses_on_every_node(tmp_path, launcher, node_rank, extra_env,
                                                                           refusal):
    """The issue's case: the GLM-5.2 launcher's check passed TP8 x PP4 without --experimental-model-parallel, every
    node started Ray, then the head's `miles train` exited 2 and the workers blocked. Now no node starts Ray for a
    run its start would refuse, and each says why; a run the start accepts goes ahead."""
    env = {**faithful_tools(tmp_path, launcher), "NODE_RANK": node_rank, **extra_env}
    proc = subprocess.run(["bash", str(SCRIPTS / launcher)], capture_output=True, text=True, env=env, timeout=120)
    started_ray = [c for c in calls(tmp_path) if c.startswith("ray")]
    if refusal is None:
        assert proc.returncode == 0, proc.stderr
        assert started_ray
        return
    assert proc.returncode == 2, proc.stderr
    assert not started_ray, calls(tmp_path)
    assert refusal in proc.stderr and "--tensor-model-parallel-size" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_launchers_check_refuses_in_one_line_what_a_start_here_refuses(tmp_path):
    """scripts/check_start.py itself, on this machine: exit 2 and one line for flags a real start refuses, 0 for
    flags it takes."""
    script = str(SCRIPTS / "check_start.py")
    common = ["--tiny-model", "--metrics-file", str(tmp_path / "m.jsonl")]
    refused = subprocess.run([sys.executable, script, *common, "--tensor-model-parallel-size", "2"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "--tensor-model-parallel-size" in refused.stderr and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    taken = subprocess.run([sys.executable, script, *common], capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0, taken.stderr
