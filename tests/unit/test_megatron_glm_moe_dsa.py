"""GLM-5 (transformers ``glm_moe_dsa``) in the Megatron backend, on the CPU: what describe reads and refuses,
every HF weight converted to megatron-core's names and back bit for bit, the megatron-core names and shapes
(written here from megatron-core 0.19.2's modules: AbsorbedMLASelfAttention, DSAIndexer, TopKRouter,
SequentialMLP, SharedExpertMLP; tests/gpu/test_megatron_glm_moe_dsa.py checks them against a built
GPTModel), the TransformerConfig fields, the weight handoff's names, and the planner's parameter count.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from miles.backends.megatron_backend.families import UnsupportedModelError, describe  # noqa: E402
from miles.backends.megatron_backend.convert import (  # noqa: E402
    experts_to_global,
    hf_moe_layout,
    hf_to_megatron,
    iter_megatron_to_hf,
    megatron_to_hf,
)
from miles.backends.megatron_backend.pieces.dsa import INDEXER_K_NORM_EPS  # noqa: E402
from miles.backends.megatron_backend.model import transformer_config_from_hf  # noqa: E402
from miles.models import RANDOM_MODEL_PRESETS  # noqa: E402
from miles.sizing.model_params import model_tensors  # noqa: E402
from miles.sizing.presets import GLM5_744B  # noqa: E402

# 4 layers: dense, MoE, MoE, MoE; indexers on layers 0, 1, 3 (layer 2 reuses layer 1's top-k)
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=4,
            index_topk_freq=2, index_skip_topk_offset=2, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=2, routed_scaling_factor=2.5, max_position_embeddings=64, num_nextn_predict_layers=1)


def tiny_glm(**overrides):
    """(config, state) of a transformers-built tiny GLM-5; every tensor (norms and the router's expert bias
    too) random, so that a misplaced one cannot go unnoticed."""
    config = transformers.GlmMoeDsaConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    return config, {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state.items()}


def expected_megatron_shapes(c) -> dict[str, tuple[int, ...]]:
    """megatron-core 0.19.2's GPTModel state names and shapes for a GLM-5 config, from its module sources."""
    h, heads, e = c.hidden_size, c.num_attention_heads, c.n_routed_experts
    qk, v, rope = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.qk_rope_head_dim
    shapes = {"embedding.word_embeddings.weight": (c.vocab_size, h), "decoder.final_layernorm.weight": (h,),
              "output_layer.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p, a = f"decoder.layers.{i}.", f"decoder.layers.{i}.self_attention."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                       a + "linear_q_down_proj.weight": (c.q_lora_rank, h), a + "q_layernorm.weight": (c.q_lora_rank,),
                       a + "linear_q_up_proj.weight": (heads * qk, c.q_lora_rank),
                       a + "linear_kv_down_proj.weight": (c.kv_lora_rank + rope, h),
                       a + "kv_layernorm.weight": (c.kv_lora_rank,),
                       a + "linear_kv_up_proj.weight": (heads * (c.qk_nope_head_dim + v), c.kv_lora_rank),
                       a + "linear_proj.weight": (h, heads * v)})
        if c.indexer_types[i] == "full":
            x = a + "core_attention.indexer."
            shapes.update({x + "linear_wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                           x + "linear_wk.weight": (c.index_head_dim, h), x + "k_norm.weight": (c.index_head_dim,),
                           x + "k_norm.bias": (c.index_head_dim,),
                           x + "linear_weights_proj.weight": (c.index_n_heads, h)})
        if c.mlp_layer_types[i] == "dense":
            shapes.update({p + "mlp.linear_fc1.weight": (2 * c.intermediate_size, h),
                           p + "mlp.linear_fc2.weight": (h, c.intermediate_size)})
            continue
        ffn, shared = c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
        shapes.update({p + "mlp.router.weight": (e, h), p + "mlp.router.expert_bias": (e,),
                       p + "mlp.shared_experts.linear_fc1.weight": (2 * shared, h),
                       p + "mlp.shared_experts.linear_fc2.weight": (h, shared)})
        for x in range(e):
            shapes.update({f"{p}mlp.experts.local_experts.{x}.linear_fc1.weight": (2 * ffn, h),
                           f"{p}mlp.experts.local_experts.{x}.linear_fc2.weight": (h, ffn)})
    return shapes


