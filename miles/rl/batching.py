"""Micro-batch plans: which of a rank's samples go through one forward/backward together.

A plan is a list of micro-batches, each a list of indices into the rank's samples; every sample is in
exactly one. Two kinds:

- :func:`fixed_micro_batches`: ``--micro-batch-size`` samples at a time, in the rollout's order.
- :func:`token_budget_micro_batches` (``--use-dynamic-batch-size --max-tokens-per-gpu N``, miles/slime's
  meaning): samples sorted by length, longest first, and cut into runs whose padded size (rows x the
  longest row, what :func:`miles.rl.loss.collate_samples` allocates) stays within ``N`` tokens. Sorting
  keeps rows of like length together, so little of a micro-batch is padding. A sample longer than ``N``
  on its own is trained alone (logged): it cannot be cut without changing what the model sees.

The loss does not depend on the plan: each micro-batch's loss is its token sum divided by the token
count of the whole rollout (``miles.backends.step.PolicyLoss``), so a plan changes only the
order of floating-point sums. Plans are pure functions of the lengths: the same samples give the same
plan on every run.

``min_batches``: ranks whose forward passes are collectives (expert parallelism's all-to-all) must run
the same number of micro-batches; the train step plans, agrees on the largest count, and re-plans with
it (:func:`plan_micro_batches`), splitting the fullest micro-batches until there are that many.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from miles.config.arguments import TrainingConfig

__all__ = ["sample_lengths", "padded_tokens", "fixed_micro_batches", "token_budget_micro_batches",
           "plan_micro_batches"]

logger = logging.getLogger(__name__)


def sample_lengths(samples: Sequence[Any]) -> list[int]:
    """Tokens of each sample's row: prompt plus response."""
    return [len(s.prompt_ids) + len(s.response_ids) for s in samples]


def padded_tokens(lengths: Sequence[int], batch: Sequence[int]) -> int:
    """Tokens a right-padded micro-batch of ``batch`` occupies: rows x the longest row."""
    return len(batch) * max((lengths[i] for i in batch), default=0)


def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """``micro_batch_size`` samples at a time, in order (the last micro-batch holds the rest)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 (got {micro_batch_size})")
    return [list(range(start, min(num_samples, start + micro_batch_size)))
            for start in range(0, num_samples, micro_batch_size)]


def token_budget_micro_batches(lengths: Sequence[int], max_tokens: int, min_batches: int = 1) -> list[list[int]]:
    """Micro-batches of the samples of ``lengths`` whose padded tokens stay within ``max_tokens`` (a
    sample longer than that goes alone), longest samples first, at least ``min_batches`` of them (at
    most one per sample). Deterministic: ties in length keep the samples' order."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    if not 0 <= min_batches <= len(lengths) and not (min_batches == 1 and not lengths):
        raise ValueError(f"min_batches must be in [0, {len(lengths)}] for {len(lengths)} samples (got {min_batches}): "
                         "a micro-batch holds at least one sample")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # sorted longest first: a batch's first sample is its longest, so its padded size is rows x that
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    over = [lengths[b[0]] for b in batches if lengths[b[0]] > max_tokens]
    if over:
        logger.warning("%d sample(s) longer than --max-tokens-per-gpu %d (longest %d tokens) train alone in "
                       "their own micro-batch", len(over), max_tokens, max(over))
    while len(batches) < min(min_batches, len(lengths)):
        _split_fullest(batches, lengths)
    return batches


def _split_fullest(batches: list[list[int]], lengths: Sequence[int]) -> None:
    """Cut the micro-batch with the most padded tokens (of those with two or more samples) in two, in place."""
    splittable = [k for k, b in enumerate(batches) if len(b) > 1]
    k = max(splittable, key=lambda k: (padded_tokens(lengths, batches[k]), -k))
    batch = batches[k]
    half = (len(batch) + 1) // 2
    batches[k:k + 1] = [batch[:half], batch[half:]]


def plan_micro_batches(lengths: Sequence[int], training: TrainingConfig, min_batches: int = 1) -> list[list[int]]:
    """The micro-batches the run's flags ask for: by token budget under ``--use-dynamic-batch-size``
    (at least ``min_batches`` of them), else ``--micro-batch-size`` samples each."""
    if training.use_dynamic_batch_size:
        return token_budget_micro_batches(lengths, training.max_tokens_per_gpu, min_batches)
    return fixed_micro_batches(len(lengths), training.micro_batch_size)
