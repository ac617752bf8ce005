"""GLM-5 (transformers ``glm_moe_dsa``) for the Megatron backend: what its config means, its attention's
weight names, and the megatron-core config fields of multi-latent attention with DeepSeek sparse attention.

Pure (no megatron import); ``architecture.describe`` calls :func:`describe_glm_moe_dsa`, ``convert.py``
maps the attention through :func:`attention_names`, ``model.py`` adds :func:`mla_dsa_config_kwargs`. The
layer spec that builds it without Transformer Engine is ``glm_moe_dsa_layers.py`` (GPU only).

Facts of transformers' modeling code (``modeling_glm_moe_dsa.py``, 5.17 and 5.24) this relies on:

- MLA: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (per head ``[nope, rope]``); ``kv_a_proj_with_mqa``
  gives ``[kv_lora_rank, rope]``, the latent goes through ``kv_a_layernorm`` and ``kv_b_proj`` (per head
  ``[nope, v]``). Megatron's absorbed MLA keeps the same row orders, so every weight maps unchanged.
- The two latent norms are ``GlmMoeDsaRMSNorm(rank)``: eps 1e-6 whatever ``rms_norm_eps`` says; the
  indexer's key norm is ``nn.LayerNorm(index_head_dim, eps=1e-6)`` (weight and bias).
- RoPE (default type only) on the rope slice, pairs interleaved ``(x0, x1), (x2, x3)...``: megatron's
  ``mla_rotary_interleaved`` path (the MLA attention always, the indexer with
  ``dsa_indexer_rope_interleaved``). The indexer puts its rope slice first, relu's the q.k scores, sums
  heads weighted by ``weights_proj(x) / sqrt(heads)``, and applies no Hadamard rotation.
- Router: sigmoid scores, top-k chosen on ``scores + e_score_correction_bias`` (an fp32 buffer), weights
  from the unbiased scores, renormalized, times ``routed_scaling_factor``; with ``n_group > 1`` groups are
  ranked by the sum of their top-2 scores. Shared experts: one SwiGLU of ``moe_intermediate_size *
  n_shared_experts`` added to the routed output.
- MTP: transformers drops the checkpoint's ``model.layers.{num_hidden_layers}.*`` (the next-token
  prediction layer) on load, so the policy has no MTP weights; they are not trained here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import UnsupportedModelError

logger = logging.getLogger(__name__)

LATENT_NORM_EPS = 1e-6  # GlmMoeDsaRMSNorm's default: q_a_layernorm / kv_a_layernorm are built without an eps
INDEXER_K_NORM_EPS = 1e-6  # GlmMoeDsaIndexer.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)


@dataclass(frozen=True)
class MlaDsa:
    """Multi-latent attention with a DeepSeek-sparse-attention indexer (GLM-5's attention)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # Which layers run their own indexer: megatron's rule (1-based layer n computes iff
    # max(n - offset, 0) % freq == 0); freq 1 = every layer.
    index_topk_freq: int
    index_skip_topk_offset: int
    indexer_layers: tuple[bool, ...]  # per layer: has its own indexer (HF indexer_types == "full")
    mtp_layers: int  # the checkpoint's num_nextn_predict_layers: not built, not trained

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _indexer_schedule(types: list[str]) -> tuple[int, int]:
    """(freq, offset) with which megatron's index-sharing rule reproduces HF's ``indexer_types``."""
    n = len(types)
    full = [t == "full" for t in types]
    if all(full):
        return 1, 0
    for freq in range(2, n + 1):
        for offset in range(1, n + 1):
            if all(full[i] == (max(i + 1 - offset, 0) % freq == 0) for i in range(n)):
                return freq, offset
    raise UnsupportedModelError(f"indexer_types={types!r}: megatron-core shares DSA top-k indices only on a "
                                "periodic schedule (index_topk_freq / index_skip_topk_offset); use such a config")


def _mlp_layers(hf_config: Any) -> tuple[bool, ...]:
    types = list(hf_config.mlp_layer_types)
    bad = sorted(set(types) - {"dense", "sparse"})
    if bad:
        raise UnsupportedModelError(f"mlp_layer_types holds {bad}: only 'dense' and 'sparse' layers are built")
    return tuple(t == "sparse" for t in types)


def _router(hf_config: Any) -> dict[str, Any]:
    if not hf_config.norm_topk_prob:
        raise UnsupportedModelError("norm_topk_prob=False: megatron-core's sigmoid router always renormalizes "
                                    "the top-k weights; use a config with norm_topk_prob=True")
    groups, topk_group, topk = int(hf_config.n_group), int(hf_config.topk_group), hf_config.num_experts_per_tok
    if groups > 1 and topk != 2 * topk_group:
        raise UnsupportedModelError(f"n_group={groups}, topk_group={topk_group}, num_experts_per_tok={topk}: "
                                    "transformers ranks expert groups by their top-2 scores, megatron-core by their "
                                    "top-(k/topk_group); they agree only when num_experts_per_tok == 2 * topk_group")
    shared = hf_config.moe_intermediate_size * int(hf_config.n_shared_experts or 0)
    return dict(num_experts=hf_config.n_routed_experts, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                moe_topk=topk, moe_renormalize=True, shared_expert_ffn_hidden_size=shared or None,
                router_expert_bias=True, router_score_function="sigmoid",
                router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
                router_num_groups=groups if groups > 1 else None, router_group_topk=topk_group if groups > 1 else None)


def describe_glm_moe_dsa(hf_config: Any, rope_theta: float) -> dict[str, Any]:
    """Keyword arguments of ``Architecture`` for a ``GlmMoeDsaConfig`` (raises on what cannot be built)."""
    if getattr(hf_config, "q_lora_rank", None) is None:
        raise UnsupportedModelError("q_lora_rank=None: megatron-core's DSA needs the low-rank query (its indexer "
                                    "reads it); use a config with q_lora_rank set")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, field, False):
            raise UnsupportedModelError(f"{field}=True is not supported by the Megatron backend (DSA builds no "
                                        "linear bias)")
    if hf_config.index_head_dim < hf_config.qk_rope_head_dim:
        raise UnsupportedModelError(f"index_head_dim={hf_config.index_head_dim} < qk_rope_head_dim="
                                    f"{hf_config.qk_rope_head_dim}: the indexer's rope slice must fit its head")
    n = hf_config.num_hidden_layers
    types = list(hf_config.indexer_types)
    freq, offset = _indexer_schedule(types)
    mla = MlaDsa(q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
                 qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
                 v_head_dim=hf_config.v_head_dim, index_n_heads=hf_config.index_n_heads,
                 index_head_dim=hf_config.index_head_dim, index_topk=hf_config.index_topk,
                 index_topk_freq=freq, index_skip_topk_offset=offset,
                 indexer_layers=tuple(t == "full" for t in types),
                 mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0))
    heads = hf_config.num_attention_heads
    return dict(
        model_type="glm_moe_dsa", num_layers=n, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=heads,
        num_query_groups=heads,  # MLA expands the latent to every head: no key/value head sharing
        head_dim=mla.qk_head_dim, vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings, norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=rope_theta, init_std=float(hf_config.initializer_range), qkv_bias=False, qk_norm=False,
        tied_embeddings=bool(hf_config.tie_word_embeddings), moe_layers=_mlp_layers(hf_config),
        mla_dsa=mla, **_router(hf_config))


