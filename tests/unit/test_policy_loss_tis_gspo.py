"""--use-tis and --advantage-estimator gspo in the policy loss (miles.rl.loss), the train/rollout mismatch
statistics the step reduces over micro-batches and ranks (miles.backends.step), and what reaches the rollout
record and line (miles.metrics). References are computed by hand in float64, token by token."""

import math
import random
import socket
import types

import pytest
import torch

from miles.backends.step import LOSS_MAXIMA, LOSS_SUMS, PolicyLoss, reduce_over_ranks
from miles.config import ArgumentError
from miles.rl.batching import fixed_micro_batches, sample_lengths, token_budget_micro_batches
from miles.rl.loss import (TruncatedImportanceSampling, micro_batch_inputs, mismatch_stats, policy_gradient_loss,
                           token_logprobs)

# Three samples of 2, 4 and 3 response tokens at different offsets of a [3, 6] grid: (row, first target, length)
ROWS = ((0, 1, 2), (1, 0, 4), (2, 2, 3))
ADVANTAGES = (1.5, -0.75, 0.5)
# trainer - rollout log-prob of each response token: inside and outside the truncation [0.5, 2] (exp(-1) <
# 0.5, exp(0.9) > 2), and for GSPO one sample's mean beyond 1 + eps_clip
DIFFS = ((0.9, 0.7), (-1.0, 0.1, -0.2, 0.3), (0.05, -0.1, 0.02))


def _batch():
    """``(logp, rollout, advantages, mask)``: logp a float64 leaf, the rest float32 as collate_samples makes
    them (the rollout values exactly representable in fp32, so the references can read them back)."""
    mask = torch.zeros(3, 6, dtype=torch.float32)
    rollout = torch.zeros(3, 6, dtype=torch.float32)
    logp = torch.full((3, 6), -7.0, dtype=torch.float64)  # off the mask: must not count
    for (row, start, n), diffs in zip(ROWS, DIFFS):
        for j in range(n):
            rollout[row, start + j] = -0.5 - 0.25 * j - 0.125 * row
            logp[row, start + j] = float(rollout[row, start + j]) + diffs[j]
            mask[row, start + j] = 1.0
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float32)
    return logp.requires_grad_(), rollout, advantages, mask


def _tokens():
    """Each response token as ``(row, column, trainer log-prob, rollout log-prob, advantage)``."""
    logp, rollout, _, _ = _batch()
    logp = logp.detach()
    return [[(row, start + j, float(logp[row, start + j]), float(rollout[row, start + j]), ADVANTAGES[k])
             for j in range(n)] for k, (row, start, n) in enumerate(ROWS)]


NUM_TOKENS = sum(n for _, _, n in ROWS)


def _loss_and_grad(**kwargs):
    logp, rollout, advantages, mask = _batch()
    loss, metrics = policy_gradient_loss(logp, rollout, advantages, mask, num_tokens=NUM_TOKENS, **kwargs)
    loss.backward()
    return loss, logp.grad, metrics


def _assert_grad(grad, expected):
    want = torch.zeros(3, 6, dtype=torch.float64)
    for (row, col), value in expected.items():
        want[row, col] = value
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-15)


# ---- the loss against hand-computed float64 references ------------------------------------------------------


