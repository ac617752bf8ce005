"""Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral: the GPT layer megatron-core builds itself (grouped-query attention,
SwiGLU MLP or softmax-routed experts). Mixtral differs only in how transformers 4.x names its experts."""

from __future__ import annotations

from typing import Any

from ...architecture import Architecture
from ...model_tensors import gqa_attention_tensors
from ...weight_rules import Rule, gqa_attention_rules, mlp_rules
from ..family import Family, PerExpertNames
from . import config, layers

__all__ = ["GPT", "MIXTRAL"]


def _layer_rules(arch: Architecture, layer: int, fused_norms: bool) -> list[Rule]:
    return gqa_attention_rules(arch, layer, fused_norms) + mlp_rules(arch, layer, fused_norms)


def _no_config_kwargs(arch: Architecture) -> dict[str, Any]:
    return {}


GPT = Family(name="gpt", model_types=("llama", "qwen2", "qwen3", "qwen3_moe"), describe=config.describe,
             config_kwargs=_no_config_kwargs, block_spec=layers.block_spec, layer_rules=_layer_rules,
             attention_tensors=gqa_attention_tensors, tiny_preset="llama-tiny")
MIXTRAL = Family(name="mixtral", model_types=("mixtral",), describe=config.describe, config_kwargs=_no_config_kwargs,
                 block_spec=layers.block_spec, layer_rules=_layer_rules, attention_tensors=gqa_attention_tensors,
                 tiny_preset="mixtral-tiny",
                 hf_per_expert_names=PerExpertNames("block_sparse_moe",
                                                    {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}))
