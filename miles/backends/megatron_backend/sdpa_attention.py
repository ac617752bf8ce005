"""Fused core attention for megatron-core's local layer spec: torch's scaled_dot_product_attention.

Without Transformer Engine the local spec's ``DotProductAttention`` materialises the ``[b, heads, s, s]``
scores, masks and softmaxes them in separate kernels and repeats the key/value heads for grouped-query
attention. :class:`SDPACoreAttention` takes the same constructor and forward arguments and computes the
same attention with one ``scaled_dot_product_attention`` call (FlashAttention or memory-efficient kernels
on CUDA; ``enable_gqa`` for grouped query heads, no repeat). :func:`with_core_attention` puts it in a
block spec built by ``get_gpt_decoder_block_spec``.

Masks follow megatron's convention (True = masked out). With no mask and a causal mask type, the causal
mask applies (what the local softmax builds itself); a given mask replaces it, as in the local softmax.
Our batches are right-padded and pass no mask: under the causal mask a real token sees only earlier
positions, all of them real, so pads never reach a real token; pad positions' outputs are finite and
carry no loss.

Refused at construction (they would need more than one fused call): context parallelism, sliding-window
attention, softmax variants other than vanilla, attention dropout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["SDPACoreAttention", "sdpa_context", "with_core_attention"]


def sdpa_context(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float, causal: bool,
                 mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention in megatron's layout: ``query`` ``[sq, b, heads, d]``, ``key``/``value`` ``[sk, b, groups,
    d]`` (``groups`` divides ``heads``); ``mask`` True where attention is masked out (broadcastable to
    ``[b, heads, sq, sk]``), replacing the causal mask when given. Returns ``[sq, b, heads * d]``."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
    if causal and mask is None and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal self-attention needs as many queries as keys (got {q.shape[2]} and {k.shape[2]})")
    context = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else ~mask, is_causal=causal and mask is None, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    sq, b = query.shape[:2]
    return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


class SDPACoreAttention(torch.nn.Module):
    """megatron-core's core-attention interface (``DotProductAttention``'s constructor and forward)
    computed by :func:`sdpa_context`. Holds no parameters."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None):
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {"context parallelism": config.context_parallel_size != 1,
                       "sliding-window attention": config.window_size is not None,
                       f"softmax_type {config.softmax_type!r}": config.softmax_type != "vanilla",
                       f"attention dropout {dropout}": dropout != 0.0}
        refused = [what for what, present in unsupported.items() if present]
        if refused:
            raise ValueError(f"SDPACoreAttention does not implement {', '.join(refused)}; build the model with "
                             "Transformer Engine's spec or the local DotProductAttention")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the scores
        # back inside the softmax (fp16 range): the same attention, so the plain scale here
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Any = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes no packed sequences and no attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return sdpa_context(query, key, value, scale=self.softmax_scale, causal=mask_type.name == "causal",
                            mask=attention_mask)


def with_core_attention(block_spec: Any, core_attention: type) -> Any:
    """A copy of a decoder block spec (``TransformerBlockSubmodules``) whose self-attention layers use
    ``core_attention``; layers without ``self_attention.submodules.core_attention`` stay as they are."""
    layers = []
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if not hasattr(getattr(attention, "submodules", None), "core_attention"):
            layers.append(layer)
            continue
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, core_attention=core_attention))
        layers.append(dataclasses.replace(
            layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention)))
    return dataclasses.replace(block_spec, layer_specs=layers)
