"""`miles train`'s parallel flags (Megatron's names) judged before Ray starts: the layout on the world size and the
policy's sizes, the backend, the rollout batch over data parallelism; each refusal names flag, value and fix."""

import dataclasses

import pytest

from miles.config import ArgumentError, parse_args
from miles.preflight import Environment, validate_args
from miles.sizing.presets import GLM5_744B
from pretend_machine import pretend_file

MEGATRON = ["--train-backend", "megatron"]


def gpu_env(hf_config=None) -> Environment:
    return dataclasses.replace(
        Environment(), python_version=(3, 12), cuda_available=lambda: True, has_module=lambda m: m == "megatron.core",
        scratch_root="/scratch", run_id="RUN", cpu_count=lambda: 256, host_memory_available=lambda: 1 << 42,
        path_exists=lambda p: True, is_file=pretend_file, is_dir=lambda p: True,
        read_json=lambda p: hf_config or {}, disk_free_bytes=lambda p: 1 << 60, dir_writable=lambda p: True)


def check(argv, hf_config=None):
    return validate_args(parse_args([*MEGATRON, *argv]), gpu_env(hf_config))


def glm5(*extra):
    return ["--hf-checkpoint", "/models/glm5", "--num-train-ranks", "32", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8", "--rollout-batch-size", "8",
            "--sequence-parallel", *extra]


def test_the_glm5_layout_validates_under_dry_run_and_resolves_into_the_config():
    cfg = check(glm5("--decoder-first-pipeline-num-layers", "22", "--decoder-last-pipeline-num-layers", "18",
                     "--dry-run"), GLM5_744B)
    assert cfg.parallel_layout.describe() == "TP8 x PP4 x DP1, EP8 x ETP1 x EDP1"
    assert cfg.training.decoder_first_pipeline_num_layers == 22


def test_glm5s_78_layers_at_pp4_need_the_uneven_stage_flags():
    with pytest.raises(ArgumentError) as e:
        check(glm5("--dry-run"), GLM5_744B)
    assert "78 decoder layers do not split evenly over --pipeline-model-parallel-size 4" in str(e.value)
    assert "--decoder-first-pipeline-num-layers 20 --decoder-last-pipeline-num-layers 20" in e.value.fix


def test_tp_or_pp_beyond_one_trains_only_when_asked_for_as_experimental():
    with pytest.raises(ArgumentError) as e:
        check(["--tiny-model", "--tensor-model-parallel-size", "2", "--num-train-ranks", "2"])
    assert "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1" in str(e.value)
    assert "--experimental-model-parallel" in e.value.fix and "--dry-run" in e.value.fix
    check(["--tiny-model", "--tensor-model-parallel-size", "2", "--num-train-ranks", "2", "--dry-run"])
    check(["--tiny-model", "--pipeline-model-parallel-size", "2", "--num-train-ranks", "2",
           "--experimental-model-parallel"])
    check(["--tiny-model", "--expert-model-parallel-size", "2", "--num-train-ranks", "2"])  # EP alone needs no opt-in


def test_the_experimental_flag_without_tp_or_pp_changes_nothing_and_is_refused():
    with pytest.raises(ArgumentError) as e:
        check(["--tiny-model", "--num-train-ranks", "2", "--experimental-model-parallel"])
    assert "--experimental-model-parallel has no effect" in str(e.value)


@pytest.mark.parametrize("argv,words", [
    (["--tensor-model-parallel-size", "4", "--num-train-ranks", "4"], "2 query groups (KV heads) do not split"),
    (["--tensor-model-parallel-size", "8", "--num-train-ranks", "8"], "4 attention heads do not split"),
    (["--pipeline-model-parallel-size", "2", "--num-train-ranks", "2", "--decoder-first-pipeline-num-layers", "2"],
     "leave 0 of the model's 2 decoder layers"),
    (["--pipeline-model-parallel-size", "4", "--num-train-ranks", "4"], "2 decoder layers do not split evenly"),
    (["--decoder-last-pipeline-num-layers", "1"], "needs pipeline parallelism"),
])
def test_the_tiny_models_sizes_bound_the_layout(argv, words):
    with pytest.raises(ArgumentError) as e:
        check(["--tiny-model", "--dry-run", *argv])
    assert words in str(e.value) and e.value.fix and e.value.flags


