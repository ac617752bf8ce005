"""DeepSeek-V3 (transformers ``deepseek_v3``; Kimi-K2 is this model type) for the Megatron backend: multi-latent
attention without an indexer (``pieces/mla.py``, the default rotary embedding or YaRN, rope pairs interleaved or
not, with or without the low-rank query; built by ``pieces/mla_layers.py`` without Transformer Engine), the first
``first_k_dense_replace`` layers dense and the rest MoE, the group-limited sigmoid router with its fp32
``e_score_correction_bias`` and the shared experts (``pieces/sigmoid_router.py``).

Facts of transformers' ``modeling_deepseek_v3.py`` (5.x) this relies on, beyond the pieces': layer ``i`` is MoE
iff ``i >= first_k_dense_replace``; the attention expands the latent to every head (``num_key_value_heads``
must equal ``num_attention_heads``: its eager attention would repeat the keys otherwise); ``attention_bias`` puts
biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``, which megatron's MLA does not build. MTP:
transformers drops the checkpoint's ``model.layers.{num_hidden_layers}.*`` on load; not trained here
(``model.py`` logs it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...architecture import Architecture, UnsupportedModelError, reject, require_silu
from ...pieces.mla import (MLA_TP_RULES, mla_attention_rules, mla_attention_tensors, mla_config_kwargs, read_mla,
                           read_mla_rope)
from ...pieces.sigmoid_router import sigmoid_router_fields
from ...weight_rules import Rule, mlp_rules
from ..family import BlockOptions, Family, mla_transformer_config

__all__ = ["DEEPSEEK_V3"]


def _describe(hf_config: Any) -> Architecture:
    require_silu(hf_config)
    reject(hf_config, "attention_bias", True, "megatron-core's multi-latent attention builds no q/kv down "
                                              "projection bias")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if kv_heads != heads:
        raise UnsupportedModelError(f"num_key_value_heads={kv_heads} with num_attention_heads={heads}: multi-latent "
                                    "attention expands its latent to every head; set num_key_value_heads to "
                                    f"{heads}")
    theta, yarn = read_mla_rope(hf_config)
    mla = dataclasses.replace(read_mla(hf_config), rope_interleaved=bool(hf_config.rope_interleave), yarn=yarn)
    n, dense = hf_config.num_hidden_layers, hf_config.first_k_dense_replace
    return Architecture(
        model_type="deepseek_v3", num_layers=n, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=heads, num_query_groups=heads,
        head_dim=mla.qk_head_dim, vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings, norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=theta, init_std=float(hf_config.initializer_range), qkv_bias=False, qk_norm=False,
        tied_embeddings=bool(hf_config.tie_word_embeddings), moe_layers=tuple(i >= dense for i in range(n)),
        mla=mla, mtp_layers=int(hf_config.num_nextn_predict_layers or 0), tp_rules=MLA_TP_RULES,
        **sigmoid_router_fields(hf_config))


def _config_kwargs(arch: Architecture) -> dict[str, Any]:
    return dict(mla_config_kwargs(arch.mla, arch.rope_theta), transformer_impl="local")  # the spec: no TE


def _block_spec(config: Any, options: BlockOptions) -> tuple[Any, bool]:
    from ...pieces.mla_layers import mla_decoder_block_spec

    return mla_decoder_block_spec(config, options.pp_rank), False


def _layer_rules(arch: Architecture, layer: int, fused_norms: bool) -> list[Rule]:
    """The MLA's names, then the MLP's; no norm is fused (the MLA spec keeps each its own)."""
    return [*mla_attention_rules(arch.mla, layer), *mlp_rules(arch, layer, False)]


DEEPSEEK_V3 = Family(name="deepseek_v3", model_types=("deepseek_v3",), describe=_describe,
                     config_kwargs=_config_kwargs, block_spec=_block_spec, layer_rules=_layer_rules,
                     attention_tensors=mla_attention_tensors, tiny_preset="deepseek-v3-tiny",
                     transformer_config=mla_transformer_config)
