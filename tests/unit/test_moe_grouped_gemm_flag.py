"""``--moe-grouped-gemm``: refused in one line where it has no effect (the torch backend builds its experts with
transformers' modules), and on the megatron backend carried by the RunConfig into the trainer, whose conversion
then gives the grouped experts' names. The trainer's build with the flag's field set is checked on megatron in
test_megatron_cpu_grouped_experts.py (test_the_grouped_experts_flag_reaches_the_trainers_build).
"""

import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from miles.config import parse_args  # noqa: E402
from miles.preflight import Environment, validate_args  # noqa: E402

from test_megatron_convert import tiny  # noqa: E402


def _flags(tmp_path, *extra) -> list[str]:
    return ["--tiny-model", "--metrics-file", str(tmp_path / "metrics.jsonl"), "--offload-train-disk-dir",
            str(tmp_path / "offload"), *extra, "--dry-run"]


def _megatron_config(tmp_path, *extra):
    """The RunConfig of a megatron dry run (judged without megatron-core or CUDA)."""
    env = dataclasses.replace(Environment(), scratch_root=str(tmp_path / "scratch"), run_id="RUN")
    return validate_args(parse_args(_flags(tmp_path, "--train-backend", "megatron", *extra)), env)


def test_the_flag_is_refused_on_the_torch_backend(tmp_path, capsys):
    from miles.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", *_flags(tmp_path, "--moe-grouped-gemm")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith("miles train: error: --moe-grouped-gemm has no effect: --train-backend torch"), err
    assert "Fix: add --train-backend megatron, or drop --moe-grouped-gemm." in err, err


@pytest.mark.parametrize("flag,grouped", [((), False), (("--moe-grouped-gemm",), True)], ids=["default", "flag"])
def test_the_megatron_trainer_converts_into_grouped_experts_when_the_flag_is_given(tmp_path, flag, grouped):
    """The flag -> the RunConfig -> the trainer's conversion of the HF weights into its build's names (its build
    takes the same field: trainer.py's ``_build``)."""
    from miles.backends.megatron_backend.trainer import MegatronEngine

    config = _megatron_config(tmp_path, *flag)
    assert config.training.moe_grouped_gemm is grouped
    hf_config, hf_state = tiny("qwen3_moe")  # layers 0 and 2 are MoE
    engine = MegatronEngine(config, rank=0, world_size=1)
    engine.hf_config = hf_config
    engine.parallel = SimpleNamespace(sharded=False)  # TP1 x PP1: megatron's parallel state is not asked
    names = set(engine._megatron_state(hf_state))
    grouped_names = {f"decoder.layers.{i}.mlp.experts.linear_fc{n}.weight" for i in (0, 2) for n in (1, 2)}
    per_expert = {name for name in names if ".mlp.experts.local_experts." in name}
    if grouped:
        assert grouped_names <= names and not per_expert, sorted(names)
    else:
        assert not grouped_names & names and len(per_expert) == 2 * 4 * 2, sorted(names)
