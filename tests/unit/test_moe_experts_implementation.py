"""MoE experts without a per-expert Python loop: transformers' grouped implementation (one grouped GEMM per
projection), which miles.models.experts_implementation chooses on CUDA in bf16 (load_policy applies the choice;
eager elsewhere), against transformers' eager loop, on CPU in fp32.

The grouped GEMM gives each expert's rows bitwise what eager's ``F.linear`` gives; the layer's output differs
only by rounding (the order its rows and top-k terms are summed in), so the logits are compared within
LOGITS_BOUND (measured: at most 3.0e-7 over these presets), and generation must not change at all: the same
greedy tokens and the same recorded routes (routing replay hooks the routers, which run before the experts).
"""

import copy
import logging
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tiny_models import TOKENIZER, tiny_model  # noqa: E402

from miles.models import (  # noqa: E402
    experts_implementation,
    load_policy,
    random_model_config,
    write_random_model,
)
from miles.rollout.embedded import EmbeddedRolloutEngine  # noqa: E402
from miles.rollout.types import SamplingParams  # noqa: E402
from miles.sizing.model_params import model_tensors  # noqa: E402
from miles.sizing.presets import PRESETS, QWEN3_30B_A3B, RANDOM_MODEL_PRESETS  # noqa: E402
from miles.sizing.tensors import VOCAB_PAD_MULTIPLE  # noqa: E402

MOE_PRESETS = ("qwen3-moe-tiny", "mixtral-tiny", "glm5-tiny", "qwen3.5-moe-tiny", "deepseek-v3-tiny")
LOGITS_BOUND = 1e-6  # fp32 rounding of a different summation order, a few ulp of these logits
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23, 24]]




def _with_experts(preset, implementation):
    model = copy.deepcopy(tiny_model(preset))
    model.set_experts_implementation(implementation)
    return model


def test_grouped_on_cuda_in_bf16_eager_elsewhere():
    assert experts_implementation("cuda", torch.bfloat16) == "grouped_mm"
    assert experts_implementation("cuda", torch.float32) == "eager"
    assert experts_implementation("cuda", torch.float16) == "eager"
    assert experts_implementation("cpu", torch.float32) == "eager"
    assert experts_implementation("cpu", torch.bfloat16) == "eager"


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_grouped_logits_equal_eager_up_to_fp32_rounding(preset):
    ids = torch.randint(0, len(TOKENIZER), (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = _with_experts(preset, "eager")(ids).logits
        grouped = _with_experts(preset, "grouped_mm")(ids).logits
    assert eager.dtype == torch.float32
    assert (grouped - eager).abs().max().item() <= LOGITS_BOUND


def _generate(model):
    engine = EmbeddedRolloutEngine(model=model, tokenizer=TOKENIZER, device="cpu", record_routes=True,
                                   max_batch_size=4)
    try:
        return engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=()))
    finally:
        engine.close()


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_grouped_generation_is_eagers_greedy_tokens_and_routes(preset):
    eager = _generate(_with_experts(preset, "eager"))
    grouped = _generate(_with_experts(preset, "grouped_mm"))
    assert [s.response_ids for s in grouped] == [s.response_ids for s in eager]
    assert all(s.routes is not None for s in grouped)
    assert [s.routes for s in grouped] == [s.routes for s in eager]  # each token's experts, byte for byte


def test_load_policy_runs_a_moe_folders_experts_as_chosen_for_the_device_and_says_so(tmp_path, make_config,
                                                                                     caplog):
    folder = write_random_model(str(tmp_path / "moe"), "qwen3-moe-tiny", dtype="fp32")
    assert transformers.AutoModelForCausalLM.from_pretrained(folder).get_experts_implementation() == {
        "": "grouped_mm"}  # transformers' own default, whatever the device
    with caplog.at_level(logging.INFO, logger="miles.models"):
        model, _, _ = load_policy(make_config("--hf-checkpoint", folder), device="cpu")
    assert model.get_experts_implementation() == {"": "eager"}
    assert "MoE experts: transformers' 'eager'" in caplog.text


def test_load_policy_leaves_a_dense_model_alone(tmp_path, make_config, caplog):
    folder = write_random_model(str(tmp_path / "dense"), "llama-tiny", dtype="fp32")
    with caplog.at_level(logging.INFO, logger="miles.models"):
        model, _, _ = load_policy(make_config("--hf-checkpoint", folder), device="cpu")
    assert model.get_experts_implementation() == {"": "eager"}  # transformers' value for a model without experts
    assert "policy model:" in caplog.text and "MoE experts" not in caplog.text


# ---------------------------------------------------------------- Qwen3-30B-A3B's layers, 12 of them

def test_the_qwen3_30b_a3b_layers_preset_is_the_published_shape_with_12_layers():
    config = random_model_config("qwen3-30b-a3b-12l", len(TOKENIZER))
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (2048, 12, 151936)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert config.tie_word_embeddings is False and config.mlp_only_layers == [] and config.decoder_sparse_step == 1
    assert PRESETS["qwen3-30b-a3b-12l"] == {**QWEN3_30B_A3B, "num_hidden_layers": 12}
    assert RANDOM_MODEL_PRESETS["qwen3-30b-a3b-12l"]["vocab_size"] == 151936


def test_the_planner_counts_the_qwen3_30b_a3b_layers_model_transformers_builds():
    config = random_model_config("qwen3-30b-a3b-12l", len(TOKENIZER))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["Qwen3MoeSparseMoeBlock"] * 12
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (128,)  # Qwen3's qk norms
    numel = sum(p.numel() for p in model.parameters())
    padded = -(-config.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    padding = (padded - config.vocab_size) * config.hidden_size * 2  # untied: embedding and output layer
    assert model_tensors(PRESETS["qwen3-30b-a3b-12l"], mtp=False).total() == numel + padding
    assert 8.0e9 < numel < 8.2e9


def test_plan_sizes_the_qwen3_30b_a3b_layers_preset_streamed_with_its_state_in_one_h200_hosts_tier():
    from miles.sizing.cli import plan_from_args

    _, est = plan_from_args(["--preset", "qwen3-30b-a3b-12l", "--gpus-per-node", "1", "--host-ram-gb", "134",
                             "--host-tier-gb", "100"])
    assert est.fit.verdict == "streaming"  # resident Adam needs more than 141 GB of HBM, Megatron's offload more RAM
    assert est.floors.disk_bytes_per_rank == 0 and est.floors.ram_bytes_per_rank < 100e9  # the whole state in RAM