def attention_names(mla: MlaDsa, layer: int) -> list[tuple[str, str]]:
    """``(hf_name, megatron_name)`` of layer ``layer``'s attention weights; every one maps unchanged."""
    hf, mc = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
    names = [("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_a_layernorm.weight", "q_layernorm.weight"),
             ("q_b_proj.weight", "linear_q_up_proj.weight"),
             ("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
             ("kv_a_layernorm.weight", "kv_layernorm.weight"), ("kv_b_proj.weight", "linear_kv_up_proj.weight"),
             ("o_proj.weight", "linear_proj.weight")]
    if mla.indexer_layers[layer]:
        idx = "core_attention.indexer."
        names += [("indexer.wq_b.weight", idx + "linear_wq_b.weight"), ("indexer.wk.weight", idx + "linear_wk.weight"),
                  ("indexer.k_norm.weight", idx + "k_norm.weight"), ("indexer.k_norm.bias", idx + "k_norm.bias"),
                  ("indexer.weights_proj.weight", idx + "linear_weights_proj.weight")]
    return [(hf + h, mc + m) for h, m in names]


def mla_dsa_config_kwargs(mla: MlaDsa, rope_theta: float) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of GLM-5's attention (on top of model.py's common ones)."""
    return dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        kv_channels=mla.qk_head_dim,
        qk_layernorm=True,  # the q / kv latent norms (built by glm_moe_dsa_layers with HF's fixed eps)
        rope_type="rope", rotary_base=rope_theta, rotary_percent=1.0,
        rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,  # softmax scale 1/sqrt(qk_head_dim), as HF
        experimental_attention_variant="dsa", dsa_indexer_n_heads=mla.index_n_heads,
        dsa_indexer_head_dim=mla.index_head_dim, dsa_indexer_topk=mla.index_topk,
        dsa_indexer_topk_freq=mla.index_topk_freq, dsa_indexer_skip_topk_offset=mla.index_skip_topk_offset,
        dsa_indexer_loss_coeff=0.0,  # HF trains no indexer loss (its indexer runs under no_grad)
        dsa_kernel_backend="none",  # megatron's PyTorch path: no tilelang / cuDNN kernels
        dsa_indexer_rope_interleaved=True, dsa_indexer_rotate_activation=False, dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS, dsa_indexer_k_norm_fp32=False,
        mtp_num_layers=None,
        transformer_impl="local",
    )


def log_left_out_mtp(mla: Optional[MlaDsa]) -> None:
    if mla is not None and mla.mtp_layers:
        logger.info("glm_moe_dsa: the checkpoint's %d multi-token-prediction layer(s) are not trained "
                    "(megatron mtp_num_layers=0): transformers drops them on load, so neither the trained "
                    "policy nor its HF export holds them", mla.mtp_layers)
