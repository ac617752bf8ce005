"""DeepSeek-V3 (transformers ``deepseek_v3``; Kimi-K2 is this model type) in the Megatron backend, pure (no
megatron-core): what describe reads and refuses, the megatron-core config fields, every HF weight converted to
megatron-core's names and back bit for bit (rope rows reordered when transformers rotates halves), the
expert-parallel and tensor-parallel cuts, and the planner's parameter count. The build itself against
transformers' forward: tests/unit/test_megatron_cpu_deepseek_v3.py.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.convert import (  # noqa: E402
    experts_to_global,
    hf_moe_layout,
    hf_to_megatron,
    megatron_to_hf,
)
from miles.backends.megatron_backend.families import UnsupportedModelError, describe, family_of  # noqa: E402
from miles.backends.megatron_backend.model import transformer_config_from_hf  # noqa: E402
from miles.backends.megatron_backend.pieces.mla import Yarn  # noqa: E402
from miles.backends.megatron_backend.tp_shards import split_kind, tp_gather, tp_shard  # noqa: E402
from miles.models import RANDOM_MODEL_PRESETS  # noqa: E402
from miles.sizing.model_params import model_tensors  # noqa: E402

PRESET = "deepseek-v3-tiny"
# DeepSeek-V3's own YaRN settings (its config.json), at a context 40 x the original
DSV3_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                 beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def tiny(**overrides):
    """The preset's config (vocabulary 128, a multiple of 128: TP pads nothing) with ``overrides``."""
    spec = {**RANDOM_MODEL_PRESETS[PRESET], "vocab_size": 128, **overrides}
    return transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)