def test_describe_reads_glm5():
    config, _ = tiny_glm()
    arch = describe(config)
    mla, dsa = arch.mla, arch.dsa
    assert arch.moe_layers == (False, True, True, True) and arch.num_experts == 4 and arch.moe_topk == 2
    assert arch.shared_expert_ffn_hidden_size == 32 and arch.router_expert_bias
    assert arch.router_score_function == "sigmoid" and arch.router_topk_scaling_factor == 2.5
    assert arch.router_num_groups is None and arch.num_query_groups == 4 and not arch.tied_embeddings
    assert dsa.indexer_layers == (True, True, False, True)
    assert (dsa.index_topk_freq, dsa.index_skip_topk_offset) == (2, 2)
    assert arch.mtp_layers == 1 and mla.qk_head_dim == 12


@pytest.mark.parametrize("freq,offset", [(1, 0), (2, 1), (2, 2), (3, 2), (4, 1)])
def test_the_indexer_schedule_is_megatrons_rule(freq, offset):
    """HF's indexer_types from (index_topk_freq, index_skip_topk_offset) as megatron-core decides which layer
    computes its top-k (1-based layer n: max(n - max(offset, 1), 0) % freq == 0)."""
    config = transformers.GlmMoeDsaConfig(**{**TINY, "num_hidden_layers": 9, "index_topk_freq": freq,
                                             "index_skip_topk_offset": offset})
    assert config.indexer_types[0] == "full", "transformers runs no first layer without its own indexer"
    dsa = describe(config).dsa
    off = max(dsa.index_skip_topk_offset, 1)
    megatron = tuple(max(n - off, 0) % dsa.index_topk_freq == 0 for n in range(1, 10))
    assert megatron == dsa.indexer_layers == tuple(t == "full" for t in config.indexer_types)


