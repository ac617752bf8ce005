"""The flags are read once, into the draft RunConfig validation checks, and each value shared by validation and
the run has one derivation on it (issue 36): the store's config for a rank, the per-rank disk need, the trainer
offload target; ranges sit on the fields and one loop checks them; flags are spelled only by ``flag_name``."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest

from miles.config import CONFIG_GROUPS, ArgumentError, parse_args, store_config
from miles.preflight import Environment, validate_args
from miles.config.arguments import flag_name
from miles.preflight.disk_budget import disk_budget, model_tensors_of_run
from miles.preflight.validation import draft_config
from miles.ray.node_disk import per_rank_disk_bytes

MILES = pathlib.Path(__file__).resolve().parents[2] / "miles"
STREAM_DISK = ["--stream-optimizer-state-to-disk", "--offload-train-target=disk"]


def env(tmp_path, **kw) -> Environment:
    base = dict(cuda_available=lambda: False, has_module=lambda m: False, scratch_root=str(tmp_path / "scratch"),
                run_id="test", ray_address=None, cpu_count=lambda: 8, disk_free_bytes=lambda p: 1 << 50,
                host_memory_available=lambda: 64 << 30)
    return Environment(**{**base, **kw})


def validate(tmp_path, *argv, **env_kw):
    return validate_args(parse_args([*argv, "--metrics-file", str(tmp_path / "m.jsonl")]), env(tmp_path, **env_kw))


def _sources():
    return {path: path.read_text() for path in sorted(MILES.rglob("*.py"))}


# ---- the draft ------------------------------------------------------------------------------------------


def test_the_draft_keeps_what_was_not_given_and_validation_resolves_it(tmp_path):
    args = parse_args(["--colocate", "--tiny-model"])
    draft = draft_config(args, env(tmp_path))
    assert draft.offload.offload_train is None and draft.offload.offload_train_target is None
    assert draft.model.model_dtype is None and draft.optimizer.lr is None
    assert draft.trainer_offload and not draft.trainer_offload_to_disk  # --colocate turns it on, to cpu
    cfg = validate_args(args, env(tmp_path))
    assert (cfg.offload.offload_train, cfg.offload.offload_train_target) == (True, "cpu")
    assert cfg.trainer_offload == draft.trainer_offload and cfg.paths == draft.paths
    assert dataclasses.replace(cfg, creates=()).cluster == draft.cluster


@pytest.mark.parametrize("argv, on, to_disk", [
    ([], False, False), (["--colocate"], True, False), (["--offload-train-target", "disk"], True, True),
    (["--colocate", "--no-offload-train", "--tiny-model"], False, False), (["--offload-train"], True, False),
])
def test_trainer_offload_to_disk_is_one_property_of_draft_and_resolved_config(tmp_path, argv, on, to_disk):
    draft = draft_config(parse_args(argv), env(tmp_path))
    cfg = validate(tmp_path, *argv)
    assert (draft.trainer_offload, draft.trainer_offload_to_disk) == (on, to_disk)
    assert (cfg.trainer_offload, cfg.trainer_offload_to_disk) == (on, to_disk)
    assert cfg.uses_rank_dirs == to_disk


# ---- one derivation each --------------------------------------------------------------------------------


def test_the_store_config_validation_checks_is_the_one_each_rank_builds(tmp_path):
    argv = [*STREAM_DISK, "--stream-optimizer-state-chunk-mb", "32", "--stream-optimizer-state-verify",
            "--stream-optimizer-state-moment-dtype", "bf16", "--stream-optimizer-state-host-cache-mb", "auto"]
    cfg = validate(tmp_path, *argv)
    on_rank = store_config(cfg, rank=3, ranks_on_node=2)
    checked = store_config(draft_config(parse_args(argv), env(tmp_path)), rank=3, ranks_on_node=2)
    assert on_rank == checked and on_rank.dir == cfg.paths.optimizer_state
    assert (on_rank.chunk_mb, on_rank.verify, on_rank.moment_dtype, on_rank.host_cache_mb) == (32, True, "bf16", "auto")
    assert (on_rank.rank, on_rank.host_cache_ranks_per_node) == (3, 2)
    with pytest.raises(ArgumentError, match="--stream-optimizer-state-chunk-mb must be"):
        validate(tmp_path, *STREAM_DISK, "--stream-optimizer-state-chunk-mb", "0")


def test_validation_and_the_node_probe_ask_one_disk_need_per_rank(tmp_path):
    model = model_tensors_of_run("smollm2", None)
    for argv in (STREAM_DISK, ["--offload-train-target", "disk"], [*STREAM_DISK, "--num-train-ranks", "2"]):
        cfg = validate(tmp_path, *argv)
        one_rank = disk_budget(cfg, model, ranks_here=1)
        assert one_rank.scratch == per_rank_disk_bytes(cfg, model) > 0


def test_no_store_config_or_disk_need_is_spelled_from_flags_outside_their_one_function():
    """StreamConfig is built from the flags in miles/config/run_config.py:store_config only, and the per-rank
    disk need is one function over the RunConfig (no call spells its inputs one by one)."""
    builds = [f"{p.relative_to(MILES)}" for p, text in _sources().items()
              if "StreamConfig(" in text and "stream_optimizer_state_" in text]  # the benches have flags of their own
    assert builds == ["config/run_config.py"]
    calls = [f"{p.relative_to(MILES)}:{node.lineno}" for p, text in _sources().items()
             for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Call)
             and getattr(node.func, "id", getattr(node.func, "attr", None)) == "rank_disk_need"]
    assert len(calls) == 2
    for p, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "rank_disk_need":
                assert len(node.args) + len(node.keywords) == 4, f"{p}:{node.lineno}"


def test_the_disk_target_test_is_spelled_once():
    spelled = [f"{p.relative_to(MILES)}:{i}" for p, text in _sources().items() if "offload" not in p.parts
               for i, line in enumerate(text.splitlines(), 1) if re.search(r'==\s*"disk"|!=\s*"disk"', line)
               and "backup" not in line]
    assert len(spelled) == 1 and spelled[0].startswith("config/arguments.py:"), spelled


# ---- flags and ranges -----------------------------------------------------------------------------------


def test_flags_are_spelled_only_by_flag_name():
    spelled = [f"{p.relative_to(MILES)}" for p, text in _sources().items() if 'replace("_", "-")' in text]
    assert spelled == ["config/arguments.py"]
    defined = [f"{p.relative_to(MILES)}" for p, text in _sources().items()
               if re.search(r"^_?STREAM(_FLAG)? = ", text, re.M)]
    assert defined == ["config/arguments.py"]


def _ranged_fields():
    return [(f.name, f.metadata["range"]) for _, cls in CONFIG_GROUPS for f in dataclasses.fields(cls)
            if "range" in f.metadata]


def test_the_fields_carry_their_ranges():
    names = {name for name, _ in _ranged_fields()}
    assert {"num_train_ranks", "n_samples_per_prompt", "rollout_top_p", "adam_beta1", "lr",
            "sglang_request_timeout", "sglang_mem_fraction_static", "max_consecutive_skipped_steps"} <= names


@pytest.mark.parametrize("name", [name for name, _ in _ranged_fields()])
def test_one_loop_checks_every_declared_range(tmp_path, name):
    bounds = dict(_ranged_fields())[name]
    low = bounds.at_least if bounds.at_least is not None else bounds.above
    outside = low - 1 if bounds.at_least is not None else low
    flag = flag_name(name)
    args = parse_args(["--metrics-file", str(tmp_path / "m.jsonl")])
    setattr(args, name, type(low)(outside) if isinstance(getattr(args, name), int) else float(outside))
    with pytest.raises(ArgumentError) as e:
        validate_args(args, env(tmp_path))
    assert e.value.flags == (flag,)
    assert str(e.value).startswith(f"{flag} must be {bounds.text()} (got ") and " Fix: " in str(e.value)


@pytest.mark.parametrize("argv", [["--fp8-param"], [*STREAM_DISK, "--fp8-param"],
                                  ["--train-backend", "megatron", "--fp8-param"]])
def test_fp8_params_are_refused_in_one_place(tmp_path, argv):
    megatron = env(tmp_path, python_version=(3, 12), cuda_available=lambda: True, gpu_count=lambda: 1,
                   has_module=lambda m: m == "megatron.core")
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args([*argv, "--metrics-file", str(tmp_path / "m.jsonl")]), megatron)
    assert e.value.flags == ("--fp8-param",) and str(e.value).endswith("Fix: drop --fp8-param.")
    reads = [f"{p.relative_to(MILES)}" for p, text in _sources().items() if ".fp8_param" in text]
    assert reads == ["preflight/validation.py"]


def test_the_megatron_trainer_leaves_the_flags_to_validation():
    tree = ast.parse((MILES / "backends/megatron_backend/trainer.py").read_text())
    check = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "check_config")
    reads = {ast.unparse(node) for node in ast.walk(check) if isinstance(node, ast.Attribute)}
    assert not {r for r in reads if r.startswith(("self.config", "config.", "self.ep_size", "self.dtype"))}, reads