def tiny_state(config):
    """transformers' state of ``config``, every tensor random (norms and the routers' fp32 expert bias too)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    state = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:  # one tensor under both names, as in the model
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def test_the_family_and_its_preset():
    config = tiny()
    assert family_of("deepseek_v3").tiny_preset == PRESET
    arch = describe(config)
    assert arch.model_type == "deepseek_v3" and arch.moe_layers == (False, True, True, True)
    assert (arch.num_experts, arch.moe_topk, arch.router_num_groups, arch.router_group_topk) == (8, 2, 2, 1)
    assert arch.router_score_function == "sigmoid" and arch.router_expert_bias and arch.moe_renormalize
    assert arch.router_topk_scaling_factor == 2.5 and arch.shared_expert_ffn_hidden_size == 32
    assert (arch.num_attention_heads, arch.num_query_groups, arch.head_dim) == (4, 4, 24)
    assert arch.mla.q_lora_rank == 32 and arch.mla.rope_interleaved and arch.mla.yarn is None
    kimi_routing = describe(tiny(n_group=1, topk_group=1))
    assert (kimi_routing.router_num_groups, kimi_routing.router_group_topk) == (None, None)
    assert describe(tiny(first_k_dense_replace=3)).moe_layers == (False, False, False, True)


def test_yarn_is_read_as_transformers_computes_it():
    arch = describe(tiny(rope_parameters=DSV3_YARN, max_position_embeddings=163840))
    assert arch.rope_theta == 10000.0
    assert arch.mla.yarn == Yarn(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0)
    # no factor: transformers takes the ratio of the context lengths; betas default to 32 / 1; mscale without
    # mscale_all_dim is ignored by transformers (cos/sin scale by mscale(factor, 1)): megatron's 1 over 0
    bare = {k: v for k, v in DSV3_YARN.items() if k not in ("beta_fast", "beta_slow", "mscale_all_dim")}
    arch = describe(tiny(rope_parameters={**bare, "factor": None, "mscale": 0.7}, max_position_embeddings=16384))
    assert arch.mla.yarn == Yarn(factor=4.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=0.0)


def test_transformer_config_is_plain_mla_with_a_group_limited_sigmoid_router():
    kwargs = transformer_config_from_hf(tiny(), params_dtype=torch.float32)
    assert kwargs["multi_latent_attention"] and kwargs.get("experimental_attention_variant") is None
    assert (kwargs["q_lora_rank"], kwargs["kv_lora_rank"], kwargs["qk_head_dim"], kwargs["qk_pos_emb_head_dim"],
            kwargs["v_head_dim"]) == (32, 16, 16, 8, 16)
    assert kwargs["transformer_impl"] == "local" and kwargs["qk_layernorm"]
    assert (kwargs["rope_type"], kwargs["rotary_scaling_factor"], kwargs["mscale_all_dim"]) == ("rope", 1.0, 0.0)
    assert kwargs["moe_layer_freq"] == [0, 1, 1, 1] and kwargs["moe_router_score_function"] == "sigmoid"
    assert (kwargs["moe_router_num_groups"], kwargs["moe_router_group_topk"]) == (2, 1)
    assert kwargs["moe_router_enable_expert_bias"] and kwargs["moe_router_dtype"] == "fp32"
    assert kwargs["moe_shared_expert_intermediate_size"] == 32 and kwargs["moe_router_topk_scaling_factor"] == 2.5
    yarn = transformer_config_from_hf(tiny(rope_parameters=DSV3_YARN, max_position_embeddings=163840),
                                      params_dtype=torch.float32)
    assert {k: yarn[k] for k in ("rope_type", "rotary_base", "rotary_scaling_factor",
                                 "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                                 "mscale_all_dim")} == dict(rope_type="yarn", rotary_base=10000.0,
                                                            rotary_scaling_factor=40.0,
                                                            original_max_position_embeddings=4096, beta_fast=32.0,
                                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert transformer_config_from_hf(tiny(q_lora_rank=None), params_dtype=torch.float32)["q_lora_rank"] is None


def expected_megatron_shapes(c) -> dict[str, tuple[int, ...]]:
    """megatron-core 0.19.2's GPTModel state names and shapes for a DeepSeek-V3 config, from its module sources
    (MLASelfAttention, TopKRouter, SequentialMLP, SharedExpertMLP; the CPU forward test builds them)."""
    h, heads, e = c.hidden_size, c.num_attention_heads, c.n_routed_experts
    qk, rope, moe = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_rope_head_dim, c.moe_intermediate_size
    shapes = {"embedding.word_embeddings.weight": (c.vocab_size, h), "decoder.final_layernorm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["output_layer.weight"] = (c.vocab_size, h)
    for i in range(c.num_hidden_layers):
        p, a = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                       a + "linear_kv_down_proj.weight": (c.kv_lora_rank + rope, h),
                       a + "kv_layernorm.weight": (c.kv_lora_rank,),
                       a + "linear_kv_up_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                       a + "linear_proj.weight": (h, heads * c.v_head_dim)})
        if c.q_lora_rank is None:
            shapes[a + "linear_q_proj.weight"] = (heads * qk, h)
        else:
            shapes.update({a + "linear_q_down_proj.weight": (c.q_lora_rank, h),
                           a + "q_layernorm.weight": (c.q_lora_rank,),
                           a + "linear_q_up_proj.weight": (heads * qk, c.q_lora_rank)})
        if i < c.first_k_dense_replace:
            shapes.update({p + "mlp.linear_fc1.weight": (2 * c.intermediate_size, h),
                           p + "mlp.linear_fc2.weight": (h, c.intermediate_size)})
            continue
        shared = moe * c.n_shared_experts
        shapes.update({p + "mlp.router.weight": (e, h), p + "mlp.router.expert_bias": (e,),
                       p + "mlp.shared_experts.linear_fc1.weight": (2 * shared, h),
                       p + "mlp.shared_experts.linear_fc2.weight": (h, shared)})
        for x in range(e):
            shapes.update({f"{p}mlp.experts.local_experts.{x}.linear_fc1.weight": (2 * moe, h),
                           f"{p}mlp.experts.local_experts.{x}.linear_fc2.weight": (h, moe)})
    return shapes


VARIANTS = {"preset": {}, "rope halves": dict(rope_interleave=False), "no q_lora": dict(q_lora_rank=None),
            "halves, no q_lora, tied": dict(rope_interleave=False, q_lora_rank=None, tie_word_embeddings=True)}


@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_weight_converts_to_megatron_names_and_back_exactly(overrides):
    config = tiny(**overrides)
    hf = tiny_state(config)
    mcore = hf_to_megatron(hf, config)
    assert {k: tuple(v.shape) for k, v in mcore.items()} == expected_megatron_shapes(config)
    back = megatron_to_hf(mcore, config, hf_moe_layout=hf_moe_layout(hf))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert back["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert torch.equal(mcore["decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"],
                       hf["model.layers.3.mlp.experts.gate_up_proj"][5])
    assert torch.equal(mcore["decoder.layers.1.mlp.router.expert_bias"],
                       hf["model.layers.1.mlp.gate.e_score_correction_bias"])


def _rope_pairs_of(x: torch.Tensor, rope: int) -> torch.Tensor:
    """What megatron's MLA rotates (``mla_rotary_interleaved``): the rope slice as ``cat(x[0::2], x[1::2])``."""
    r = x[..., -rope:]
    return torch.cat([x[..., :-rope], r[..., 0::2], r[..., 1::2]], dim=-1)


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_rope_halves_reach_megatrons_pairs_as_transformers_rotates_them(q_lora_rank):
    """With rope_interleave=False transformers rotates halves (x_i, x_{i+d/2}) of each head's rope slice;
    megatron's MLA always takes pairs (x_{2i}, x_{2i+1}): the converted rows make its pairs transformers'
    halves, for the queries of every head and the shared rope key. Nope rows and latent rows are unchanged."""
    config = tiny(rope_interleave=False, q_lora_rank=q_lora_rank)
    hf, mcore = (state := tiny_state(config)), hf_to_megatron(state, config)
    a, m = "model.layers.0.self_attn.", "decoder.layers.0.self_attention."
    rope, qk, heads = config.qk_rope_head_dim, config.qk_nope_head_dim + config.qk_rope_head_dim, 4
    q_hf, q_mc = ((hf[a + "q_b_proj.weight"], mcore[m + "linear_q_up_proj.weight"]) if q_lora_rank else
                  (hf[a + "q_proj.weight"], mcore[m + "linear_q_proj.weight"]))
    x = torch.randn(q_hf.shape[1], generator=torch.Generator().manual_seed(2))
    assert torch.equal(_rope_pairs_of((q_mc @ x).reshape(heads, qk), rope), (q_hf @ x).reshape(heads, qk))
    kv_hf, kv_mc = hf[a + "kv_a_proj_with_mqa.weight"], mcore[m + "linear_kv_down_proj.weight"]
    x = torch.randn(kv_hf.shape[1], generator=torch.Generator().manual_seed(3))
    assert torch.equal(_rope_pairs_of(kv_mc @ x, rope), kv_hf @ x)
    assert not torch.equal(kv_mc, kv_hf) and torch.equal(kv_mc[:-rope], kv_hf[:-rope])
    interleaved = tiny(q_lora_rank=q_lora_rank)
    assert torch.equal(hf_to_megatron(hf, interleaved)[m + "linear_kv_down_proj.weight"], kv_hf)


