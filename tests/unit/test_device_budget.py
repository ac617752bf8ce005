"""The device budget: the pure fit of bucket size and depth (plan.fit_to_device_budget), a real store on
CPU that stays under it bit-exactly, narrow moments under it, and the `miles train` flag reaching the store."""

import logging

import pytest
import torch

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
from miles_plugins.optimizers.nvme_stream import DEFAULT_BUCKET_NUMEL, StoreConfigError, stream_optimizer_state
from miles_plugins.optimizers.streaming.plan import (MIN_BUCKET_NUMEL, SPLIT_ALIGN_NUMEL, fit_to_device_budget,
                                                     planned_device_bytes)
from miles_plugins.optimizers.streaming.units import MiB

# ---- the pure function ------------------------------------------------------------------------------
FP32 = 12  # bytes per element in flight: fp32 main + exp_avg + exp_avg_sq
BIG_MODEL = [50_000_000] * 40  # 2B elements: many default buckets


def fp32_cost(largest, in_flight):
    return in_flight * FP32 * largest


def one_default_bucket():
    return fp32_cost(DEFAULT_BUCKET_NUMEL, 1)


def test_plenty_of_budget_keeps_default_buckets_and_depth_2():
    fit = fit_to_device_budget(BIG_MODEL, 5 * one_default_bucket(), fp32_cost)
    assert (fit.bucket_numel, fit.depth, fit.below_minimum) == (DEFAULT_BUCKET_NUMEL, 2, False)
    assert fit.device_bytes == 5 * one_default_bucket()


def test_the_default_budget_buys_depth_2_with_a_fifth_of_the_bucket():
    """One default bucket's bytes: five buckets of a fifth each (aligned down), never more bytes."""
    fit = fit_to_device_budget(BIG_MODEL, one_default_bucket(), fp32_cost)
    assert fit.depth == 2 and not fit.below_minimum
    assert fit.bucket_numel % SPLIT_ALIGN_NUMEL == 0
    assert DEFAULT_BUCKET_NUMEL // 5 - SPLIT_ALIGN_NUMEL < fit.bucket_numel <= DEFAULT_BUCKET_NUMEL // 5
    assert fit.device_bytes <= one_default_bucket()


def test_a_model_of_one_bucket_keeps_its_one_bucket():
    """The whole state fits one default bucket: the plan is what it was before the budget (one bucket)."""
    small = [1000, 3, 5000, 12345]
    fit = fit_to_device_budget(small, one_default_bucket(), fp32_cost)
    assert (fit.bucket_numel, fit.depth) == (DEFAULT_BUCKET_NUMEL, 2)
    assert fit.device_bytes == FP32 * sum(small)


def test_tight_budgets_cut_buckets_then_depth():
    tight = 5 * fp32_cost(8 * MIN_BUCKET_NUMEL, 1)
    fit = fit_to_device_budget(BIG_MODEL, tight, fp32_cost)
    assert (fit.bucket_numel, fit.depth) == (8 * MIN_BUCKET_NUMEL, 2)
    depth1 = fit_to_device_budget(BIG_MODEL, 4 * fp32_cost(MIN_BUCKET_NUMEL, 1), fp32_cost)
    assert depth1.depth == 1 and depth1.bucket_numel >= MIN_BUCKET_NUMEL and not depth1.below_minimum
    depth0 = fit_to_device_budget(BIG_MODEL, 2 * fp32_cost(MIN_BUCKET_NUMEL, 1), fp32_cost)
    assert depth0.depth == 0 and depth0.bucket_numel >= MIN_BUCKET_NUMEL and not depth0.below_minimum
    for f, budget in ((fit, tight), (depth1, 4 * fp32_cost(MIN_BUCKET_NUMEL, 1)),
                      (depth0, 2 * fp32_cost(MIN_BUCKET_NUMEL, 1))):
        assert f.device_bytes <= budget
        assert f.device_bytes == planned_device_bytes(BIG_MODEL, f.bucket_numel, f.depth, fp32_cost)


