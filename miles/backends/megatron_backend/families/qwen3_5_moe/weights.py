"""Qwen3.5-MoE's weight layout: the gated ``linear_qkv`` of its full-attention layers, and each layer's HF <->
Megatron rules (pure)."""

from __future__ import annotations

import torch

from ...architecture import Architecture
from ...pieces.gated_deltanet import gated_deltanet_rules
from ...weight_rules import Rule, cat_rows, halves, layer_prefixes, routed_expert_rules

__all__ = ["gated_qkv_to_megatron", "gated_qkv_to_hf", "layer_rules"]


def gated_qkv_to_megatron(q_and_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          arch: Architecture) -> torch.Tensor:
    """HF ``q_proj`` (per head: query rows, then gate rows), ``k_proj``, ``v_proj`` -> Megatron's gated
    ``linear_qkv`` (per query group: its query heads, its gate heads, its key head, its value head)."""
    g, d, per_group = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    rest = k.shape[1:]
    heads = q_and_gate.reshape(g, per_group, 2, d, *rest)
    parts = (heads[:, :, 0].reshape(g, per_group * d, *rest), heads[:, :, 1].reshape(g, per_group * d, *rest),
             k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def gated_qkv_to_hf(qkv: torch.Tensor, arch: Architecture) -> list[torch.Tensor]:
    """Inverse of :func:`gated_qkv_to_megatron`: ``[q_proj, k_proj, v_proj]``."""
    g, d, per_group = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    rest = qkv.shape[1:]
    q, gate, k, v = torch.split(qkv.reshape(g, (2 * per_group + 2) * d, *rest),
                                [per_group * d, per_group * d, d, d], dim=1)
    q_and_gate = torch.stack([q.reshape(g, per_group, d, *rest), gate.reshape(g, per_group, d, *rest)], dim=2)
    return [q_and_gate.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def _gated_attention_rules(arch: Architecture, hf: str, mc: str) -> list[Rule]:
    attn = hf + "self_attn."
    return [
        Rule(tuple(f"{attn}{p}_proj.weight" for p in "qkv"), mc + "self_attention.linear_qkv.weight",
             lambda ts: gated_qkv_to_megatron(*ts, arch), lambda t: gated_qkv_to_hf(t, arch)),
        Rule((attn + "o_proj.weight",), mc + "self_attention.linear_proj.weight"),
        Rule((attn + "q_norm.weight",), mc + "self_attention.q_layernorm.weight"),
        Rule((attn + "k_norm.weight",), mc + "self_attention.k_layernorm.weight"),
    ]


def layer_rules(arch: Architecture, layer: int, fused_norms: bool) -> list[Rule]:
    """Layer ``layer``'s rules: norms, its token mixer, the gated shared expert, the router and routed experts."""
    if fused_norms:
        raise ValueError(f"{arch.model_type} is built with its own layer spec, whose norms are never fused "
                         "into the linear layers: convert with fused_norms=False")
    hf, mc = layer_prefixes(layer)
    shared = hf + "mlp.shared_expert."
    mixer = (gated_deltanet_rules(arch.linear_attention, hf, mc) if arch.linear_attention.linear_layers[layer]
             else _gated_attention_rules(arch, hf, mc))
    return [
        Rule((hf + "input_layernorm.weight",), mc + "input_layernorm.weight"),
        *mixer,
        Rule((hf + "post_attention_layernorm.weight",), mc + "pre_mlp_layernorm.weight"),
        Rule((shared + "gate_proj.weight", shared + "up_proj.weight"), mc + "mlp.shared_experts.linear_fc1.weight",
             cat_rows, halves),
        Rule((shared + "down_proj.weight",), mc + "mlp.shared_experts.linear_fc2.weight"),
        Rule((hf + "mlp.shared_expert_gate.weight",), mc + "mlp.shared_experts.gate_weight"),
        *routed_expert_rules(arch, layer),
    ]
