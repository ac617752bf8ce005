"""Qwen3.5-MoE (transformers ``qwen3_5_moe`` and its language model ``qwen3_5_moe_text``) in the Megatron backend.

What transformers' ``modeling_qwen3_5_moe.py`` computes, and the megatron-core piece built for it
(``qwen3_5_moe_config.py`` reads the config, ``qwen3_5_moe_layers.py`` builds the layer spec; this module
holds the weight layouts and the TransformerConfig keywords, pure, tested on CPU):

- Token mixer per layer, by ``layer_types``: "linear_attention" is a Gated DeltaNet (megatron-core's
  ``GatedDeltaNet``), "full_attention" (every ``full_attention_interval``-th layer by default) is gated
  softmax attention. Megatron's ``linear_attention_freq`` takes the same pattern as a list.
- Gated DeltaNet: HF's input projections ``in_proj_qkv`` (q, k, v rows), ``in_proj_z`` (output gate),
  ``in_proj_b`` (beta) and ``in_proj_a`` (alpha), concatenated in that row order, are Megatron's one
  ``in_proj``; the depthwise ``conv1d`` (over q, k, v), ``dt_bias``, ``A_log`` and ``out_proj`` map one to
  one. HF's gated output norm ``norm`` (its weight used as is) is ``out_norm``. ``A_log`` is trained in
  fp32 (:data:`NATIVE_FP32_PARAMS`): HF itself computes the decay from ``A_log.float()``.
- Full attention: ``q_proj`` yields, per head, the query and a sigmoid output gate (rows
  ``[heads, 2, head_dim]``); Megatron's ``linear_qkv`` with ``attention_output_gate`` holds, per query
  group, the group's query heads, then their gate heads, then the key head and the value head.
  q/k RMSNorms per head.
- Every other RMSNorm (layer inputs, q/k, final) scales by ``1 + weight`` in fp32: the layer spec builds
  the same norm, so those weights map unchanged.
- Rotary embedding on the first ``partial_rotary_factor`` of each head (Megatron's ``rotary_percent``).
  The text model's multimodal rotary sections (``mrope_section``) all read the same position for text
  tokens, which makes them the plain rotary embedding; image and video positions are not built.
- An MoE block in every layer: softmax router, top-k then renormalized (always; the config has no
  ``norm_topk_prob``), routed experts, and one shared expert scaled by ``sigmoid(shared_expert_gate(x))``
  (Megatron's ``moe_shared_expert_gate``).
- The multi-token-prediction layer of Qwen3.5 checkpoints (``mtp.*``) is not part of transformers' model
  (it drops those weights on load): it is neither built nor trained.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..architecture import Architecture

__all__ = ["NATIVE_FP32_PARAMS", "layer_rules", "gated_qkv_to_megatron", "gated_qkv_to_hf", "transformer_config_kwargs"]

# Megatron parameter names (suffixes) kept in fp32 when the model trains in bf16.
NATIVE_FP32_PARAMS = ("self_attention.A_log",)


# ---- weight layouts --------------------------------------------------------------------------------
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


def _same(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _one(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


Rule = tuple[tuple[str, ...], str, Callable[[list[torch.Tensor]], torch.Tensor],
             Callable[[torch.Tensor], list[torch.Tensor]]]


def _token_mixer_rules(arch: Architecture, i: int, hf: str, mc: str) -> list[Rule]:
    if arch.linear_attention.linear_layers[i]:
        gdn, attn = arch.linear_attention, hf + "linear_attn."
        rows = list(gdn.in_proj_rows)
        in_proj = tuple(f"{attn}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
        return [
            (in_proj, mc + "self_attention.in_proj.weight", _cat_rows,
             lambda t: list(torch.split(t, rows, dim=0))),
            *(((attn + name,), mc + f"self_attention.{ours}", _same, _one) for name, ours in (
                ("conv1d.weight", "conv1d.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
                ("norm.weight", "out_norm.weight"), ("out_proj.weight", "out_proj.weight"))),
        ]
    attn = hf + "self_attn."
    return [
        (tuple(f"{attn}{p}_proj.weight" for p in "qkv"), mc + "self_attention.linear_qkv.weight",
         lambda ts: gated_qkv_to_megatron(*ts, arch), lambda t: gated_qkv_to_hf(t, arch)),
        ((attn + "o_proj.weight",), mc + "self_attention.linear_proj.weight", _same, _one),
        ((attn + "q_norm.weight",), mc + "self_attention.q_layernorm.weight", _same, _one),
        ((attn + "k_norm.weight",), mc + "self_attention.k_layernorm.weight", _same, _one),
    ]


def layer_rules(arch: Architecture, i: int) -> list[Rule]:
    """Layer ``i``'s HF <-> Megatron rules, ``(hf_names, megatron_name, merge, split)``, except the router and
    routed experts (the common MoE rules of ``convert.py``)."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    shared = hf + "mlp.shared_expert."
    return [
        ((hf + "input_layernorm.weight",), mc + "input_layernorm.weight", _same, _one),
        *_token_mixer_rules(arch, i, hf, mc),
        ((hf + "post_attention_layernorm.weight",), mc + "pre_mlp_layernorm.weight", _same, _one),
        ((shared + "gate_proj.weight", shared + "up_proj.weight"), mc + "mlp.shared_experts.linear_fc1.weight",
         _cat_rows, lambda t: list(torch.chunk(t, 2, dim=0))),
        ((shared + "down_proj.weight",), mc + "mlp.shared_experts.linear_fc2.weight", _same, _one),
        ((hf + "mlp.shared_expert_gate.weight",), mc + "mlp.shared_experts.gate_weight", _same, _one),
    ]


# ---- megatron-core TransformerConfig ----------------------------------------------------------------
def transformer_config_kwargs(arch: Architecture) -> dict[str, Any]:
    """What ``TransformerConfig`` needs beyond the common GPT / MoE keywords (``model.py``)."""
    gdn = arch.linear_attention
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(linear) for linear in gdn.linear_layers],  # 1 = Gated DeltaNet
        linear_conv_kernel_dim=gdn.conv_kernel,
        linear_key_head_dim=gdn.key_head_dim,
        linear_value_head_dim=gdn.value_head_dim,
        linear_num_key_heads=gdn.num_key_heads,
        linear_num_value_heads=gdn.num_value_heads,
        attention_output_gate=arch.attention_output_gate,
        moe_shared_expert_gate=arch.shared_expert_gate,
    )
