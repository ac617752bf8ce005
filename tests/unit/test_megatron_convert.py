"""HF <-> Megatron weight conversion and the TransformerConfig derived from an HF config (CPU, no megatron).

The HF state dicts are those of real tiny transformers models (random weights), so every HF key and
shape is the one transformers produces; a conversion that misplaced a single row would fail the
hand-computed layout checks even where a round trip alone would not notice.
"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.families import UnsupportedModelError, describe  # noqa: E402
from miles.backends.megatron_backend.convert import (  # noqa: E402
    ConversionError,
    experts_to_global,
    hf_moe_layout,
    hf_to_megatron,
    megatron_to_hf,
)
from miles.backends.megatron_backend.weight_rules import qkv_to_megatron  # noqa: E402
from miles.backends.megatron_backend.model import gpt_model_kwargs, transformer_config_from_hf  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def tiny(family: str):
    """(hf_config, hf_state) of a tiny random model of ``family``."""
    t = transformers
    if family == "llama":
        config = t.LlamaConfig(**COMMON, tie_word_embeddings=False)
        cls = t.LlamaForCausalLM
    elif family == "qwen2":
        config = t.Qwen2Config(**COMMON, tie_word_embeddings=True)
        cls = t.Qwen2ForCausalLM
    elif family == "qwen3":  # head_dim 16 != hidden / heads = 8
        config = t.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False)
        cls = t.Qwen3ForCausalLM
    elif family == "qwen3_moe":  # layer 1 dense (mlp_only_layers): a mixed dense/MoE stack
        config = t.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3}, head_dim=8, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                                  mlp_only_layers=[1], tie_word_embeddings=False)
        cls = t.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
        cls = t.MixtralForCausalLM
    else:
        raise AssertionError(family)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # norms are initialized to ones: make every tensor distinguishable
        for p in model.parameters():
            p.normal_()
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-spec", "te-spec"])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_exact(family, fused_norms):
    config, hf = tiny(family)
    mcore = hf_to_megatron(hf, config, fused_norms=fused_norms)
    back = megatron_to_hf(mcore, config, fused_norms=fused_norms, hf_moe_layout=hf_moe_layout(hf))
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_parallel_ranks_hold_their_experts_and_gather_back(family):
    config, hf = tiny(family)
    ep = 2
    ranks = [hf_to_megatron(hf, config, ep_rank=r, ep_size=ep) for r in range(ep)]
    moe_layer = 0
    local = f"decoder.layers.{moe_layer}.mlp.experts.local_experts."
    for r, state in enumerate(ranks):
        assert sorted({k.split(local)[1].split(".")[0] for k in state if local in k}) == ["0", "1"]
        gate_up = _hf_expert_fc1(hf, config, moe_layer, expert=2 * r + 1)
        assert torch.equal(state[local + "1.linear_fc1.weight"], gate_up)
    merged = {}
    for r, state in enumerate(ranks):
        merged.update(experts_to_global(state, config, r, ep))
    back = megatron_to_hf(merged, config, hf_moe_layout=hf_moe_layout(hf))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def _hf_expert_fc1(hf, config, layer, expert):
    if hf_moe_layout(hf) == "fused":
        return hf[f"model.layers.{layer}.mlp.experts.gate_up_proj"][expert]
    if config.model_type == "mixtral":
        pre = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return torch.cat([hf[pre + "w1.weight"], hf[pre + "w3.weight"]])
    pre = f"model.layers.{layer}.mlp.experts.{expert}."
    return torch.cat([hf[pre + "gate_proj.weight"], hf[pre + "up_proj.weight"]])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_both_hf_expert_layouts_convert_to_the_same_megatron_state(family):
    config, hf = tiny(family)
    mcore = hf_to_megatron(hf, config)
    for layout in ("fused", "per_expert"):
        other = megatron_to_hf(mcore, config, hf_moe_layout=layout)
        assert hf_moe_layout(other) == layout
        again = hf_to_megatron(other, config)
        assert set(again) == set(mcore) and all(torch.equal(again[k], mcore[k]) for k in mcore)
    per_expert = megatron_to_hf(mcore, config, hf_moe_layout="per_expert")
    router = "block_sparse_moe.gate.weight" if family == "mixtral" else "mlp.gate.weight"
    assert f"model.layers.0.{router}" in per_expert


def test_qkv_interleave_matches_a_hand_computed_example():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: rows are labelled by their value.
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 4, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "head_dim": 1})
    arch = describe(config)
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    qkv = qkv_to_megatron(q, k, v, arch)
    assert qkv.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    bias = qkv_to_megatron(q.flatten(), k.flatten(), v.flatten(), arch)
    assert bias.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_megatron_side_shapes_and_group_rows(family):
    config, hf = tiny(family)
    arch = describe(config)
    mcore = hf_to_megatron(hf, config)
    d, g, hpg, h = arch.head_dim, arch.num_query_groups, arch.heads_per_group, arch.hidden_size
    qkv = mcore["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((arch.num_attention_heads + 2 * g) * d, h)
    assert mcore["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * arch.ffn_hidden_size, h)
    attn = "model.layers.1.self_attn."
    block = (hpg + 2) * d
    for group in range(g):  # group `group`: its query heads, its key head, its value head
        rows = qkv[group * block:(group + 1) * block]
        assert torch.equal(rows[:hpg * d], hf[attn + "q_proj.weight"][group * hpg * d:(group + 1) * hpg * d])
        assert torch.equal(rows[hpg * d:hpg * d + d], hf[attn + "k_proj.weight"][group * d:(group + 1) * d])
        assert torch.equal(rows[hpg * d + d:], hf[attn + "v_proj.weight"][group * d:(group + 1) * d])
    fc1 = mcore["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:arch.ffn_hidden_size], hf["model.layers.1.mlp.gate_proj.weight"])
    if family == "qwen2":
        bias = mcore["decoder.layers.1.self_attention.linear_qkv.bias"]
        assert torch.equal(bias[hpg * d:hpg * d + d], hf[attn + "k_proj.bias"][:d])
        assert "output_layer.weight" not in mcore  # tied embeddings
    else:
        assert "output_layer.weight" in mcore
    if family == "qwen3":
        assert mcore["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (d,)


def test_te_spec_fuses_norms_except_before_moe_blocks():
    config, hf = tiny("qwen3_moe")
    mcore = hf_to_megatron(hf, config, fused_norms=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mcore
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in mcore  # MoE layer
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in mcore  # dense layer (mlp_only_layers)
    assert "decoder.layers.0.input_layernorm.weight" not in mcore


def test_mismatched_state_dicts_are_named():
    config, hf = tiny("llama")
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ConversionError, match="k_proj"):
        hf_to_megatron(hf, config)
    config, hf = tiny("llama")
    mcore = hf_to_megatron(hf, config)
    mcore["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None  # TE metadata: ignored
    megatron_to_hf(mcore, config)
    mcore["decoder.layers.9.mlp.linear_fc2.weight"] = torch.zeros(1)
    with pytest.raises(ConversionError, match="layers.9"):
        megatron_to_hf(mcore, config)


def test_transformer_config_follows_the_hf_config():
    config, _ = tiny("qwen2")
    kw = transformer_config_from_hf(config, params_dtype=torch.bfloat16)
    assert kw["num_query_groups"] == 2 and kw["kv_channels"] == 8 and kw["ffn_hidden_size"] == 48
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6
    assert kw["gated_linear_unit"] and kw["activation_func"] is F.silu
    assert kw["add_qkv_bias"] and not kw["add_bias_linear"] and not kw["qk_layernorm"]
    assert kw["bf16"] and kw["params_dtype"] is torch.bfloat16 and "num_moe_experts" not in kw
    model = gpt_model_kwargs(config)
    assert model["share_embeddings_and_output_weights"] and model["position_embedding_type"] == "rope"
    assert model["rotary_base"] == describe(config).rope_theta

    config, _ = tiny("qwen3")
    kw = transformer_config_from_hf(config, params_dtype=torch.float32)
    assert kw["qk_layernorm"] and kw["kv_channels"] == 16 and not kw["add_qkv_bias"] and not kw["bf16"]
    assert not gpt_model_kwargs(config)["share_embeddings_and_output_weights"]


def test_moe_router_matches_each_family():
    config, _ = tiny("qwen3_moe")
    kw = transformer_config_from_hf(config, params_dtype=torch.bfloat16, expert_model_parallel_size=2)
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 24
    assert kw["moe_layer_freq"] == [1, 0, 1] and kw["expert_model_parallel_size"] == 2
    # softmax over all experts, top-k, renormalized == softmax over the top-k logits (Megatron's default)
    assert kw["moe_router_score_function"] == "softmax" and kw["moe_router_pre_softmax"] is False
    assert kw["moe_router_enable_expert_bias"] is False and kw["moe_aux_loss_coeff"] == 0.0
    config.norm_topk_prob = False  # Qwen3-MoE without renormalization: softmax, then top-k, as is
    assert transformer_config_from_hf(config, params_dtype=torch.bfloat16)["moe_router_pre_softmax"] is True
    config, _ = tiny("mixtral")
    kw = transformer_config_from_hf(config, params_dtype=torch.bfloat16)
    assert kw["moe_layer_freq"] == 1 and kw["moe_router_pre_softmax"] is False and kw["moe_ffn_hidden_size"] == 48


def test_unsupported_configs_are_rejected_with_the_field():
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        describe(transformers.GPT2Config())
    config, _ = tiny("llama")
    config.attention_bias = True
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        describe(config)
    config, _ = tiny("llama")
    config.hidden_act = "gelu"
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        describe(config)
    config, hf = tiny("mixtral")
    with pytest.raises(ValueError, match="divides the number of experts"):
        hf_to_megatron(hf, config, ep_rank=0, ep_size=3)