def test_the_rollout_batch_splits_over_data_parallelism_not_the_world():
    # 8 prompts x 4 samples = 32 samples; TP4 on 12 ranks: DP 3
    with pytest.raises(ArgumentError) as e:
        check(["--hf-checkpoint", "/m", "--dry-run", "--num-train-ranks", "12", "--tensor-model-parallel-size", "4",
               "--sequence-parallel"], {**GLM5_744B, "num_hidden_layers": 4})
    assert "the data-parallel size 3 (--num-train-ranks 12 / (TP x PP))" in str(e.value)
    check(["--hf-checkpoint", "/m", "--dry-run", "--num-train-ranks", "8", "--tensor-model-parallel-size", "4",
           "--sequence-parallel"], {**GLM5_744B, "num_hidden_layers": 4})


@pytest.mark.parametrize("flag", [["--pipeline-model-parallel-size", "2"], ["--sequence-parallel"],
                                  ["--expert-tensor-parallel-size", "2"]])
def test_the_torch_backend_refuses_model_parallel_flags(flag):
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(["--tiny-model", "--num-train-ranks", "2", *flag]), gpu_env())
    assert flag[0] in e.value.flags


@pytest.mark.parametrize("flag", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                                  ["--expert-model-parallel-size", "2"], ["--sequence-parallel"],
                                  ["--expert-tensor-parallel-size", "2"], ["--decoder-first-pipeline-num-layers", "1"]])
def test_on_the_torch_backend_the_missing_megatron_backend_is_the_first_fault(flag):
    # one train rank (the default): the layout is wrong too, but no layout of these flags trains on torch
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(["--tiny-model", *flag]), gpu_env())
    assert str(e.value).startswith(f"{' '.join(flag)} needs --train-backend megatron")
    assert e.value.flags == (flag[0], "--train-backend") and "add --train-backend megatron" in e.value.fix


def test_the_help_lists_megatrons_flag_names():
    from miles.config import build_parser

    text = build_parser().format_help()
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
                 "--expert-tensor-parallel-size", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers", "--dry-run"):
        assert flag in text


def test_expert_tensor_parallelism_must_divide_tp_for_the_handoffs_gather():
    from miles.models import RANDOM_MODEL_PRESETS

    moe = dict(RANDOM_MODEL_PRESETS["qwen3-moe-tiny"], vocab_size=128, max_position_embeddings=256)
    with pytest.raises(ArgumentError) as e:
        check(["--hf-checkpoint", "/m", "--dry-run", "--num-train-ranks", "2", "--expert-tensor-parallel-size", "2"],
              moe)
    assert "--expert-tensor-parallel-size 2 does not divide --tensor-model-parallel-size 1" in str(e.value)
    check(["--hf-checkpoint", "/m", "--dry-run", "--num-train-ranks", "2", "--tensor-model-parallel-size", "2",
           "--expert-tensor-parallel-size", "2", "--sequence-parallel"], moe)


def test_glm5s_pipeline_stages_start_on_layers_that_compute_their_sparse_attention_indices():
    shared = {**GLM5_744B, "num_hidden_layers": 8,
              "indexer_types": ["full", "full", "shared", "full", "shared", "full", "shared", "full"]}
    argv = ["--hf-checkpoint", "/m", "--dry-run", "--num-train-ranks", "2", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(ArgumentError) as e:
        check(argv, shared)
    assert "stage 1 starts at decoder layer 4" in str(e.value) and "--decoder-first-pipeline-num-layers" in e.value.fix
    check([*argv, "--decoder-first-pipeline-num-layers", "3"], shared)


def test_qwen35s_gated_deltanet_heads_bound_tensor_parallelism():
    from miles.sizing.presets import QWEN3_5_35B_A3B

    odd = {**QWEN3_5_35B_A3B, "text_config": {**QWEN3_5_35B_A3B["text_config"], "num_key_value_heads": 8,
                                               "linear_num_key_heads": 12, "linear_num_value_heads": 24}}
    argv = lambda tp: ["--hf-checkpoint", "/m", "--dry-run", "--num-train-ranks", "8",  # noqa: E731
                       "--tensor-model-parallel-size", str(tp), "--sequence-parallel", "--rollout-batch-size", "8"]
    with pytest.raises(ArgumentError) as e:
        check(argv(8), odd)
    assert "12 Gated DeltaNet key heads" in str(e.value) and "--tensor-model-parallel-size" in e.value.fix
    check(argv(4), odd)
