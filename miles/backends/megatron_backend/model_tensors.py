"""The tensors of a model a family builds, as ``miles plan`` and validation count them (``miles.sizing``'s
``ModelTensors``): from the family's :class:`~.architecture.Architecture`, the one reading of its config.

Each family states its token mixer (``Family.attention_tensors``, composed from the pieces' and
:func:`gqa_attention_tensors`); the norms, the dense or MoE MLP, the embedding, the output layer and the
multi-token-prediction layers are every family's and come from the Architecture's shared fields here. The shapes
are ``miles.sizing.tensors``' builders, the same ones ``miles.sizing.model_params`` reads other model types into.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

from miles.sizing.tensors import (ModelTensors, Tensor, assemble_model, decoder_layer_tensors, gqa_tensors,
                                  mlp_tensors, mtp_layer_tensors)

from .architecture import Architecture

__all__ = ["AttentionTensors", "gqa_attention_tensors", "model_tensors"]

# (arch, layer, prefix) -> the token mixer's tensors under ``prefix`` ("decoder.layers.3"); layer None: a
# multi-token-prediction layer's transformer layer (full attention)
AttentionTensors = Callable[[Architecture, Optional[int], str], list[Tensor]]


def gqa_attention_tensors(arch: Architecture, layer: Optional[int], prefix: str) -> list[Tensor]:
    """Grouped-query attention (Megatron's fused ``linear_qkv``, doubled q when gated, q/k norms)."""
    return gqa_tensors(f"{prefix}.self_attention", arch.hidden_size, arch.num_attention_heads, arch.num_query_groups,
                       arch.head_dim, gated=arch.attention_output_gate, qk_norm=arch.qk_norm)


def _mlp(arch: Architecture, prefix: str, moe: bool) -> list[Tensor]:
    if not moe:
        return mlp_tensors(prefix, arch.hidden_size, ffn=arch.ffn_hidden_size)
    return mlp_tensors(prefix, arch.hidden_size, ffn=arch.moe_ffn_hidden_size, experts=arch.num_experts,
                       shared_ffn=arch.shared_expert_ffn_hidden_size or 0, shared_gate=arch.shared_expert_gate)


def _layer(arch: Architecture, attention: AttentionTensors, layer: Optional[int], prefix: str, moe: bool):
    return decoder_layer_tensors(prefix, arch.hidden_size, attention(arch, layer, prefix), _mlp(arch, prefix, moe))


def _layer_kind(arch: Architecture, attention: AttentionTensors, layer: int) -> Hashable:
    """Layers of one kind differ only in names: the token mixer's shapes and whether the MLP is MoE."""
    mixer = tuple((t.shape, t.tp_split) for t in attention(arch, layer, ""))
    return mixer, arch.is_moe_layer(layer)


def model_tensors(arch: Architecture, attention: AttentionTensors, name: str = "model", tp: int = 1,
                  mtp: bool = True) -> ModelTensors:
    """The model's tensors with its vocabulary padded for ``tp`` as Megatron pads it; ``mtp=False`` leaves out the
    checkpoint's multi-token-prediction layers. Raises ``ModelConfigError`` past the planner's bounds."""
    def build_layer(i: int, prefix: str) -> list[Tensor]:
        return _layer(arch, attention, i, prefix, arch.is_moe_layer(i))

    def build_mtp(prefix: str) -> list[Tensor]:  # full attention; MoE when the model is
        inner = _layer(arch, attention, None, f"{prefix}.transformer_layer", moe=arch.num_experts is not None)
        return mtp_layer_tensors(prefix, arch.hidden_size, inner)

    kinds = [_layer_kind(arch, attention, i) for i in range(arch.num_layers)]
    return assemble_model(name, arch.hidden_size, arch.vocab_size, tp, arch.tied_embeddings, kinds, build_layer,
                          arch.mtp_layers if mtp else 0, build_mtp)