def test_below_the_minimum_bucket_the_fit_says_so():
    budget = 8 * MiB
    fit = fit_to_device_budget(BIG_MODEL, budget, fp32_cost)
    assert fit.below_minimum and fit.depth == 2 and fit.bucket_numel < MIN_BUCKET_NUMEL
    assert fit.device_bytes <= budget


def test_too_small_a_budget_names_the_budget_and_what_it_needs():
    needed = fp32_cost(SPLIT_ALIGN_NUMEL, 1)
    with pytest.raises(StoreConfigError) as e:
        fit_to_device_budget(BIG_MODEL, needed - 1, fp32_cost)
    msg = str(e.value)
    assert f"({needed - 1} bytes)" in msg and f"({needed} bytes)" in msg
    assert "Raise device_budget_mb (--stream-optimizer-state-device-budget-mb) to at least 1" in msg
    assert fit_to_device_budget(BIG_MODEL, needed, fp32_cost).bucket_numel == SPLIT_ALIGN_NUMEL


def test_explicit_bucket_numel_and_depth_are_honoured_or_refused():
    budget = one_default_bucket()
    fit = fit_to_device_budget(BIG_MODEL, budget, fp32_cost, bucket_numel=10_000_000, depth=1)
    assert (fit.bucket_numel, fit.depth) == (10_000_000, 1)
    # a given bucket size: the deepest depth that fits it
    assert fit_to_device_budget(BIG_MODEL, budget, fp32_cost, bucket_numel=DEFAULT_BUCKET_NUMEL).depth == 0
    assert fit_to_device_budget(BIG_MODEL, budget, fp32_cost, bucket_numel=60_000_000).depth == 1
    # a given depth: the largest bucket at that depth
    fit = fit_to_device_budget(BIG_MODEL, budget, fp32_cost, depth=3)
    assert fit.depth == 3 and fit.bucket_numel <= DEFAULT_BUCKET_NUMEL // 7
    with pytest.raises(StoreConfigError) as e:
        fit_to_device_budget(BIG_MODEL, budget, fp32_cost, bucket_numel=DEFAULT_BUCKET_NUMEL, depth=2)
    msg = str(e.value)
    assert f"bucket_numel={DEFAULT_BUCKET_NUMEL} at depth=2 needs" in msg
    assert f"({5 * budget} bytes)" in msg and f"({budget} bytes)" in msg
    assert "leave bucket_numel and depth unset" in msg
    with pytest.raises(StoreConfigError, match=r"bucket_numel=300000000 at depth=0 \(the shallowest\)"):
        fit_to_device_budget(BIG_MODEL, budget, fp32_cost, bucket_numel=300_000_000)


# ---- a real store on CPU ------------------------------------------------------------------------------
SIZES = (1_000_003, 700_001, 3, 600_000, 500_000, 257)  # 2.8M params: 34 MB of streamed state (mains + moments)
BUDGET_MB = 4


