"""Qwen3.5-MoE (``qwen3_5_moe``) in the megatron backend, on CPU: the description of transformers' config, every
HF weight to Megatron and back, the Megatron names and shapes megatron-core 0.19.2 builds (read from its source:
``GatedDeltaNet``, ``SelfAttention`` with ``attention_output_gate``, ``MoELayer`` with ``SharedExpertMLP``; the GPU
test checks them against a built GPTModel), the TransformerConfig keywords, the random-model presets, the
planner's parameter count against transformers' own, and the embedded engine's decoding of the hybrid layers.
"""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.families import UnsupportedModelError, describe  # noqa: E402
from miles.backends.megatron_backend.convert import (  # noqa: E402
    experts_to_global, hf_moe_layout, hf_to_megatron, megatron_to_hf)
from miles.backends.megatron_backend.families.qwen3_5_moe.weights import gated_qkv_to_megatron  # noqa: E402
from miles.backends.megatron_backend.model import gpt_model_kwargs, transformer_config_from_hf  # noqa: E402
from miles.models import RANDOM_MODEL_PRESETS, build_tiny_tokenizer, check_hf_config, write_random_model  # noqa: E402
from miles.sizing.model_params import model_tensors  # noqa: E402
from miles.sizing.presets import PRESETS  # noqa: E402
from miles.sizing.tensors import VOCAB_PAD_MULTIPLE  # noqa: E402

# 4 layers: Gated DeltaNet, full attention, Gated DeltaNet, full attention; GQA 4 q / 2 kv heads (2 per group);
# 2 key / 4 value linear heads (grouped); head sizes differ from each other so that a swapped one shows.
TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=6, linear_value_head_dim=10, linear_conv_kernel_dim=3, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
            max_position_embeddings=128, tie_word_embeddings=False)


def tiny(**overrides):
    """(config, state) of a random transformers Qwen3_5MoeForCausalLM; every tensor distinguishable."""
    config = transformers.Qwen3_5MoeTextConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- description --------------------------------------------------------------------------------------------
def test_describe_reads_the_text_config_and_the_multimodal_one_alike():
    config, _ = tiny()
    arch = describe(config)
    gdn = arch.linear_attention
    assert arch.model_type == "qwen3_5_moe" and gdn.linear_layers == (True, False, True, False)
    assert (gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim, gdn.conv_kernel) == \
        (2, 4, 6, 10, 3)
    assert (arch.num_experts, arch.moe_topk, arch.moe_renormalize, arch.moe_layers) == (4, 2, True, (True,) * 4)
    assert (arch.shared_expert_ffn_hidden_size, arch.shared_expert_gate, arch.attention_output_gate) == (20, True, True)
    assert (arch.rotary_percent, arch.zero_centered_norms, arch.qk_norm) == (0.25, True, True)
    assert (arch.router_score_function, arch.router_expert_bias) == ("softmax", False)
    multimodal = transformers.Qwen3_5MoeConfig(text_config=config.to_dict())
    assert multimodal.model_type == "qwen3_5_moe" and describe(multimodal) == arch


@pytest.mark.parametrize("overrides, field", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "layer_types"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "rope_type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}),
     "partial_rotary_factor"),
])
def test_what_cannot_be_built_exactly_is_refused_naming_the_field(overrides, field):
    config = transformers.Qwen3_5MoeTextConfig(**{**TINY, **overrides})
    with pytest.raises(UnsupportedModelError, match=field):
        describe(config)


# ---- conversion ---------------------------------------------------------------------------------------------
def test_every_hf_weight_round_trips_bit_for_bit_in_both_expert_layouts():
    config, hf = tiny()
    assert hf_moe_layout(hf) == "fused"
    mcore = hf_to_megatron(hf, config)
    back = megatron_to_hf(mcore, config, hf_moe_layout="fused")
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    per_expert = megatron_to_hf(mcore, config, hf_moe_layout="per_expert")  # a checkpoint's on-disk names
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in per_expert
    again = hf_to_megatron(per_expert, config)
    assert set(again) == set(mcore) and all(torch.equal(again[k], mcore[k]) for k in mcore)


def test_a_log_keeps_its_dtype_through_the_conversion():
    config, hf = tiny()
    hf = {k: (v.float() if k.endswith("A_log") else v.bfloat16()) for k, v in hf.items()}
    mcore = hf_to_megatron(hf, config)
    assert mcore["decoder.layers.0.self_attention.A_log"].dtype == torch.float32
    back = megatron_to_hf(mcore, config)
    assert back["model.layers.2.linear_attn.A_log"].dtype == torch.float32