def test_every_weight_converts_to_megatron_names_and_back_exactly():
    config, hf = tiny_glm()
    mcore = hf_to_megatron(hf, config)
    assert {k: tuple(v.shape) for k, v in mcore.items()} == expected_megatron_shapes(config)
    back = megatron_to_hf(mcore, config, hf_moe_layout=hf_moe_layout(hf))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert back["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # layouts by hand: experts are [gate; up] rows of the fused HF tensor, the shared experts' fc1 likewise
    fused = hf["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(mcore["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"], fused[3])
    shared = "model.layers.1.mlp.shared_experts."
    assert torch.equal(mcore["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"],
                       torch.cat([hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"]]))
    assert torch.equal(mcore["decoder.layers.3.self_attention.core_attention.indexer.k_norm.bias"],
                       hf["model.layers.3.self_attn.indexer.k_norm.bias"])


def test_expert_parallel_ranks_hold_their_experts_and_gather_back():
    config, hf = tiny_glm()
    ranks = [hf_to_megatron(hf, config, ep_rank=r, ep_size=2) for r in range(2)]
    for r, state in enumerate(ranks):
        assert torch.equal(state["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"],
                           hf["model.layers.1.mlp.experts.gate_up_proj"][2 * r + 1])
        assert torch.equal(state["decoder.layers.1.mlp.router.expert_bias"],
                           hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    merged = {**experts_to_global(ranks[0], config, 0, 2), **experts_to_global(ranks[1], config, 1, 2)}
    back = megatron_to_hf(merged, config, hf_moe_layout="fused")
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_the_weight_handoff_names_are_the_engines():
    """The embedded engine (transformers' model) indexes its named parameters and buffers; the trainer's
    handoff (iter_megatron_to_hf) must hit exactly those, with their shapes."""
    config, hf = tiny_glm()
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(config)
    engine = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    sent = dict(iter_megatron_to_hf(hf_to_megatron(hf, config), config, hf_moe_layout="fused"))
    assert set(sent) == set(model.state_dict())
    assert all(tuple(engine[k].shape) == tuple(t.shape) for k, t in sent.items())


def test_transformer_config_is_mla_with_dsa_and_a_sigmoid_router():
    config, _ = tiny_glm()
    kw = transformer_config_from_hf(config, params_dtype=torch.bfloat16, expert_model_parallel_size=2)
    assert kw["multi_latent_attention"] and kw["experimental_attention_variant"] == "dsa"
    assert (kw["q_lora_rank"], kw["kv_lora_rank"], kw["qk_head_dim"], kw["qk_pos_emb_head_dim"], kw["v_head_dim"]) \
        == (24, 16, 8, 4, 8)
    assert kw["rope_type"] == "rope" and kw["dsa_indexer_rope_interleaved"] and not kw["dsa_indexer_rotate_activation"]
    assert kw["dsa_indexer_scoring_relu"] and kw["dsa_indexer_k_norm_epsilon"] == INDEXER_K_NORM_EPS
    assert (kw["dsa_indexer_topk"], kw["dsa_indexer_topk_freq"], kw["dsa_indexer_skip_topk_offset"]) == (4, 2, 2)
    assert kw["dsa_kernel_backend"] == "none" and kw["dsa_indexer_loss_coeff"] == 0.0 and kw["qk_layernorm"]
    assert kw["transformer_impl"] == "local" and kw["mtp_num_layers"] is None
    assert kw["moe_layer_freq"] == [0, 1, 1, 1] and kw["moe_router_score_function"] == "sigmoid"
    assert kw["moe_router_enable_expert_bias"] and kw["moe_router_topk_scaling_factor"] == 2.5
    assert kw["moe_router_pre_softmax"] is False and kw["moe_router_dtype"] == "fp32"
    assert kw["moe_shared_expert_intermediate_size"] == 32 and kw["moe_ffn_hidden_size"] == 16
    assert kw["ffn_hidden_size"] == 48 and kw["expert_model_parallel_size"] == 2
    config, _ = tiny_glm(n_group=2, topk_group=1)  # 2 groups, top-2 experts from the best group
    kw = transformer_config_from_hf(config, params_dtype=torch.bfloat16)
    assert (kw["moe_router_num_groups"], kw["moe_router_group_topk"]) == (2, 1)


@pytest.mark.parametrize("overrides,match", [
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=2, topk_group=2), "n_group=2"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64}), "rope type 'yarn'"),
    (dict(indexer_types=["full", "shared", "full", "full"]), "indexer_types"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_what_cannot_be_built_exactly_is_refused_with_the_field(overrides, match):
    config = transformers.GlmMoeDsaConfig(**TINY)
    for k, v in overrides.items():
        object.__setattr__(config, k, v)  # past the strict dataclass checks: 5.17 allows q_lora_rank=None
    with pytest.raises(UnsupportedModelError, match=match):
        describe(config)


def test_random_model_presets_are_glm5():
    for name in ("glm5-tiny", "glm5-2b"):
        spec = {k: v for k, v in RANDOM_MODEL_PRESETS[name].items() if k != "model_type"}
        arch = describe(transformers.GlmMoeDsaConfig(vocab_size=100, **spec))
        assert arch.mla is not None and arch.dsa is not None and arch.router_expert_bias


def _transformers_numel(config_dict: dict) -> int:
    config = transformers.GlmMoeDsaConfig(**{k: v for k, v in config_dict.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.GlmMoeDsaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["tiny", "glm5-744b"])
def test_the_planners_count_is_the_trained_models(preset):
    """`miles plan` counts GLM-5 from the same config.json transformers builds the trainer's model from:
    without the MTP layer (not trained) the counts agree exactly, and so does the megatron state the
    trainer builds (its params; the expert bias is a buffer). Vocabularies here are multiples of 128."""
    config_dict = {**TINY, "model_type": "glm_moe_dsa"} if preset == "tiny" else GLM5_744B
    planned = model_tensors(config_dict, mtp=False).total()
    assert planned == _transformers_numel(config_dict)
    if preset == "tiny":
        config, hf = tiny_glm()
        mcore = hf_to_megatron(hf, config)
        assert planned == sum(v.numel() for k, v in mcore.items() if not k.endswith("expert_bias"))


def test_a_checkpoints_mtp_layer_does_not_reach_the_conversion(tmp_path):
    """A GLM-5 folder holds its multi-token-prediction layer as model.layers.{num_hidden_layers}.*; transformers
    leaves it out of the loaded model, so the trainer's conversion never sees it (it is not trained)."""
    from safetensors.torch import load_file, save_file

    config, _ = tiny_glm()
    torch.manual_seed(0)
    transformers.GlmMoeDsaForCausalLM(config).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    n = config.num_hidden_layers
    mtp = {k.replace("model.layers.1.", f"model.layers.{n}."): v.clone() for k, v in state.items()
           if k.startswith("model.layers.1.")}
    mtp.update({f"model.layers.{n}.{name}.weight": torch.ones(config.hidden_size) for name in ("enorm", "hnorm")})
    save_file({**state, **mtp}, path, metadata={"format": "pt"})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf = loaded.state_dict()
    assert not any(k.startswith(f"model.layers.{n}.") for k in hf)
    back = megatron_to_hf(hf_to_megatron(hf, loaded.config), loaded.config, hf_moe_layout="fused")
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_the_embedded_engine_decodes_glm5_with_the_dynamic_cache():
    """The engine's static decoder runs plain causal (packed-GQA) attention: for GLM-5 it would ignore the
    indexer's top-k, so GLM-5 decodes with transformers' own dynamic cache, and asking for the static
    one is refused."""
    from miles.models import build_tiny_tokenizer
    from miles.rollout import decode
    from miles.rollout.embedded import EmbeddedRolloutEngine

    config, _ = tiny_glm()
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(config)
    assert not decode.supports_static_cache(model)
    with pytest.raises(ValueError, match="sparse"):
        EmbeddedRolloutEngine(model=model, tokenizer=build_tiny_tokenizer(), device="cpu", static_cache=True)


def test_tp_shards_split_mla_by_heads_keep_the_indexer_whole_and_gather_back_exactly():
    """Tensor parallelism: megatron's local MLA builds the up projections column-parallel (whole heads per rank)
    and the down projections column-parallel too (MLA gathers the latent); the DSA indexer's projections and
    norms are whole on every rank. Shard then gather is the unsharded state, for every TP rank's view."""
    from miles.backends.megatron_backend.tp_shards import split_kind, tp_gather, tp_shard

    config, hf = tiny_glm()
    full, rules = hf_to_megatron(hf, config), describe(config).tp_rules
    a, idx = "decoder.layers.0.self_attention.", "decoder.layers.0.self_attention.core_attention.indexer."
    assert {split_kind(a + p + ".weight", rules) for p in ("linear_q_down_proj", "linear_q_up_proj",
                                                             "linear_kv_down_proj", "linear_kv_up_proj")} == {"column"}
    assert {split_kind(k, rules) for k in full if ".indexer." in k} == {"replicated"}
    shards = [tp_shard(full, tp_rank=r, tp=2, vocab_size=config.vocab_size, rules=rules) for r in range(2)]
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    for r, shard in enumerate(shards):  # rank r: heads 2r, 2r + 1 of the 4
        assert torch.equal(shard[a + "linear_q_up_proj.weight"], full[a + "linear_q_up_proj.weight"][2 * r * qk:
                                                                                                    2 * (r + 1) * qk])
        assert torch.equal(shard[idx + "linear_wq_b.weight"], full[idx + "linear_wq_b.weight"])
    for r in range(2):
        gathered = tp_gather(shards, tp_rank=r, vocab_size=config.vocab_size, rules=rules)
        assert set(gathered) == set(full) and all(torch.equal(gathered[k], full[k]) for k in full)
