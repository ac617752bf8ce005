"""Micro-batch plans (miles.rl.batching): every sample in exactly one micro-batch, the token budget held
(unless one sample alone exceeds it), longest first, deterministic, and the forced count ranks agree on."""

from __future__ import annotations

import logging
import random

import pytest

from miles.config import parse_args
from miles.config.arguments import TrainingConfig
from miles.rl.batching import (fixed_micro_batches, padded_tokens, plan_micro_batches, sample_lengths,
                               token_budget_micro_batches)


def _flat(plan):
    return sorted(i for batch in plan for i in batch)


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_once_and_the_budget_held(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 64))]
    budget = rng.choice([64, 256, 1000, 4096])
    plan = token_budget_micro_batches(lengths, budget)
    assert _flat(plan) == list(range(len(lengths)))
    for batch in plan:
        assert batch, "an empty micro-batch"
        assert padded_tokens(lengths, batch) <= budget or len(batch) == 1
    # longest first: the rows of the plan, read in order, never grow
    rows = [lengths[i] for batch in plan for i in batch]
    assert rows == sorted(rows, reverse=True)
    assert token_budget_micro_batches(list(lengths), budget) == plan  # a pure function of the lengths


def test_greedy_fill_by_hand():
    # sorted: 100 (idx 2), 60 (0), 60 (3), 30 (1), 10 (4); budget 200
    plan = token_budget_micro_batches([60, 30, 100, 60, 10], 200)
    assert plan == [[2, 0], [3, 1, 4]]  # 2 x 100 = 200 fits; 3 x 60 = 180; ties keep the samples' order
    assert [padded_tokens([60, 30, 100, 60, 10], b) for b in plan] == [200, 180]


def test_a_sample_over_the_budget_goes_alone_and_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="miles.rl.batching"):
        plan = token_budget_micro_batches([5, 50, 5, 5], 16)
    assert plan == [[1], [0, 2, 3]]
    assert "1 sample(s) longer than --max-tokens-per-gpu 16 (longest 50 tokens)" in caplog.text


def test_min_batches_splits_the_fullest():
    lengths = [10] * 8
    assert token_budget_micro_batches(lengths, 1000) == [list(range(8))]
    plan = token_budget_micro_batches(lengths, 1000, min_batches=3)
    assert len(plan) == 3 and _flat(plan) == list(range(8))
    assert plan == [[0, 1], [2, 3], [4, 5, 6, 7]]  # the first of the equally full halves is cut again
    assert len(token_budget_micro_batches(lengths, 1000, min_batches=8)) == 8
    with pytest.raises(ValueError, match="min_batches"):
        token_budget_micro_batches(lengths, 1000, min_batches=9)
    assert token_budget_micro_batches([], 10) == []


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_budget_micro_batches([1], 0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        fixed_micro_batches(3, 0)


def test_fixed_micro_batches_keep_the_order():
    assert fixed_micro_batches(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert fixed_micro_batches(0, 4) == []


def test_the_plan_follows_the_flags():
    class S:
        def __init__(self, p, r):
            self.prompt_ids, self.response_ids = [1] * p, [2] * r

    lengths = sample_lengths([S(3, 5), S(2, 1), S(4, 20)])
    assert lengths == [8, 3, 24]
    assert plan_micro_batches(lengths, TrainingConfig(micro_batch_size=2)) == [[0, 1], [2]]
    dynamic = TrainingConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=24)
    assert plan_micro_batches(lengths, dynamic) == [[2], [0, 1]]
    assert plan_micro_batches(lengths, dynamic, min_batches=3) == [[2], [0], [1]]
    args = parse_args(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"])
    assert (args.use_dynamic_batch_size, args.max_tokens_per_gpu) == (True, 24)
