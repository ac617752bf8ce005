"""What the megatron backend asks of the machine, and when: a dry run (validation, layout, plan) needs neither
megatron-core nor CUDA, on any Python; a real start needs megatron-core, and CUDA unless megatron-core is a build
for CPU (version ``+cpu``, as the CPU suite's patched copy: tests/megatron_cpu), refused before Ray with the fix."""

import dataclasses

import pytest

from miles.backends.megatron_backend.machine import runs_without_cuda
from miles.config import parse_args
from miles.preflight import Environment, validate_args
from miles.config.errors import ArgumentError

MEGATRON_TP2 = ["--train-backend", "megatron", "--num-train-ranks", "2", "--tensor-model-parallel-size", "2",
                "--colocate"]


def _env(tmp_path, **kw) -> Environment:
    return dataclasses.replace(Environment(), scratch_root=str(tmp_path / "scratch"), run_id="RUN", **kw)


def _flags(tmp_path, *extra) -> list[str]:
    return [*MEGATRON_TP2, "--metrics-file", str(tmp_path / "metrics.jsonl"), "--offload-train-disk-dir",
            str(tmp_path / "offload"), *extra]


def test_the_dry_run_needs_neither_megatron_core_nor_cuda(tmp_path, capsys):
    from miles.cli import main

    code = main(["train", *_flags(tmp_path), "--dry-run"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "TP2 x PP1 x DP1" in out.out and "stopping before Ray" in out.out


@pytest.mark.parametrize("python", [(3, 11), (3, 12)])
def test_the_dry_run_is_judged_without_the_machine(tmp_path, python):
    env = _env(tmp_path, python_version=python, cuda_available=lambda: False, has_module=lambda m: False)
    config = validate_args(parse_args(_flags(tmp_path, "--dry-run")), env)
    assert config.training.train_backend == "megatron" and config.parallel_layout.tp == 2


TORCH = "Fix: use --train-backend torch"


@pytest.mark.parametrize("python, cuda, modules, version, match, fix", [
    ((3, 11), False, set(), None, "needs Python >= 3.12", TORCH),
    ((3, 11), True, set(), None, "needs Python >= 3.12", TORCH),
    ((3, 12), True, set(), None, "megatron-core is not installed", "Fix: pip install the megatron extra"),
    ((3, 12), False, set(), None, "needs CUDA", TORCH),
    # released megatron-core assumes CUDA: a CPU-only machine is told so before Ray starts
    ((3, 12), False, {"megatron.core"}, "0.19.2", "megatron-core 0.19.2 assumes a CUDA device", TORCH),
    ((3, 11), False, {"megatron.core"}, "0.19.2", "megatron-core 0.19.2 assumes a CUDA device", TORCH),
])
def test_a_real_start_refuses_what_the_machine_lacks_naming_the_fix(tmp_path, python, cuda, modules, version, match,
                                                                   fix):
    env = _env(tmp_path, python_version=python, cuda_available=lambda: cuda, has_module=lambda m: m in modules,
               package_version=lambda d: version)
    with pytest.raises(ArgumentError, match=match) as e:
        validate_args(parse_args(_flags(tmp_path, "--experimental-model-parallel")), env)
    assert fix in str(e.value)


@pytest.mark.parametrize("cuda, version", [(True, "0.19.2"), (False, "0.19.2+cpu")])
def test_a_real_start_runs_with_megatron_core_on_cuda_or_a_cpu_build(tmp_path, cuda, version):
    env = _env(tmp_path, python_version=(3, 11), cuda_available=lambda: cuda,
               has_module=lambda m: m == "megatron.core", package_version=lambda d: version)
    config = validate_args(parse_args(_flags(tmp_path, "--experimental-model-parallel")), env)
    assert config.training.train_backend == "megatron"


@pytest.mark.parametrize("version, cpu", [("0.19.2+cpu", True), ("0.19.2+cpu.1", True), ("0.19.2", False),
                                          ("0.19.2+cu130", False), ("0.19.2+cpuish", False), (None, False),
                                          ("not a version", False)])
def test_a_cpu_build_is_named_by_its_local_version_label(version, cpu):
    assert runs_without_cuda(version) is cpu


@pytest.mark.parametrize("version, refused", [("0.19.2", True), (None, True), ("0.19.2+cpu", False)])
def test_a_train_rank_without_cuda_refuses_released_megatron_core(make_config, monkeypatch, version, refused):
    """Each rank checks its own process (a Ray actor may land on another machine than the driver's)."""
    from miles.backends.megatron_backend import trainer as megatron_trainer

    monkeypatch.setattr(megatron_trainer, "_installed_megatron_version", lambda: version)
    monkeypatch.setattr(megatron_trainer.torch.cuda, "is_available", lambda: False)
    config = make_config("--tiny-model")
    rank = megatron_trainer.MegatronTrainer(config, rank=0, world_size=1)
    if refused:
        with pytest.raises(RuntimeError, match="needs CUDA: megatron-core.* assumes a CUDA device.*--train-backend "
                                               "torch"):
            rank.engine.check_config()
    else:
        rank.engine.check_config()
