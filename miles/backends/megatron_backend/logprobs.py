"""Token log-probs out of megatron-core's GPTModel without its ``[B, L, V]`` fp32 logits.

GPTModel's forward takes an ``output_processor``: called with the final hidden states ``[S, B, H]``
and the output layer in place of the logits computation, its return value is what the model returns
(Float16Module leaves an fp32 result as it is). :func:`output_logprobs` is that processor: it runs the
output layer chunk by chunk over the tokens (:func:`miles.rl.loss.chunked_token_logprobs`), so one
chunk's logits exist at a time, in the forward and in the backward pass. The context is a
:class:`LogprobRequest`::

    logp = ddp(input_ids, position_ids, None, output_processor=output_logprobs,
               output_processor_context=LogprobRequest(input_ids[:, 1:], temperature))   # [B, L-1]

The output layer is called with ``runtime_gather_output=True``, so under tensor parallelism each chunk's
logits are gathered over the vocabulary shards. Under sequence parallelism the hidden states hold a shard
of the sequence, which the output layer gathers: then the logits come whole, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.rl.loss import LOGPROB_CHUNK_TOKENS, chunked_token_logprobs, token_logprobs

__all__ = ["LogprobRequest", "output_logprobs"]


@dataclass(frozen=True)
class LogprobRequest:
    """What :func:`output_logprobs` computes: log-probs of ``targets`` (``[B, L-1]``, the input ids
    shifted by one) at ``temperature``, ``chunk_tokens`` tokens' logits at a time."""

    targets: torch.Tensor
    temperature: float
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS


def output_logprobs(*, hidden_states: torch.Tensor, output_layer, output_weight, scale_logits,
                    context: LogprobRequest, **_: Any) -> torch.Tensor:
    """GPTModel's output processor: ``[B, L-1]`` log-probs of ``context.targets`` from the final hidden
    states ``[L, B, H]`` (the other keyword arguments GPTModel passes are not needed)."""

    def logits_of(hidden: torch.Tensor) -> torch.Tensor:  # [..., B', H] -> [..., B', V]
        logits, _ = output_layer(hidden, weight=output_weight, runtime_gather_output=True)
        return scale_logits(logits)

    targets = context.targets
    if output_layer.sequence_parallel:
        return token_logprobs(logits_of(hidden_states)[:-1].transpose(0, 1), targets, context.temperature)
    hidden = hidden_states[:-1]  # position t predicts target t
    length, rows = hidden.shape[:2]
    # token-major [(L-1) * B, H]; the output layer sees each chunk as a [n, 1, H] sequence
    logp = chunked_token_logprobs(hidden.reshape(length * rows, 1, -1), targets.t().reshape(-1, 1), logits_of,
                                  context.temperature, context.chunk_tokens)
    return logp.view(length, rows).t()
