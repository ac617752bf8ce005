"""The GPT family's decoder block: Transformer Engine's spec when it imports, else megatron's local spec with
torch's fused scaled_dot_product_attention in place of its unfused attention (megatron-core imported inside)."""

from __future__ import annotations

from typing import Any

from ...sdpa_attention import SDPACoreAttention, with_core_attention
from ..family import BlockOptions

__all__ = ["te_available", "block_spec"]


def te_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def block_spec(config: Any, options: BlockOptions) -> tuple[Any, bool]:
    """megatron's decoder block spec of stage ``options.pp_rank`` (it places MoE and dense layers by
    ``config.moe_layer_freq`` and picks the final norm)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = te_available() if options.use_te is None else options.use_te
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                      pp_rank=options.pp_rank)
    if not use_te and options.fused_attention:
        spec = with_core_attention(spec, SDPACoreAttention)
    return spec, use_te
