"""GRPO advantages (pure functions).

Rewards are laid out group-contiguous: the ``group_size`` samples of prompt ``i`` are at indices
``[i * group_size, (i + 1) * group_size)`` (the order ``EmbeddedRolloutEngine.generate`` returns with
``SamplingParams(n=group_size)``).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["grpo_advantages", "token_level_advantages"]


def grpo_advantages(
    rewards: Sequence[float] | torch.Tensor, group_size: int, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """Group-normalized rewards: ``(r - mean_group) / (std_group + eps)`` (fp32, shape ``[N]``).

    ``std`` is the unbiased sample std (as TRL/verl); a group with equal rewards gets advantage 0.
    With ``normalize_std=False`` only the group mean is subtracted (Dr. GRPO).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    centered = g - g.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (g.std(dim=1, keepdim=True, unbiased=True) + eps)
    return centered.reshape(-1)


def token_level_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence (``[B]``) over its tokens: ``[B, T]``, zero where masked."""
    return advantages.to(torch.float32).view(-1, 1) * loss_mask.to(torch.float32)
