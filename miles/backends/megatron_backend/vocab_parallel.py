"""Log-probabilities of target tokens from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism the output layer is vocab-parallel: TP rank r holds the logits of vocabulary ids
``[r * V_local, (r + 1) * V_local)`` of the padded vocabulary. The log-softmax of the target needs three
all-reduces over the TP group, each of one value per token:

1. the max of the logits (for a stable exponent), MAX over the ranks;
2. the sum of ``exp(logit - max)``, SUM over the ranks;
3. the target's logit: only the rank whose slice holds the target contributes it, SUM over the ranks.

``log p(target) = logit(target) - max - log(sum)``. Ids at or beyond the true vocabulary (Megatron's
padding to 128 x TP) are masked to -inf: the HF model and the rollout engine have no such tokens.

The backward pass needs no communication: ``d log p / d logits_local = onehot_local - softmax_local``, with
``softmax_local = exp(logit - max) / sum`` from the forward's reduced values (the scheme Megatron's
vocab-parallel cross entropy uses). Works over any torch.distributed group, so gloo on CPU tests it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs"]


def _masked(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """fp32 logits with the padding ids (global id >= vocab_size) at -inf."""
    logits = logits.float()
    first_padding = max(0, vocab_size - vocab_start)  # local index; a slice can be padding through and through
    if first_padding < logits.shape[-1]:
        logits = logits.clone()
        logits[..., first_padding:] = float("-inf")
    return logits


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):  # noqa: D102 - autograd's contract
        local = _masked(logits, vocab_start, vocab_size)
        peak = local.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = local - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        in_slice = (targets >= vocab_start) & (targets < vocab_start + local.shape[-1])
        index = (targets - vocab_start).clamp(0, local.shape[-1] - 1)
        target_shifted = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        target_shifted = torch.where(in_slice, target_shifted, torch.zeros_like(target_shifted))
        dist.all_reduce(target_shifted, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(exp, total, index, in_slice)
        ctx.logits_dtype = logits.dtype
        return target_shifted - total.log()

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        exp, total, index, in_slice = ctx.saved_tensors
        grad_logits = -(exp / total.unsqueeze(-1)) * grad.unsqueeze(-1)
        onehot = torch.zeros_like(grad_logits).scatter_(-1, index.unsqueeze(-1), in_slice.unsqueeze(-1).float())
        grad_logits = grad_logits + onehot * grad.unsqueeze(-1)
        return grad_logits.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
                            group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``log_softmax(full_logits)[target]`` (fp32, shape of ``targets``) from this rank's vocabulary slice
    ``logits[..., V_local]`` starting at global id ``vocab_start``; ``vocab_size``: the true vocabulary (ids
    beyond it are padding). Every rank of ``group`` calls it with the same ``targets``. Differentiable."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} differ before the "
                         "vocabulary dimension")
    return _VocabParallelLogProbs.apply(logits, targets, vocab_start, vocab_size, group)