def test_tis_weights_each_tokens_loss_by_the_truncated_ratio_against_the_trainers_own_logprobs():
    """--use-tis: the PPO ratio is exp(logp - logp.detach()) = 1 (gradient that of logp), so each token's loss is
    -A * w, w = clamp(exp(trainer - rollout), 0.5, 2) detached: d loss / d logp = -A * w / N."""
    loss, grad, metrics = _loss_and_grad(eps_clip=0.2, tis=TruncatedImportanceSampling(low=0.5, high=2.0))
    total, weights, expected = 0.0, [], {}
    for sample in _tokens():
        for row, col, lp, ro, adv in sample:
            raw = math.exp(lp - ro)
            w = min(max(raw, 0.5), 2.0)
            weights.append((w, raw))
            total += -adv * w
            expected[row, col] = -adv * w / NUM_TOKENS
    assert loss.item() == pytest.approx(total / NUM_TOKENS, rel=1e-12)
    _assert_grad(grad, expected)
    assert metrics["tis_weight_mean"].item() == pytest.approx(sum(w for w, _ in weights) / NUM_TOKENS, rel=1e-6)
    assert any(raw < 0.5 for _, raw in weights) and any(raw > 2.0 for _, raw in weights)  # truncated both ways
    truncated = sum(w != raw for w, raw in weights)
    assert metrics["tis_clipfrac"].item() == pytest.approx(truncated / NUM_TOKENS)
    assert metrics["clipfrac"].item() == 0.0  # the ratio is 1: nothing to clip with one step per rollout


def test_gspo_clips_one_length_normalised_ratio_per_sample():
    """GSPO: s = exp(mean over the sample's tokens of (trainer - rollout)); each token's loss is
    -min(s A, clip(s, 1 -+ eps) A), so a sample's gradient is -A s / N on each of its tokens (the mean's 1/n
    times its n tokens), or none when its clipped branch is taken."""
    eps = 0.2
    loss, grad, metrics = _loss_and_grad(eps_clip=eps, advantage_estimator="gspo")
    total, expected, clipped_tokens = 0.0, {}, 0
    for sample in _tokens():
        s = math.exp(sum(lp - ro for _, _, lp, ro, _ in sample) / len(sample))
        adv = sample[0][4]
        unclipped, clipped = s * adv, min(max(s, 1 - eps), 1 + eps) * adv
        total += -min(unclipped, clipped) * len(sample)
        for row, col, *_ in sample:
            expected[row, col] = -adv * s / NUM_TOKENS if unclipped <= clipped else 0.0
        clipped_tokens += len(sample) if clipped < unclipped else 0
    assert loss.item() == pytest.approx(total / NUM_TOKENS, rel=1e-12)
    _assert_grad(grad, expected)
    assert clipped_tokens == 2 and metrics["clipfrac"].item() == pytest.approx(clipped_tokens / NUM_TOKENS)


def test_gspo_with_tis_spreads_each_samples_weighted_loss_over_its_tokens():
    """GSPO under --use-tis: s = 1 in value (old = the trainer's detached log-probs), each token's loss -A s w,
    and s's gradient is 1/n on each token: d loss / d logp_t = -A * (sum of the sample's w) / n / N."""
    tis = TruncatedImportanceSampling(low=0.5, high=2.0)
    loss, grad, _ = _loss_and_grad(eps_clip=0.2, advantage_estimator="gspo", tis=tis)
    total, expected = 0.0, {}
    for sample in _tokens():
        weights = [min(max(math.exp(lp - ro), 0.5), 2.0) for _, _, lp, ro, _ in sample]
        adv = sample[0][4]
        total += -adv * sum(weights)
        for row, col, *_ in sample:
            expected[row, col] = -adv * sum(weights) / len(sample) / NUM_TOKENS
    assert loss.item() == pytest.approx(total / NUM_TOKENS, rel=1e-12)
    _assert_grad(grad, expected)


def _head_policy_gradient_loss(logprobs, rollout_logprobs, advantages, loss_mask, eps_clip, num_tokens):
    """The GRPO loss as it was before --use-tis and GSPO (the formula the default must keep bit for bit)."""
    mask = loss_mask.to(torch.float32)
    adv = advantages.view(-1, 1).expand_as(mask).to(torch.float32)
    old = rollout_logprobs.to(torch.float32).detach()
    log_ratio = (logprobs.float() - old) * mask
    ratio = torch.exp(log_ratio)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip) * adv)
    return (per_token * mask).sum() / torch.clamp(torch.as_tensor(float(num_tokens)), min=1.0)


