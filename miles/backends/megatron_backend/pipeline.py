"""The policy-gradient step through Megatron's pipeline schedule (PP > 1).

Every stage of a data-parallel replica holds the replica's samples (``miles.parallel.layout.rank_slices``) and
collates the same micro-batches (the step's plan, :mod:`miles.rl.batching`): the first stage feeds the token ids to the embedding, every stage the
position ids to its rotary embeddings, the last stage computes the log-probs (vocab-parallel under TP) and
the loss. ``get_forward_backward_func`` runs the 1F1B schedule between the stages; the model is built with
``variable_seq_lengths`` (model.py), so micro-batches keep their own lengths and sizes.

Megatron divides each micro-batch's loss by the number of micro-batches; ``policy_gradient_loss`` already
divides by the step's token count (the token mean over the whole rollout), so the loss handed back is
multiplied by that number first. The loss sums of the step's metrics live on the last stage and are summed
over the pipeline group, so every rank reports its replica's sums as at PP 1.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist

from miles.rl.loss import micro_batch_inputs, policy_gradient_loss, token_logprobs

from .model_parallel import ModelParallelRank, pad_sequence

__all__ = ["pipeline_policy_gradient"]


def pipeline_policy_gradient(ddp, parallel: ModelParallelRank, samples: Sequence[Any], advantages: Sequence[float],
                             *, sequence_parallel: bool, pad_id: int, micro_batches: Sequence[Sequence[int]],
                             device: Any, eps_clip: float, temperature: float, num_tokens: float) -> list[float]:
    """:func:`~miles.rl.loss.accumulate_policy_gradient` through the pipeline schedule (module doc): grads
    accumulate in ``ddp``; returns the sums ``[loss, clipped tokens, |train - rollout log-prob|]``. Under
    sequence parallelism each micro-batch runs right-padded to a multiple of TP (model_parallel.pad_sequence)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = [batch for _, batch in micro_batch_inputs(samples, advantages, micro_batches, pad_id=pad_id,
                                                        device=device)]
    sums = torch.zeros(3, dtype=torch.float64, device=device)

    def loss_of(batch: dict[str, torch.Tensor], logits: torch.Tensor):
        ids = batch["input_ids"]
        logits = logits[:, :ids.shape[1]]  # without the sequence-parallel padding
        if parallel.layout.tp > 1:
            logp = parallel.logprobs(logits[:, :-1], ids[:, 1:], temperature)
        else:
            logp = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)
        loss, m = policy_gradient_loss(logp, batch["rollout_logprobs"], batch["advantages"], batch["loss_mask"],
                                       eps_clip=eps_clip, num_tokens=num_tokens)
        with torch.no_grad():
            mask = batch["loss_mask"]
            sums.add_(torch.stack([loss.detach().double(), m["clipfrac"].double() * mask.sum().double(),
                                   ((logp.detach() - batch["rollout_logprobs"]).abs() * mask).sum().double()]))
        return loss * len(batches), {}

    def model_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        if sequence_parallel:
            return pad_sequence(batch["input_ids"], position_ids, parallel.layout.tp)
        return batch["input_ids"], position_ids

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(*model_inputs(batch), None), functools.partial(loss_of, batch)

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                                num_microbatches=len(batches),
                                seq_length=max(model_inputs(b)[0].shape[1] for b in batches),
                                micro_batch_size=max(b["input_ids"].shape[0] for b in batches), forward_only=False)
    dist.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
    return [float(v) for v in sums.cpu()]
