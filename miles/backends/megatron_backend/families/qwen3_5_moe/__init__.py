"""Qwen3.5-MoE (transformers ``qwen3_5_moe`` and its language model ``qwen3_5_moe_text``) in the Megatron backend.

What transformers' ``modeling_qwen3_5_moe.py`` computes, and the megatron-core piece built for it
(``config.py`` reads the config, ``weights.py`` holds the weight layouts, ``layers.py`` builds the layer spec
(megatron-core imported inside); the Gated DeltaNet is the shared piece ``pieces/gated_deltanet.py``):

- Token mixer per layer, by ``layer_types``: "linear_attention" is a Gated DeltaNet (megatron-core's
  ``GatedDeltaNet``), "full_attention" (every ``full_attention_interval``-th layer by default) is gated
  softmax attention. Megatron's ``linear_attention_freq`` takes the same pattern as a list.
- Gated DeltaNet: HF's input projections ``in_proj_qkv`` (q, k, v rows), ``in_proj_z`` (output gate),
  ``in_proj_b`` (beta) and ``in_proj_a`` (alpha), concatenated in that row order, are Megatron's one
  ``in_proj``; the depthwise ``conv1d`` (over q, k, v), ``dt_bias``, ``A_log`` and ``out_proj`` map one to
  one. HF's gated output norm ``norm`` (its weight used as is) is ``out_norm``. ``A_log`` is trained in
  fp32 (``NATIVE_FP32_PARAMS``): HF itself computes the decay from ``A_log.float()``.
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

from typing import Any, Optional

from miles.sizing.tensors import Tensor

from ...architecture import Architecture
from ...model_tensors import gqa_attention_tensors
from ...pieces.gated_deltanet import (NATIVE_FP32_PARAMS, gated_deltanet_config_kwargs, gated_deltanet_layer_tensors,
                                     gated_deltanet_layout_sizes)
from ..family import Family, gpt_transformer_config
from . import config, layers, weights

__all__ = ["QWEN3_5_MOE"]


def _config_kwargs(arch: Architecture) -> dict[str, Any]:
    """The Gated DeltaNet's fields, the gated attention and the gated shared expert (model.py has the rest)."""
    return dict(gated_deltanet_config_kwargs(arch.linear_attention), attention_output_gate=arch.attention_output_gate,
                moe_shared_expert_gate=arch.shared_expert_gate)


def _transformer_config(kwargs: dict[str, Any]) -> Any:
    return gpt_transformer_config({**kwargs, **layers.gated_delta_rule_kwargs()})  # its kernels win


def _attention_tensors(arch: Architecture, layer: Optional[int], prefix: str) -> list[Tensor]:
    """A Gated DeltaNet on the layers ``layer_types`` marks linear, gated attention on the others (and in MTP)."""
    gdn = arch.linear_attention
    if layer is not None and gdn.linear_layers[layer]:
        return gated_deltanet_layer_tensors(gdn, arch.hidden_size, prefix)
    return gqa_attention_tensors(arch, layer, prefix)


QWEN3_5_MOE = Family(name="qwen3_5_moe", model_types=config.MODEL_TYPES, describe=config.describe,
                     config_kwargs=_config_kwargs, block_spec=layers.block_spec, layer_rules=weights.layer_rules,
                     attention_tensors=_attention_tensors, tiny_preset="qwen3.5-moe-tiny",
                     transformer_config=_transformer_config, native_fp32_params=NATIVE_FP32_PARAMS,
                     layout_sizes=gated_deltanet_layout_sizes)