@pytest.mark.parametrize("eps_clip", [0.2, 0.0, float("inf")])
def test_grpo_without_the_flags_is_the_formula_it_was_bit_for_bit(eps_clip):
    g = torch.Generator().manual_seed(7)
    mask = (torch.rand(4, 9, generator=g) > 0.3).float()
    rollout = -torch.rand(4, 9, generator=g) * 3
    advantages = torch.randn(4, generator=g)
    start = (rollout + 0.3 * torch.randn(4, 9, generator=g)).clamp(max=0.0)
    new, old = start.clone().requires_grad_(), start.clone().requires_grad_()
    loss, _ = policy_gradient_loss(new, rollout, advantages, mask, eps_clip=eps_clip, num_tokens=31)
    expected = _head_policy_gradient_loss(old, rollout, advantages, mask, eps_clip, 31)
    loss.backward()
    expected.backward()
    assert torch.equal(loss, expected) and torch.equal(new.grad, old.grad) and new.grad.abs().sum() > 0


def test_an_unknown_estimator_is_refused():
    logp, rollout, advantages, mask = _batch()
    with pytest.raises(ValueError, match=r"advantage_estimator must be one of \('grpo', 'gspo'\) \(got 'ppo'\)"):
        policy_gradient_loss(logp, rollout, advantages, mask, advantage_estimator="ppo")


# ---- micro-batching ----------------------------------------------------------------------------------------


def _rollout_samples(seed=0, n=9):
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        p, r = rng.randint(1, 7), rng.randint(1, 13)
        samples.append(types.SimpleNamespace(prompt_ids=[rng.randint(1, 30) for _ in range(p)],
                                             response_ids=[rng.randint(1, 30) for _ in range(r)],
                                             response_logprobs=[-rng.uniform(1.0, 5.0) for _ in range(r)]))
    return samples, [rng.gauss(0.0, 1.0) for _ in range(n)]


def _step_over(plan, loss, samples, advantages, table):
    """The engine's forward_backward (miles.backends.engine) over ``plan`` with a bigram model, ``table``'s rows
    the logits after each token; returns the folded statistics and the table's grad."""
    table.grad = None
    stats = loss.no_stats("cpu")
    for _, batch in micro_batch_inputs(samples, advantages, plan, pad_id=0, device="cpu"):
        ids = batch["input_ids"]
        value, batch_stats = loss(token_logprobs(table[ids[:, :-1]], ids[:, 1:], loss.temperature), batch)
        value.backward()
        stats = loss.combine(stats, batch_stats)
    return stats, table.grad.clone()


