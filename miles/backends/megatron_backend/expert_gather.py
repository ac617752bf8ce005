"""The expert-parallel all-gather of the weight handoff: one MoE layer's experts of every rank, on the device.

With expert parallelism each rank holds ``E / ep_size`` experts of every MoE layer. The handoff iterates
the HF-layout weights layer by layer (``convert.iter_megatron_to_hf``); at each MoE layer every rank calls
:func:`gather_layer_experts`, so the scratch is one layer's experts and nothing passes through host memory.
It runs over any process group (NCCL in the trainer; gloo in the CPU tests, and for two ranks on one GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .convert import join_experts


def gather_layer_experts(local: dict[str, torch.Tensor], *, hf_config: Any, ep_size: int,
                         group=None) -> dict[str, torch.Tensor]:
    """``local``: this rank's expert tensors of one layer (``...mlp.experts...``, the same keys and shapes on every
    rank). Returns every rank's, globally numbered (``convert.join_experts``). A collective of ``group``."""
    full: dict[str, torch.Tensor] = {}
    for key in sorted(local):  # the same order on every rank
        parts = [torch.empty_like(local[key]) for _ in range(ep_size)]
        dist.all_gather(parts, local[key].contiguous(), group=group)
        full.update(join_experts([{key: part} for part in parts], hf_config))
    return full
