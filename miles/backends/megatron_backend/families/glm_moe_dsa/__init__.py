"""GLM-5 (transformers ``glm_moe_dsa``) for the Megatron backend: multi-latent attention with DeepSeek sparse
attention's indexer (``pieces/mla.py`` + ``pieces/dsa.py``, built by ``pieces/dsa_layers.py`` without Transformer
Engine), dense then sparse MLP layers by ``mlp_layer_types``, the group-limited sigmoid router with shared experts
(``pieces/sigmoid_router.py``).

MTP: transformers drops the checkpoint's ``model.layers.{num_hidden_layers}.*`` (the next-token prediction layer)
on load, so the policy has no MTP weights; they are not trained here (``model.py`` logs it).
"""

from __future__ import annotations

from typing import Any, Optional

from miles.sizing.tensors import Tensor

from ...architecture import Architecture, UnsupportedModelError, require_silu, rope_theta
from ...pieces.dsa import (DSA_TP_RULES, dsa_config_kwargs, dsa_layout_sizes, indexer_layer_tensors, indexer_rules,
                           read_dsa)
from ...pieces.mla import MLA_TP_RULES, mla_attention_rules, mla_attention_tensors, mla_config_kwargs, read_mla
from ...pieces.sigmoid_router import sigmoid_router_fields
from ...weight_rules import Rule, mlp_rules
from ..family import BlockOptions, Family, mla_transformer_config, stage_of

__all__ = ["GLM_MOE_DSA"]


def _mlp_layers(hf_config: Any) -> tuple[bool, ...]:
    types = list(hf_config.mlp_layer_types)
    bad = sorted(set(types) - {"dense", "sparse"})
    if bad:
        raise UnsupportedModelError(f"mlp_layer_types holds {bad}: only 'dense' and 'sparse' layers are built")
    return tuple(t == "sparse" for t in types)


def _describe(hf_config: Any) -> Architecture:
    require_silu(hf_config)
    if getattr(hf_config, "q_lora_rank", None) is None:
        raise UnsupportedModelError("q_lora_rank=None: megatron-core's DSA needs the low-rank query (its indexer "
                                    "reads it); use a config with q_lora_rank set")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, field, False):
            raise UnsupportedModelError(f"{field}=True is not supported by the Megatron backend (DSA builds no "
                                        "linear bias)")
    mla, dsa = read_mla(hf_config), read_dsa(hf_config)
    heads = hf_config.num_attention_heads
    return Architecture(
        model_type="glm_moe_dsa", num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=heads,
        num_query_groups=heads,  # MLA expands the latent to every head: no key/value head sharing
        head_dim=mla.qk_head_dim, vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings, norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=rope_theta(hf_config), init_std=float(hf_config.initializer_range), qkv_bias=False, qk_norm=False,
        tied_embeddings=bool(hf_config.tie_word_embeddings), moe_layers=_mlp_layers(hf_config), mla=mla, dsa=dsa,
        mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0),
        tp_rules=MLA_TP_RULES.joined(DSA_TP_RULES), **sigmoid_router_fields(hf_config))


def _config_kwargs(arch: Architecture) -> dict[str, Any]:
    return dict(mla_config_kwargs(arch.mla, arch.rope_theta), **dsa_config_kwargs(arch.dsa), mtp_num_layers=None)


def _block_spec(config: Any, options: BlockOptions) -> tuple[Any, bool]:
    from ...pieces.dsa_layers import dsa_decoder_block_spec

    return stage_of(dsa_decoder_block_spec(config), config, options.pp_rank), False


def _layer_rules(arch: Architecture, layer: int, fused_norms: bool) -> list[Rule]:
    """The MLA's and the indexer's names, then the MLP's; no norm is fused (the DSA spec keeps each its own)."""
    return [*mla_attention_rules(arch.mla, layer), *indexer_rules(arch.dsa, layer), *mlp_rules(arch, layer, False)]


def _attention_tensors(arch: Architecture, layer: Optional[int], prefix: str) -> list[Tensor]:
    return [*mla_attention_tensors(arch, layer, prefix), *indexer_layer_tensors(arch, layer, prefix)]


GLM_MOE_DSA = Family(name="glm_moe_dsa", model_types=("glm_moe_dsa",), describe=_describe,
                     config_kwargs=_config_kwargs, block_spec=_block_spec, layer_rules=_layer_rules,
                     attention_tensors=_attention_tensors, tiny_preset="glm5-tiny",
                     transformer_config=mla_transformer_config, layout_sizes=dsa_layout_sizes)
