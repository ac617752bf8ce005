"""The group-limited sigmoid router of DeepSeek-V3 and GLM-5, and their shared experts: the ``Architecture``
fields a transformers config gives them (pure).

transformers (``DeepseekV3TopkRouter`` / ``GlmMoeDsaTopkRouter`` and their MoE blocks): sigmoid scores of fp32
logits; top-k chosen on ``scores + e_score_correction_bias`` (an fp32 buffer) after keeping the ``topk_group``
best of ``n_group`` expert groups, each ranked by the sum of its top-2 biased scores; the weights are the
unbiased scores, renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``. The shared experts are one
SwiGLU of ``moe_intermediate_size * n_shared_experts`` added to the routed output.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError

__all__ = ["sigmoid_router_fields"]


def sigmoid_router_fields(hf_config: Any) -> dict[str, Any]:
    """``Architecture`` keyword arguments of the router, the routed and the shared experts (raises on what
    megatron-core's router cannot reproduce)."""
    if not hf_config.norm_topk_prob:
        raise UnsupportedModelError("norm_topk_prob=False: megatron-core's sigmoid router always renormalizes "
                                    "the top-k weights; use a config with norm_topk_prob=True")
    groups, topk_group, topk = int(hf_config.n_group), int(hf_config.topk_group), hf_config.num_experts_per_tok
    if groups > 1 and topk != 2 * topk_group:
        raise UnsupportedModelError(f"n_group={groups}, topk_group={topk_group}, num_experts_per_tok={topk}: "
                                    "transformers ranks expert groups by their top-2 scores, megatron-core by their "
                                    "top-(k/topk_group); they agree only when num_experts_per_tok == 2 * topk_group")
    shared = hf_config.moe_intermediate_size * int(hf_config.n_shared_experts or 0)
    return dict(num_experts=hf_config.n_routed_experts, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
                moe_topk=topk, moe_renormalize=True, shared_expert_ffn_hidden_size=shared or None,
                router_expert_bias=True, router_score_function="sigmoid",
                router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
                router_num_groups=groups if groups > 1 else None, router_group_topk=topk_group if groups > 1 else None)