@pytest.mark.parametrize("tis", [None, TruncatedImportanceSampling(low=0.5, high=2.0)], ids=["gspo", "gspo+tis"])
def test_the_micro_batch_plan_changes_no_gspo_loss_grad_or_statistic(tis):
    samples, advantages = _rollout_samples()
    table = torch.randn(31, 31, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    loss = PolicyLoss(eps_clip=0.05, temperature=0.8, num_tokens=sum(len(s.response_ids) for s in samples),
                      advantage_estimator="gspo", tis=tis)
    plans = [fixed_micro_batches(len(samples), len(samples)), fixed_micro_batches(len(samples), 1),
             fixed_micro_batches(len(samples), 4), token_budget_micro_batches(sample_lengths(samples), 30)]
    (stats, grad), *others = [_step_over(plan, loss, samples, advantages, table) for plan in plans]
    n = len(LOSS_SUMS)
    if tis is None:
        assert stats[LOSS_SUMS.index("clipped_tokens")] > 0  # some samples clipped: the plan must not change which
    else:
        assert stats[LOSS_SUMS.index("tis_clipped_tokens")] > 0
    for other_stats, other_grad in others:
        torch.testing.assert_close(other_grad, grad, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(other_stats[:n], stats[:n], rtol=1e-6, atol=1e-12)  # fp32 metric means x n
        assert torch.equal(other_stats[n:], stats[n:])  # maxima


def test_statistics_fold_sums_and_maxima_over_micro_batches_and_ranks():
    n, m = len(LOSS_SUMS), len(LOSS_MAXIMA)
    a = torch.tensor([1.0] * n + [0.5] * m, dtype=torch.float64)
    b = torch.tensor([2.0] * n + [0.25] * m, dtype=torch.float64)
    assert PolicyLoss.combine(a, b).tolist() == [3.0] * n + [0.5] * m
    assert PolicyLoss.combine(PolicyLoss.no_stats("cpu"), b).tolist() == b.tolist()
    ranks = [[1.0] * n + [0.5] * m, [2.0] * n + [3.0] * m]  # what two ranks hold

    def all_reduce(values, op=torch.distributed.ReduceOp.SUM):
        part = slice(0, n) if len(values) == n else slice(n, n + m)
        reduce = sum if op == torch.distributed.ReduceOp.SUM else max
        return [float(reduce(col)) for col in zip(*(r[part] for r in ranks))]

    assert reduce_over_ranks(ranks[0], all_reduce) == [3.0] * n + [3.0] * m


def test_mismatch_statistics_by_hand():
    logp, rollout, _, mask = _batch()
    stats = mismatch_stats(logp, rollout, mask)
    d = [lp - ro for sample in _tokens() for _, _, lp, ro, _ in sample]
    assert stats["abs_diff_sum"].item() == pytest.approx(sum(abs(x) for x in d), rel=1e-12)
    assert stats["abs_diff_max"].item() == pytest.approx(max(abs(x) for x in d), rel=1e-12)
    # Schulman's k3 with d = trainer - rollout: samples from the rollout policy estimate KL(rollout || trainer)
    assert stats["kl_sum"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in d), rel=1e-12)
    assert all(v.dtype == torch.float64 for v in stats.values())


def test_the_step_metrics_of_the_statistics():
    loss = PolicyLoss(eps_clip=0.2, temperature=1.0, num_tokens=8.0, advantage_estimator="grpo",
                      tis=TruncatedImportanceSampling(0.5, 2.0))
    stats = dict(loss=0.5, clipped_tokens=2.0, logprob_abs_diff=4.0, kl=0.8, tis_weight=7.0, tis_clipped_tokens=1.0,
                 replayed_tokens=0.0, route_differ_first=0.0, route_differ_last=0.0, logprob_abs_diff_max=1.25)
    metrics = loss.metrics([stats[k] for k in (*LOSS_SUMS, *LOSS_MAXIMA)], tokens=8.0, world_size=2)
    assert metrics == {"loss": 0.25, "clipfrac": 0.25, "train_rollout_logprob_abs_diff": 0.5,
                       "train_rollout_logprob_abs_diff_max": 1.25, "train_rollout_kl": 0.1, "tis_weight_mean": 0.875,
                       "tis_clipfrac": 0.125}
    plain = PolicyLoss(eps_clip=0.2, temperature=1.0, num_tokens=8.0, advantage_estimator="grpo", tis=None)
    assert "tis_weight_mean" not in plain.metrics([stats[k] for k in (*LOSS_SUMS, *LOSS_MAXIMA)], 8.0, 2)


# ---- flags ---------------------------------------------------------------------------------------------------


def test_the_flags_reach_the_loss_through_the_config(make_config):
    loss = PolicyLoss.of(make_config("--tiny-model"), num_tokens=10.0)
    assert loss.advantage_estimator == "grpo" and loss.tis is None
    config = make_config("--tiny-model", "--advantage-estimator", "gspo", "--use-tis", "--tis-clip-low", "0.5",
                         "--eps-clip", "4e-4")
    loss = PolicyLoss.of(config, num_tokens=10.0)
    assert loss.advantage_estimator == "gspo" and loss.tis == TruncatedImportanceSampling(0.5, 2.0)
    assert loss.eps_clip == 4e-4
    assert make_config("--tiny-model", "--use-tis").training.tis_clip_low == 0.0  # upstream's defaults: 0 and 2


@pytest.mark.parametrize("argv, flags, message", [
    (["--use-tis", "--tis-clip-low", "2", "--tis-clip", "1.5"], ("--tis-clip-low", "--tis-clip"),
     "--tis-clip-low (2.0) must be below --tis-clip (1.5)"),
    (["--use-tis", "--tis-clip-low", "2"], ("--tis-clip-low", "--tis-clip"),
     "--tis-clip-low (2.0) must be below --tis-clip (2.0)"),
    (["--use-tis", "--tis-clip", "0"], ("--tis-clip",), "--tis-clip must be > 0 (got 0.0)"),
    (["--use-tis", "--tis-clip-low", "-0.5"], ("--tis-clip-low",), "--tis-clip-low must be >= 0 (got -0.5)"),
    (["--tis-clip", "3"], ("--tis-clip",), "--tis-clip 3.0 has no effect: importance weights are truncated only "
                                           "under --use-tis"),
    (["--tis-clip-low", "0.5"], ("--tis-clip-low",), "--tis-clip-low 0.5 has no effect"),
])
def test_flag_errors_name_the_flags(make_config, argv, flags, message):
    with pytest.raises(ArgumentError) as e:
        make_config("--tiny-model", *argv)
    assert e.value.flags == flags and str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_an_unknown_estimator_is_refused_by_the_parser(make_config, capsys):
    with pytest.raises(SystemExit):
        make_config("--tiny-model", "--advantage-estimator", "ppo")
    assert "invalid choice: 'ppo'" in capsys.readouterr().err


# ---- a torch-backend step and its rollout record -------------------------------------------------------------


def _rendezvous():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_torch_step_reports_the_mismatch_into_the_record_and_line(make_config):
    from miles.backends.torch_backend.trainer import TorchTrainer
    from miles.metrics import format_rollout_line, rollout_record
    from miles.rollout.types import Sample

    config = make_config("--tiny-model", "--micro-batch-size", "2", "--advantage-estimator", "gspo", "--use-tis",
                         "--tis-clip-low", "0.5")
    g = torch.Generator().manual_seed(0)
    samples = [Sample(index=i, prompt_index=i // 2, prompt_ids=torch.randint(4, 90, (3 + i,), generator=g).tolist(),
                      response_ids=torch.randint(4, 90, (2 + i,), generator=g).tolist(),
                      response_logprobs=[-4.0 - 0.5 * j for j in range(2 + i)], response_text="",
                      finish_reason="length") for i in range(4)]
    trainer = TorchTrainer(config, rank=0, world_size=1)
    try:
        trainer.init(_rendezvous())
        rank = trainer.train(0, samples, [1.0, -1.0, 0.5, -0.5])
    finally:
        trainer.shutdown()
    assert rank["step_skipped"] is None
    assert 0 < rank["train_rollout_logprob_abs_diff"] <= rank["train_rollout_logprob_abs_diff_max"]
    assert rank["train_rollout_kl"] > 0 and 0.5 <= rank["tis_weight_mean"] <= 2.0 and 0 <= rank["tis_clipfrac"] <= 1
    timings = {"generate_seconds": 1.0, "train_seconds": 1.0, "sleep_seconds": 0.0, "wake_seconds": 0.0,
               "step_seconds": 2.0}
    rec = rollout_record(0, [1.0, 0.0], samples, [rank], [], [], timings, None)
    for key in ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max", "train_rollout_kl",
                "tis_weight_mean", "tis_clipfrac"):
        assert rec[key] == rank[key], key
    line = format_rollout_line(rec, 1)
    assert (f"lp {rec['train_rollout_logprob_abs_diff']:.2g} max {rec['train_rollout_logprob_abs_diff_max']:.2g} kl "
            f"{rec['train_rollout_kl']:.2g} tis {rec['tis_weight_mean']:.2f} cut ") in line, line
