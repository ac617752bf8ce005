"""HF <-> Megatron weight-name rules, and those of the GPT layer that families compose (pure, no megatron import).

A :class:`Rule` says which HF tensors make one Megatron tensor and how (``merge``) and back (``split``). Each
family's ``layer_rules(arch, i, fused_norms)`` returns decoder layer ``i``'s rules from these pieces and its own;
``convert.py`` walks them. Layouts that differ from HF:

- ``linear_qkv`` is interleaved per query group: for each of the ``num_query_groups`` groups, the group's
  ``heads_per_group`` query heads, then its key head, then its value head (rows of ``head_dim`` each); the bias
  (Qwen2) follows the same row order.
- ``linear_fc1`` is ``cat(gate_proj, up_proj)`` along the output rows (SwiGLU).
- Norms: the local layer spec has ``input_layernorm`` / ``pre_mlp_layernorm``; Transformer Engine's spec fuses
  them into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` (``fused_norms=True``), except
  before an MoE block, which keeps ``pre_mlp_layernorm``.
- Routed experts use the canonical per-expert HF names (:func:`canonical_expert`; ``convert.py`` maps every HF
  expert layout to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .architecture import Architecture

__all__ = ["Rule", "identity", "single", "cat_rows", "halves", "qkv_to_megatron", "qkv_to_hf", "canonical_expert",
           "canonical_router", "input_norm_rule", "gqa_attention_rules", "mlp_rules", "routed_expert_rules",
           "layer_prefixes"]


def identity(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def single(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def halves(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.chunk(tensor, 2, dim=0))


@dataclass(frozen=True)
class Rule:
    """HF tensors ``hf`` (in the order ``merge`` takes them) <-> the Megatron tensor ``mcore``."""

    hf: tuple[str, ...]
    mcore: str
    merge: Callable[[list[torch.Tensor]], torch.Tensor] = identity
    split: Callable[[torch.Tensor], list[torch.Tensor]] = single


def layer_prefixes(layer: int) -> tuple[str, str]:
    """``(hf, megatron)`` name prefixes of decoder layer ``layer``."""
    return f"model.layers.{layer}.", f"decoder.layers.{layer}."


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """HF q/k/v projections (weights ``[out, in]`` or biases ``[out]``) -> Megatron's grouped ``linear_qkv``."""
    g, d = arch.num_query_groups, arch.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, arch.heads_per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_to_hf(qkv: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_to_megatron`."""
    g, d = arch.num_query_groups, arch.head_dim
    rest = qkv.shape[1:]
    q, k, v = torch.split(qkv.reshape(g, (arch.heads_per_group + 2) * d, *rest), [arch.heads_per_group * d, d, d],
                          dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def canonical_expert(layer: int, expert: int, proj: str) -> str:
    """The per-expert HF name ``convert.py`` reads every HF expert layout into (Qwen3-MoE 4.x spelling)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def canonical_router(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def input_norm_rule(arch: Architecture, i: int, fused: bool) -> Rule:
    """The layer's input norm: its own module, or fused into ``linear_qkv`` (Transformer Engine's spec)."""
    hf, mc = layer_prefixes(i)
    return Rule((hf + "input_layernorm.weight",),
                mc + ("self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight"))


def gqa_attention_rules(arch: Architecture, i: int, fused_norms: bool) -> list[Rule]:
    """Grouped-query attention: the input norm, fused q/k/v (and Qwen2's bias), the output projection, q/k norms."""
    hf, mc = layer_prefixes(i)
    attn = hf + "self_attn."
    qkv = lambda ts: qkv_to_megatron(*ts, arch)  # noqa: E731
    unqkv = lambda t: list(qkv_to_hf(t, arch))  # noqa: E731
    rules = [
        input_norm_rule(arch, i, fused_norms),
        Rule(tuple(f"{attn}{p}_proj.weight" for p in "qkv"), mc + "self_attention.linear_qkv.weight", qkv, unqkv),
        Rule((attn + "o_proj.weight",), mc + "self_attention.linear_proj.weight"),
    ]
    if arch.qkv_bias:
        rules.append(Rule(tuple(f"{attn}{p}_proj.bias" for p in "qkv"), mc + "self_attention.linear_qkv.bias",
                          qkv, unqkv))
    if arch.qk_norm:
        rules += [Rule((attn + "q_norm.weight",), mc + "self_attention.q_layernorm.weight"),
                  Rule((attn + "k_norm.weight",), mc + "self_attention.k_layernorm.weight")]
    return rules


def routed_expert_rules(arch: Architecture, i: int) -> list[Rule]:
    """MoE layer ``i``'s router and routed experts (globally numbered), in SequentialMLP's names; ``convert.py``
    stacks each projection's into one rule when the experts are built grouped (``pieces/grouped_experts.py``)."""
    mc = layer_prefixes(i)[1]
    rules = [Rule((canonical_router(i),), mc + "mlp.router.weight")]
    for e in range(arch.num_experts):
        expert = f"{mc}mlp.experts.local_experts.{e}."
        rules += [
            Rule((canonical_expert(i, e, "gate_proj"), canonical_expert(i, e, "up_proj")),
                 expert + "linear_fc1.weight", cat_rows, halves),
            Rule((canonical_expert(i, e, "down_proj"),), expert + "linear_fc2.weight"),
        ]
    return rules


def mlp_rules(arch: Architecture, i: int, fused_norms: bool) -> list[Rule]:
    """The pre-MLP norm and the MLP: a dense SwiGLU, or the MoE block (the router's expert bias and the shared
    experts in DeepSeek-V3's names where the model has them, then the router and routed experts)."""
    hf, mc = layer_prefixes(i)
    moe = arch.is_moe_layer(i)
    pre_mlp = "mlp.linear_fc1.layer_norm_weight" if fused_norms and not moe else "pre_mlp_layernorm.weight"
    rules = [Rule((hf + "post_attention_layernorm.weight",), mc + pre_mlp)]
    if not moe:
        return rules + [
            Rule((hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), mc + "mlp.linear_fc1.weight",
                 cat_rows, halves),
            Rule((hf + "mlp.down_proj.weight",), mc + "mlp.linear_fc2.weight"),
        ]
    if arch.router_expert_bias:  # an fp32 buffer on both sides
        rules.append(Rule((hf + "mlp.gate.e_score_correction_bias",), mc + "mlp.router.expert_bias"))
    if arch.shared_expert_ffn_hidden_size:  # one SwiGLU for all shared experts
        shared = hf + "mlp.shared_experts."
        rules += [Rule((shared + "gate_proj.weight", shared + "up_proj.weight"),
                       mc + "mlp.shared_experts.linear_fc1.weight", cat_rows, halves),
                  Rule((shared + "down_proj.weight",), mc + "mlp.shared_experts.linear_fc2.weight")]
    return rules + routed_expert_rules(arch, i)
