"""The aux-loss-free load balancing of MoE routers with an expert bias (DeepSeek-V3, GLM-5), for a trainer
that steps outside megatron's ``finalize_model_grads`` (GPU only: megatron-core).

Each router counts the tokens it sends to each expert during forwards with grad enabled; after an applied
optimizer step the bias moves by ``config.moe_router_bias_update_rate`` towards balance
(``megatron.core.transformer.moe.moe_utils.get_updated_expert_bias``: the counts are summed over the
data-parallel ranks first, so every rank applies the same update). The counts are cleared at the start of
each step, so a skipped step leaves the bias exactly as it was. The bias is an fp32 buffer, not a
parameter: no optimizer state, and the HF export carries it as ``e_score_correction_bias``.
:func:`routers_to_fp32` (before loading) and :func:`keep_routers_fp32` (around the bf16 cast) keep these
routers' weight, bias and counts fp32 in a bf16 model.
"""

from __future__ import annotations

from typing import Callable

import torch


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]


def clear_router_token_counts(model: torch.nn.Module) -> None:
    for router in _routers(model):
        router.local_tokens_per_expert.zero_()


@torch.no_grad()
def step_router_expert_bias(model: torch.nn.Module, update_rate: float) -> int:
    """Apply one balancing step to every router's expert bias from the counts since the last clear;
    a collective over the data-parallel group. Returns the number of routers updated."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    routers = _routers(model)
    if not routers:
        return 0
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    biases = torch.stack([r.expert_bias for r in routers])
    for router, bias in zip(routers, get_updated_expert_bias(counts, biases, update_rate)):
        router.expert_bias.copy_(bias)
    clear_router_token_counts(model)
    return len(routers)



def routers_to_fp32(model: torch.nn.Module) -> None:
    """Cast the routers that have an expert bias (weight, bias, token counts) to fp32 in place: before the
    weights are loaded, so that fp32 checkpoint values (transformers keeps GLM-5's router fp32, the
    trainer's checkpoints hold its fp32 router) land unrounded."""
    for router in _routers(model):
        router.weight.data = router.weight.data.float()
        router.expert_bias = router.expert_bias.float()  # assigning a registered buffer replaces it
        router.local_tokens_per_expert = router.local_tokens_per_expert.float()


def keep_routers_fp32(model: torch.nn.Module, cast: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``cast()`` (megatron's ``Float16Module``, which casts every param and buffer to bf16), with the routers
    that have an expert bias kept in fp32 as transformers keeps GLM-5's: the router weight (then a native-fp32
    param: the optimizer keeps no separate master, the store binds it under its resident Adam), the bias
    (a bf16 bias would lose a checkpoint's values) and the token counts (bf16 counts are exact only to 256).
    Call before DDP, which sizes its buffers by each param's dtype."""
    saved = [(r, r.weight.detach().float().clone(), r.expert_bias.detach().float().clone(),
              r.local_tokens_per_expert.detach().float().clone()) for r in _routers(model)]
    wrapped = cast()
    for router, weight, bias, counts in saved:
        router.weight.data = weight
        router.expert_bias = bias
        router.local_tokens_per_expert = counts
    return wrapped