def make_model(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def make_adamw(params):
    return torch.optim.AdamW([{"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
                              {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)}])


def train(pairs, steps=6, prefetch_store=None):
    """Step every (optimizer, params) pair on the same gradients; record each step's measured peak."""
    g = torch.Generator().manual_seed(1)
    peaks = []
    for _ in range(steps):
        grads = [torch.randn(n, generator=g) for n in SIZES]
        if prefetch_store is not None:
            prefetch_store.prefetch()
        for opt, params in pairs:
            for p, grad in zip(params, grads):
                p.grad = grad.to(p.dtype)
            opt.step()
        if prefetch_store is not None:
            peaks.append(prefetch_store.stats.last_step.peak_resident_bytes)
    return peaks


def check_under_budget(store, peaks):
    budget = BUDGET_MB * MiB
    s = store.stats
    assert s.device_budget_bytes == budget
    assert s.peak_resident_bytes <= s.residency_bound_bytes <= budget
    assert 0 < max(peaks) <= budget
    assert s.num_buckets > 2 * store.depth + 1, "the budget must force many buckets"


def test_a_store_under_a_few_mb_steps_bit_identically(tmp_path, caplog):
    ref_params, budget_params, free_params = make_model(), make_model(), make_model()
    ref, opt, free = make_adamw(ref_params), make_adamw(budget_params), make_adamw(free_params)
    with caplog.at_level(logging.WARNING):
        store = stream_optimizer_state(opt, dir=str(tmp_path / "budget"), device_budget_mb=BUDGET_MB)
    assert "below the" in caplog.text  # 4 MiB holds buckets under the 4M-element minimum: said so
    unbudgeted = stream_optimizer_state(free, dir=str(tmp_path / "free"))
    assert unbudgeted.stats.num_buckets == 1  # 2.8M elements fit one default bucket, as before the budget
    peaks = train([(ref, ref_params), (opt, budget_params), (free, free_params)], prefetch_store=store)
    check_under_budget(store, peaks)
    assert store.depth == 2
    assert all(torch.equal(a, b) for a, b in zip(ref_params, budget_params))
    assert all(torch.equal(a, b) for a, b in zip(free_params, budget_params))
    store.close()
    unbudgeted.close()


def test_streamed_mains_under_a_budget_are_bit_identical_to_an_unbudgeted_store(tmp_path):
    """Mixed precision (mains stream too): 12 B per element in flight, the same fp32 bits either way."""
    a_params, b_params = make_model(torch.bfloat16), make_model(torch.bfloat16)
    a_opt, b_opt = ShardedMixedPrecisionAdam(a_params, lr=1e-3), ShardedMixedPrecisionAdam(b_params, lr=1e-3)
    store = stream_optimizer_state(a_opt, dir=str(tmp_path / "budget"), device_budget_mb=BUDGET_MB)
    free = stream_optimizer_state(b_opt, dir=str(tmp_path / "free"))
    peaks = train([(a_opt, a_params), (b_opt, b_params)], prefetch_store=store)
    check_under_budget(store, peaks)
    assert all(torch.equal(a, b) for a, b in zip(a_params, b_params))
    store.close()
    free.close()


@pytest.mark.parametrize("moment_dtype", ["bf16", "fp8e4m3"])
def test_narrow_moments_stay_under_the_budget(tmp_path, moment_dtype):
    """Encoded moments and the codec's scratch count too; the training still follows fp32 Adam."""
    ref_params, params = make_model(torch.bfloat16), make_model(torch.bfloat16)
    ref, opt = ShardedMixedPrecisionAdam(ref_params, lr=1e-3), ShardedMixedPrecisionAdam(params, lr=1e-3)
    store = stream_optimizer_state(opt, dir=str(tmp_path), moment_dtype=moment_dtype, device_budget_mb=BUDGET_MB)
    assert store.stats.codec_scratch_bytes > 0
    assert store.stats.bucket_inflight_bytes > 12 * store.stats.bucket_numel  # encoded bytes on top of fp32
    peaks = train([(ref, ref_params), (opt, params)], prefetch_store=store)
    check_under_budget(store, peaks)
    for a, b in zip(ref_params, params):
        assert torch.isfinite(b.float()).all()
        assert (a.float() - b.float()).abs().max() <= 1e-2
    store.close()


def test_explicit_shape_over_the_budget_is_refused_naming_both(tmp_path):
    params = make_model()
    with pytest.raises(StoreConfigError, match=r"bucket_numel=1000000 at depth=2 needs .* over the device "
                                                r"budget of 4\.0 MiB"):
        stream_optimizer_state(make_adamw(params), dir=str(tmp_path), device_budget_mb=BUDGET_MB,
                               bucket_numel=1_000_000, depth=2)


def test_set_io_depth_is_checked_against_the_budget(tmp_path):
    params = make_model()
    store = stream_optimizer_state(make_adamw(params), dir=str(tmp_path), device_budget_mb=BUDGET_MB)
    with pytest.raises(StoreConfigError, match="depth=40 needs"):
        store.set_io(depth=40)
    store.set_io(io_engine="sync")
    assert store.depth == 0 and store.stats.residency_bound_bytes <= BUDGET_MB * MiB
    store.close()


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_budget_is_refused_naming_the_field(tmp_path, value):
    with pytest.raises(StoreConfigError, match=f"device_budget_mb must be .*got {value!r}"):
        stream_optimizer_state(make_adamw(make_model()), dir=str(tmp_path), device_budget_mb=value)