def expected_megatron_shapes(c) -> dict[str, tuple]:
    """What megatron-core 0.19.2 builds for TINY (rows from its source, not from convert.py)."""
    h, kd, vd, nv = c["hidden_size"], 2 * 6, 4 * 10, 4
    shapes = {"embedding.word_embeddings.weight": (96, h), "decoder.final_layernorm.weight": (h,),
              "output_layer.weight": (96, h)}
    for i in range(4):
        p = f"decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                       p + "mlp.router.weight": (4, h), p + "mlp.shared_experts.linear_fc1.weight": (2 * 20, h),
                       p + "mlp.shared_experts.linear_fc2.weight": (h, 20),
                       p + "mlp.shared_experts.gate_weight": (1, h)})
        for e in range(4):
            shapes.update({f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight": (2 * 12, h),
                           f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight": (h, 12)})
        a = p + "self_attention."
        if i % 2 == 0:  # GatedDeltaNet: in_proj = q k v z (qk_dim*2 + v_dim*2) + beta alpha (2 * value heads)
            shapes.update({a + "in_proj.weight": (2 * kd + 2 * vd + 2 * nv, h),
                           a + "conv1d.weight": (2 * kd + vd, 1, 3), a + "dt_bias": (nv,), a + "A_log": (nv,),
                           a + "out_norm.weight": (10,), a + "out_proj.weight": (h, vd)})
        else:  # SelfAttention, attention_output_gate: q + gate + k + v rows
            shapes.update({a + "linear_qkv.weight": (2 * 4 * 8 + 2 * 2 * 8, h),
                           a + "linear_proj.weight": (h, 4 * 8), a + "q_layernorm.weight": (8,),
                           a + "k_layernorm.weight": (8,)})
    return shapes


def test_megatron_names_and_shapes_are_those_megatron_core_builds():
    config, hf = tiny()
    mcore = hf_to_megatron(hf, config)
    assert {k: tuple(v.shape) for k, v in mcore.items()} == expected_megatron_shapes(TINY)


def test_gated_attention_rows_follow_megatron_per_query_group():
    config, hf = tiny()
    arch = describe(config)
    d = arch.head_dim
    q_and_gate = torch.arange(4 * 2 * d).float()  # HF q_proj rows: head h's query rows, then its gate rows
    k, v = torch.arange(2 * d).float() + 1000, torch.arange(2 * d).float() + 2000
    qkv = gated_qkv_to_megatron(q_and_gate, k, v, arch)
    row = lambda head, part: list(range((2 * head + part) * d, (2 * head + part + 1) * d))  # noqa: E731
    group0 = row(0, 0) + row(1, 0) + row(0, 1) + row(1, 1) + list(range(1000, 1000 + d)) + list(range(2000, 2000 + d))
    assert qkv[:len(group0)].long().tolist() == group0  # group 0: q heads 0-1, their gates, k head 0, v head 0
    assert qkv[len(group0):len(group0) + d].long().tolist() == row(2, 0)  # group 1 starts with q head 2


def test_gated_deltanet_in_proj_is_qkv_z_b_a_in_that_order():
    config, hf = tiny()
    mcore = hf_to_megatron(hf, config)
    attn = "model.layers.2.linear_attn."
    expected = torch.cat([hf[attn + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")])
    assert torch.equal(mcore["decoder.layers.2.self_attention.in_proj.weight"], expected)
    assert torch.equal(mcore["decoder.layers.2.self_attention.out_norm.weight"], hf[attn + "norm.weight"])


def test_expert_parallel_ranks_hold_their_experts_and_gather_back():
    config, hf = tiny()
    ranks = [hf_to_megatron(hf, config, ep_rank=r, ep_size=2) for r in range(2)]
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in ranks[1]
    assert torch.equal(ranks[1]["decoder.layers.1.mlp.shared_experts.gate_weight"], hf[
        "model.layers.1.mlp.shared_expert_gate.weight"])
    union = {**experts_to_global(ranks[0], config, 0, 2), **experts_to_global(ranks[1], config, 1, 2)}
    back = megatron_to_hf(union, config, hf_moe_layout="fused")
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_tensor_parallel_ranks_hold_megatron_s_gated_deltanet_slices_and_gather_back():
    """Rank r of TP 2 holds what megatron-core 0.19.2's GatedDeltaNet builds locally: in_proj rows
    [q_r; k_r; v_r; z_r; beta_r; alpha_r] (its ``in_proj_split_sections``), conv1d channels [q_r; k_r; v_r], its
    heads' dt_bias and A_log, out_proj's columns of its value heads; the output norm and the shared expert's gate
    whole."""
    from miles.backends.megatron_backend.tp_shards import tp_gather, tp_shard

    config, hf = tiny()
    arch = describe(config)
    full = hf_to_megatron(hf, config)
    shards = [tp_shard(full, tp_rank=r, tp=2, vocab_size=96, rules=arch.tp_rules) for r in range(2)]
    attn, a = "model.layers.2.linear_attn.", "decoder.layers.2.self_attention."
    kd, vd = 2 * 6, 4 * 10
    q, k, v = torch.split(hf[attn + "in_proj_qkv.weight"], [kd, kd, vd])
    cq, ck, cv = torch.split(hf[attn + "conv1d.weight"], [kd, kd, vd])
    half = lambda t, r: torch.chunk(t, 2)[r]  # noqa: E731
    for r, shard in enumerate(shards):
        rows = [half(t, r) for t in (q, k, v, hf[attn + "in_proj_z.weight"], hf[attn + "in_proj_b.weight"],
                                     hf[attn + "in_proj_a.weight"])]
        assert torch.equal(shard[a + "in_proj.weight"], torch.cat(rows))
        assert torch.equal(shard[a + "conv1d.weight"], torch.cat([half(cq, r), half(ck, r), half(cv, r)]))
        for name in ("dt_bias", "A_log"):
            assert torch.equal(shard[a + name], half(hf[attn + name], r))
        assert torch.equal(shard[a + "out_proj.weight"], torch.chunk(hf[attn + "out_proj.weight"], 2, dim=1)[r])
        assert torch.equal(shard[a + "out_norm.weight"], hf[attn + "norm.weight"])
        assert torch.equal(shard["decoder.layers.2.mlp.shared_experts.gate_weight"],
                           hf["model.layers.2.mlp.shared_expert_gate.weight"])
    gathered = tp_gather(shards, tp_rank=1, vocab_size=96, rules=arch.tp_rules)
    assert set(gathered) == set(full) and all(torch.equal(gathered[n], full[n]) for n in full)
    back = megatron_to_hf(gathered, config, hf_moe_layout=hf_moe_layout(hf))
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
    with pytest.raises(KeyError, match="no tensor-parallel rule .*in_proj"):  # the family's rules are needed
        tp_shard(full, tp_rank=0, tp=2, vocab_size=96)


def test_fused_norms_are_refused_for_this_family():
    config, hf = tiny()
    with pytest.raises(ValueError, match="fused_norms=False"):
        hf_to_megatron(hf, config, fused_norms=True)


# ---- megatron-core configuration ----------------------------------------------------------------------------
def test_transformer_config_keywords():
    config, _ = tiny()
    kw = transformer_config_from_hf(config, params_dtype=torch.bfloat16, expert_model_parallel_size=2)
    assert kw["experimental_attention_variant"] == "gated_delta_net"
    assert kw["linear_attention_freq"] == [1, 0, 1, 0]
    assert (kw["linear_conv_kernel_dim"], kw["linear_key_head_dim"], kw["linear_value_head_dim"],
            kw["linear_num_key_heads"], kw["linear_num_value_heads"]) == (3, 6, 10, 2, 4)
    assert kw["attention_output_gate"] is True and kw["qk_layernorm"] is True and kw["kv_channels"] == 8
    assert (kw["moe_shared_expert_intermediate_size"], kw["moe_shared_expert_gate"]) == (20, True)
    # softmax over all experts, top-k, renormalized == softmax over the top-k logits (Megatron's default)
    router = (kw["moe_router_score_function"], kw["moe_router_pre_softmax"], kw["moe_router_topk"])
    assert router == ("softmax", False, 2)
    assert kw["moe_layer_freq"] == 1 and kw["num_moe_experts"] == 4 and kw["expert_model_parallel_size"] == 2
    model = gpt_model_kwargs(config)
    assert (model["rotary_percent"], model["position_embedding_type"]) == (0.25, "rope")


@pytest.mark.parametrize("hopper, triton, tilelang, exact", [
    (True, "3.6.0", False, False),  # the H200 host: torch 2.11's Triton
    (True, "3.4.0", False, False),
    (True, "3.7.1", False, True),
    (True, "3.3.1", False, True),
    (True, "3.6.0", True, True),  # tilelang provides the backward
    (False, "3.6.0", False, True),
])
def test_fla_gated_backward_is_trusted_where_fla_trusts_it(hopper, triton, tilelang, exact):
    from miles.backends.megatron_backend.families.qwen3_5_moe.layers import fla_gated_backward_is_exact

    assert fla_gated_backward_is_exact(hopper=hopper, triton_version=triton, tilelang=tilelang) is exact


# ---- presets and the planner's count ------------------------------------------------------------------------
def _transformers_numel(text_config: dict) -> int:
    cfg = dict(text_config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3.5-moe-1b-random", "qwen3.5-moe-tiny"])
def test_the_planner_counts_transformers_parameters(name):
    """`miles plan` sizes the config transformers builds: the same count, but for Megatron's vocabulary padding."""
    if name in PRESETS:
        config = PRESETS[name]
    else:
        config = dict(RANDOM_MODEL_PRESETS[name], vocab_size=len(build_tiny_tokenizer()))
    text = config.get("text_config", config)
    text = {k: v for k, v in text.items() if k not in ("attn_output_gate", "mtp_num_hidden_layers")}  # not HF fields
    padded = -(-text["vocab_size"] // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    padding = (padded - text["vocab_size"]) * text["hidden_size"] * (1 if text.get("tie_word_embeddings") else 2)
    assert model_tensors(config, mtp=False).total() == _transformers_numel(text) + padding


def test_the_random_presets_are_one_config_with_the_plan_preset():
    plan = PRESETS["qwen3.5-moe-1b-random"]
    random = RANDOM_MODEL_PRESETS["qwen3.5-moe-1b"]
    assert ({k: v for k, v in plan.items() if k != "vocab_size"}
            == {k: v for k, v in random.items() if k != "rms_norm_eps"})
    assert plan["vocab_size"] == len(build_tiny_tokenizer())
    assert 1.0e9 < model_tensors(plan, mtp=False).total() < 1.1e9


def test_the_tiny_preset_is_an_hf_folder_transformers_loads(tmp_path):
    folder = write_random_model(str(tmp_path / "m"), "qwen3.5-moe-tiny", dtype="fp32")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    check_hf_config(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert describe(model.config).linear_attention.linear_layers == (True, False, True, False)
    hf = model.state_dict()
    back = megatron_to_hf(hf_to_megatron(hf, model.config), model.config, hf_moe_layout=hf_moe_layout(hf))
    assert set(back) == set(dict(model.named_parameters()))  # the names the weight handoff sends the engine


# ---- the embedded engine -------------------------------------------------------------------------------------
def test_the_embedded_engine_decodes_the_hybrid_layers_exactly(tmp_path):
    """Gated DeltaNet layers keep conv and recurrent states, not a key/value cache: the engine decodes them with
    transformers' own cache (never the static decoder), and left padding does not leak into the states: each
    generated token's log-prob equals a teacher-forced forward of that sample alone."""
    from miles.rl.loss import token_logprobs
    from miles.rollout import decode
    from miles.rollout.embedded import EmbeddedRolloutEngine

    folder = write_random_model(str(tmp_path / "m"), "qwen3.5-moe-tiny", dtype="fp32")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    assert not decode.supports_static_cache(model)
    with pytest.raises(ValueError, match="recurrent"):
        EmbeddedRolloutEngine(model=model, tokenizer=build_tiny_tokenizer(), device="cpu", static_cache=True)
    engine = EmbeddedRolloutEngine(model=model, tokenizer=build_tiny_tokenizer(), device="cpu")
    samples = engine.generate([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]],
                              dict(max_new_tokens=8, temperature=1.0, stop_token_ids=[]))
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            alone = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0, len(s.prompt_ids) - 1:]
        assert len(s.response_ids) == 8
        assert (alone - torch.tensor(s.response_logprobs)).abs().max().item() < 1e-5


# ---- the Megatron layout, read as megatron-core's forward reads it -------------------------------------------
# A CPU reading of the converted weights the way megatron-core 0.19.2's modules use them (GatedDeltaNet.forward's
# in_proj split and conv, SelfAttention.get_query_key_value_tensors' per-group split with the output gate,
# TopKRouter's softmax over the top-k logits, SharedExpertMLP's sigmoid gate), against transformers' forward: a
# row misplaced by the conversion changes the logits. (The GPU test runs megatron-core itself.)
def _zc_norm(x, w, eps=1e-6):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def _swiglu(x, fc1, fc2):
    gate, up = torch.chunk(x @ fc1.T, 2, dim=-1)
    return (F.silu(gate) * up) @ fc2.T


def _gated_delta_net(x, w, p, arch):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule

    gdn, (b, s, _) = arch.linear_attention, x.shape
    qkv, z, beta, alpha = torch.split(x @ w[p + "in_proj.weight"].T, list(gdn.in_proj_rows), dim=-1)
    conv = w[p + "conv1d.weight"]
    qkv = F.silu(F.conv1d(qkv.transpose(1, 2), conv, padding=conv.shape[-1] - 1, groups=conv.shape[0])[..., :s])
    q, k, v = torch.split(qkv.transpose(1, 2), [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    q, k = (F.normalize(t.reshape(b, s, -1, gdn.key_head_dim), dim=-1, eps=1e-6) for t in (q, k))
    repeat = gdn.num_value_heads // gdn.num_key_heads
    q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    g = -w[p + "A_log"].float().exp() * F.softplus(alpha + w[p + "dt_bias"])
    out, _ = torch_chunk_gated_delta_rule(q, k, v.reshape(b, s, -1, gdn.value_head_dim), g=g, beta=beta.sigmoid())
    out32 = out.float()
    normed = out32 * torch.rsqrt(out32.pow(2).mean(-1, keepdim=True) + 1e-6) * w[p + "out_norm.weight"]
    gated = normed * F.silu(z.reshape(b, s, -1, gdn.value_head_dim))
    return gated.reshape(b, s, -1) @ w[p + "out_proj.weight"].T


def _rope(t, arch, positions):
    rot = int(arch.head_dim * arch.rotary_percent)
    inv_freq = 1.0 / arch.rope_theta ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[None, :, None]  # [1, s, 1, rot]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    rotated = torch.cat([-t_rot[..., rot // 2:], t_rot[..., :rot // 2]], dim=-1)
    return torch.cat([t_rot * freqs.cos() + rotated * freqs.sin(), t_pass], dim=-1)


def _gated_attention(x, w, p, arch):
    (b, s, _), d, groups, per_group = x.shape, arch.head_dim, arch.num_query_groups, arch.heads_per_group
    mixed = (x @ w[p + "linear_qkv.weight"].T).reshape(b, s, groups, (2 * per_group + 2) * d)
    q, gate, k, v = torch.split(mixed, [per_group * d, per_group * d, d, d], dim=-1)
    positions = torch.arange(s).float()
    q = _rope(_zc_norm(q.reshape(b, s, -1, d), w[p + "q_layernorm.weight"]), arch, positions)
    k = _rope(_zc_norm(k, w[p + "k_layernorm.weight"]), arch, positions)
    k, v = k.repeat_interleave(per_group, dim=2), v.repeat_interleave(per_group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    out = out.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(gate.reshape(b, s, -1))
    return out @ w[p + "linear_proj.weight"].T


def _moe(x, w, p, arch):
    tokens = x.reshape(-1, x.shape[-1])
    top, index = torch.topk(tokens @ w[p + "router.weight"].T, arch.moe_topk, dim=-1)
    probs = torch.softmax(top, dim=-1)  # pre_softmax False: softmax over the top-k logits
    routed = torch.zeros_like(tokens)
    for e in range(arch.num_experts):
        rows, slot = torch.where(index == e)
        fc = f"{p}experts.local_experts.{e}.linear_fc"
        expert = _swiglu(tokens[rows], w[fc + "1.weight"], w[fc + "2.weight"])
        routed.index_add_(0, rows, expert * probs[rows, slot, None])
    shared = _swiglu(tokens, w[p + "shared_experts.linear_fc1.weight"], w[p + "shared_experts.linear_fc2.weight"])
    shared = shared * torch.sigmoid(tokens @ w[p + "shared_experts.gate_weight"].T)
    return (routed + shared).reshape(x.shape)


def _megatron_layout_logits(w, arch, tokens):
    x = w["embedding.word_embeddings.weight"][tokens]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        mixer = _gated_delta_net if arch.linear_attention.linear_layers[i] else _gated_attention
        x = x + mixer(_zc_norm(x, w[p + "input_layernorm.weight"]), w, p + "self_attention.", arch)
        x = x + _moe(_zc_norm(x, w[p + "pre_mlp_layernorm.weight"]), w, p + "mlp.", arch)
    return _zc_norm(x, w["decoder.final_layernorm.weight"]) @ w["output_layer.weight"].T


def test_the_megatron_layout_computes_what_transformers_computes():
    config = transformers.Qwen3_5MoeTextConfig(**{**TINY, "head_dim": 16})  # 4 rotary channels of 16
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0, 0.2)
        tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
        theirs = model(input_ids=tokens).logits
        ours = _megatron_layout_logits(hf_to_megatron(model.state_dict(), config), describe(config), tokens)
    assert theirs.abs().max() > 1.0  # weights large enough that a misplaced row shows
    assert (ours - theirs).abs().max().item() < 1e-3  # fp32 reduction order; a misplaced row gives > 1
