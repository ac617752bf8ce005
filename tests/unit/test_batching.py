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


# ------------------------------------------------------------- the loss does not depend on the plan


def _tiny_fp64_llama(seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float64)


def _rollout(seed=0, n=10):
    import types

    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        p, r = rng.randint(1, 9), rng.randint(1, 17)
        samples.append(types.SimpleNamespace(prompt_ids=[rng.randint(1, 60) for _ in range(p)],
                                             response_ids=[rng.randint(1, 60) for _ in range(r)],
                                             response_logprobs=[-rng.uniform(0.5, 5.0) for _ in range(r)]))
    return samples, [rng.gauss(0.0, 1.0) for _ in range(n)]


def _grads_of(model, samples, advantages, plan):
    """The loss the train rank hands its engine, over the plan's micro-batches as an engine runs them."""
    from miles.backends.step import PolicyLoss
    from miles.rl.loss import forward_logprobs, micro_batch_inputs

    model.zero_grad(set_to_none=True)
    loss = PolicyLoss(eps_clip=0.2, temperature=0.7, num_tokens=sum(len(s.response_ids) for s in samples),
                      advantage_estimator="grpo", tis=None)
    stats = loss.no_stats("cpu")
    for _, batch in micro_batch_inputs(samples, advantages, plan, pad_id=0, device="cpu"):
        value, batch_stats = loss(forward_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.7), batch)
        value.backward()
        stats = loss.combine(stats, batch_stats)
    return stats.tolist()[:3], {n: p.grad.clone() for n, p in model.named_parameters()}  # loss, clipped, |diff|


def test_token_budget_plan_gives_the_fixed_plans_loss_and_grads_in_fp64():
    import torch

    model = _tiny_fp64_llama()
    samples, advantages = _rollout()
    lengths = sample_lengths(samples)
    fixed = fixed_micro_batches(len(samples), 4)
    budget = token_budget_micro_batches(lengths, 40)
    assert budget != fixed and len(budget) > 1  # a different grouping and order
    sums_fixed, grads_fixed = _grads_of(model, samples, advantages, fixed)
    sums_budget, grads_budget = _grads_of(model, samples, advantages, budget)
    (loss_f, clipped_f, diff_f), (loss_b, clipped_b, diff_b) = sums_fixed, sums_budget
    assert loss_f != 0.0 and loss_b == pytest.approx(loss_f, rel=1e-12, abs=1e-14)
    assert diff_b == pytest.approx(diff_f, rel=1e-12)
    assert clipped_b == pytest.approx(clipped_f, rel=1e-6)  # a count, through the metric's fp32 clip fraction
    for name, g in grads_fixed.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads_budget[name], g, rtol=1e-12, atol=1e-14)


def test_log_probs_land_back_on_their_samples():
    import torch

    from miles.rl.loss import forward_logprobs, micro_batch_inputs

    model = _tiny_fp64_llama(seed=1)
    samples, advantages = _rollout(seed=3, n=9)
    plan = token_budget_micro_batches(sample_lengths(samples), 48)
    per_sample = {}
    with torch.no_grad():
        for indices, batch in micro_batch_inputs(samples, advantages, plan, pad_id=0, device="cpu"):
            logp = forward_logprobs(model, batch["input_ids"], batch["attention_mask"])
            for row, i in enumerate(indices):
                on_response = batch["loss_mask"][row].bool()
                per_sample[i] = logp[row][on_response]
                assert torch.equal(batch["advantages"][row][on_response],
                                   torch.full((len(samples[i].response_ids),), advantages[i], dtype=torch.float32))
        for i, s in enumerate(samples):  # each sample alone, unpadded
            alone = next(micro_batch_inputs(samples, advantages, [[i]], pad_id=0, device="cpu"))[1]
            expected = forward_logprobs(model, alone["input_ids"], alone["attention_mask"])[0, len(s.prompt_ids) - 1:]
            assert per_sample[i].shape == (len(s.response_ids),)
            torch.testing.assert_close(per_sample[i], expected, rtol=1e-12, atol=1e-12)
