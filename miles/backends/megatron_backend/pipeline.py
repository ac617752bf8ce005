"""The policy-gradient step through Megatron's pipeline schedule (PP > 1).

Every stage of a data-parallel replica holds the replica's samples (``miles.parallel.layout.rank_slices``) and
collates the same micro-batches (the step's plan, :mod:`miles.rl.batching`): the first stage feeds the token ids to the embedding, every stage the
position ids to its rotary embeddings, the last stage computes the log-probs (vocab-parallel under TP) and
the loss. ``get_forward_backward_func`` runs the 1F1B schedule between the stages; the model is built with
``variable_seq_lengths`` (model.py), so micro-batches keep their own lengths and sizes.

Megatron divides each micro-batch's loss by the number of micro-batches; the loss the rank hands in already
divides by the step's token count (the token mean over the whole rollout), so the loss handed back is
multiplied by that number first. The loss's statistics for the step's metrics live on the last stage (the
others keep :meth:`~miles.backends.step.PolicyLoss.no_stats`' zeros) and are summed over the pipeline group,
which hands every stage the last stage's values, its maxima included: every rank reports its replica's
statistics as at PP 1.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from miles.backends.engine import rows_routes
from miles.backends.step import route_counts
from miles.rl.loss import micro_batch_inputs, token_logprobs

from .model_parallel import ModelParallelRank, pad_sequence

__all__ = ["pipeline_policy_gradient"]


def pipeline_policy_gradient(ddp, parallel: ModelParallelRank, samples: Sequence[Any], advantages: Sequence[float],
                             micro_batches: Sequence[Sequence[int]], loss, *, sequence_parallel: bool, pad_id: int,
                             device: Any, route_replay: Optional[Callable] = None) -> list[float]:
    """The engine's forward_backward through the pipeline schedule (module doc), with the ``loss`` the rank
    hands in (:class:`miles.backends.step.PolicyLoss`): grads accumulate in ``ddp``; returns the loss's
    statistics over the micro-batches (``loss.combine``). Under
    sequence parallelism each micro-batch runs right-padded to a multiple of TP (model_parallel.pad_sequence).
    ``route_replay`` (R3, the engine's): each micro-batch's forward on this stage runs inside it, and the stage adds
    its MoE layers' route counts to the statistics (summed over the stages with the rest)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = list(micro_batch_inputs(samples, advantages, micro_batches, pad_id=pad_id, device=device))
    stats = loss.no_stats(device)

    def loss_of(batch: dict[str, torch.Tensor], logits: torch.Tensor):
        nonlocal stats
        ids = batch["input_ids"]
        logits = logits[:, :ids.shape[1]]  # without the sequence-parallel padding
        if parallel.layout.tp > 1:
            logp = parallel.logprobs(logits[:, :-1], ids[:, 1:], loss.temperature)
        else:
            logp = token_logprobs(logits[:, :-1], ids[:, 1:], loss.temperature)
        value, batch_stats = loss(logp, batch)
        stats = loss.combine(stats, batch_stats)
        return value * len(batches), {}

    def model_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        if sequence_parallel:
            return pad_sequence(batch["input_ids"], position_ids, parallel.layout.tp)
        return batch["input_ids"], position_ids

    def forward_step(data_iterator, model):
        nonlocal stats
        indices, batch = next(data_iterator)
        replay = (route_replay(rows_routes(samples, indices), batch) if route_replay is not None
                  else contextlib.nullcontext())
        with replay as replaying:  # the backward re-runs no router: the forward alone replays
            output = model(*model_inputs(batch), None)
            if replaying is not None:
                stats = loss.combine(stats, loss.route_stats(route_counts(*replaying.mismatch_counts())))
        return output, functools.partial(loss_of, batch)

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                                num_microbatches=len(batches),
                                seq_length=max(model_inputs(b)[0].shape[1] for _, b in batches),
                                micro_batch_size=max(b["input_ids"].shape[0] for _, b in batches), forward_only=False)
    dist.all_reduce(stats, group=parallel_state.get_pipeline_model_parallel_group())
    return [float(v) for v in stats.cpu()]