def test_expert_parallel_ranks_hold_their_experts_and_gather_back():
    config = tiny()
    hf = tiny_state(config)
    ranks = [hf_to_megatron(hf, config, ep_rank=r, ep_size=2) for r in range(2)]
    for r, state in enumerate(ranks):  # rank r: experts 4r .. 4r + 3
        assert torch.equal(state["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"],
                           hf["model.layers.2.mlp.experts.down_proj"][4 * r + 1])
    merged = {**experts_to_global(ranks[0], config, 0, 2), **experts_to_global(ranks[1], config, 1, 2)}
    back = megatron_to_hf(merged, config, hf_moe_layout="fused")
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_tp_shards_split_mla_by_heads_and_gather_back_exactly(q_lora_rank):
    """megatron's local MLA: the up projections (and the plain q projection) column-parallel, whole heads per
    rank; the down projections column-parallel (MLA gathers the latent); latent norms, router and its bias whole.
    Shard then gather is the unsharded state, for every TP rank's view."""
    config = tiny(q_lora_rank=q_lora_rank, rope_interleave=False)
    full, rules = hf_to_megatron(tiny_state(config), config), describe(config).tp_rules
    a, p = "decoder.layers.1.self_attention.", "decoder.layers.1."
    q = "linear_q_up_proj" if q_lora_rank else "linear_q_proj"
    assert {split_kind(a + f"{n}.weight", rules) for n in (q, "linear_kv_down_proj", "linear_kv_up_proj")} == {"column"}
    assert {split_kind(k, rules) for k in (a + "kv_layernorm.weight", p + "mlp.router.weight",
                                           p + "mlp.router.expert_bias")} == {"replicated"}
    assert split_kind(p + "mlp.shared_experts.linear_fc1.weight", rules) == "swiglu"
    shards = [tp_shard(full, tp_rank=r, tp=2, vocab_size=config.vocab_size, rules=rules) for r in range(2)]
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    for r, shard in enumerate(shards):  # rank r: heads 2r, 2r + 1 of the 4
        assert torch.equal(shard[a + f"{q}.weight"], full[a + f"{q}.weight"][2 * r * qk:2 * (r + 1) * qk])
    for r in range(2):
        gathered = tp_gather(shards, tp_rank=r, vocab_size=config.vocab_size, rules=rules)
        assert set(gathered) == set(full) and all(torch.equal(gathered[k], full[k]) for k in full)


@pytest.mark.parametrize("overrides,match", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=2, topk_group=1, num_experts_per_tok=4), "2 \\* topk_group"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)), "'linear'"),
    (dict(rope_parameters={**DSV3_YARN, "attention_factor": 1.2}), "attention_factor"),
    (dict(rope_parameters={**DSV3_YARN, "truncate": False}), "truncate"),
    (dict(rope_parameters={**DSV3_YARN, "mscale": None}), "set mscale"),
], ids=["attention-bias", "kv-heads", "act", "norm-topk", "group-topk", "linear-rope", "yarn-attention-factor",
        "yarn-untruncated", "yarn-mscale-all-dim-alone"])
def test_what_cannot_be_built_exactly_is_refused_with_the_field(overrides, match):
    with pytest.raises(UnsupportedModelError, match=match):
        describe(tiny(max_position_embeddings=163840, **overrides))


def _transformers_numel(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_the_planners_count_is_the_trained_models(q_lora_rank):
    """`miles plan` counts DeepSeek-V3 from the config.json transformers builds the trainer's model from: the
    same as transformers' parameters and as the megatron state the trainer builds (its params; the expert bias
    is a buffer)."""
    config = tiny(q_lora_rank=q_lora_rank)
    planned = model_tensors({**config.to_dict(), "model_type": "deepseek_v3"}, mtp=False).total()
    assert planned == _transformers_numel(config)
    mcore = hf_to_megatron(tiny_state(config), config)
    assert planned == sum(v.numel() for k, v in mcore.items() if not k.endswith("expert_bias"))
