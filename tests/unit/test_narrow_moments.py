"""Narrow moments through the store (CPU): fp32 stays bit-identical, narrow formats track in-memory Adam
without NaN/Inf, and the files and stats hold exactly the bytes the formats' arithmetic says."""

import math
import os

import pytest
import torch

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state
from miles_plugins.optimizers.streaming.codec import BLOCK_SIZE, Fp32Codec
from miles_plugins.optimizers.streaming.layout import ALIGN_BYTES, EXP_AVG, EXP_AVG_SQ, MAIN, align_up

NARROW = ("bf16", "fp16", "fp8e4m3", "fp8e5m2")
SIZES = (1000, 3, 5000, 7, 8191, 3001)  # none a multiple of the block size
LR = 1e-3


def wide_range_grads(sizes, steps, seed=1):
    """Per-element gradient scales log-uniform over 1e-8..1: Adam's exp_avg_sq spans 16 decades,
    inside every block. Some elements stop receiving gradient half way through."""
    g = torch.Generator().manual_seed(seed)
    scales = [10 ** (torch.rand(n, generator=g) * 8 - 8) for n in sizes]
    dead = [torch.rand(n, generator=g) < 0.2 for n in sizes]
    for step in range(steps):
        yield [(torch.where(d, 0.0, s) if step >= steps // 2 else s) * torch.randn(n, generator=g)
               for n, s, d in zip(sizes, scales, dead)]


def params_like(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]


def run(moment_dtype, steps=12, bucket_numel=4096 + 100, tmp=None, sizes=SIZES):
    """(params after `steps` AdamW steps, store or None, max per-step |param change| / lr)."""
    params = params_like(sizes)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    store = None if moment_dtype is None else stream_optimizer_state(
        opt, dir=str(tmp), moment_dtype=moment_dtype, bucket_numel=bucket_numel)
    biggest = 0.0
    for grads in wide_range_grads(sizes, steps):
        before = [p.detach().clone() for p in params]
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()
        biggest = max(biggest, max((p - b).abs().max().item() for p, b in zip(params, before)) / LR)
    return params, store, biggest


def streamed_state(store):
    """Every segment of every bucket, decoded into fp32 the way a step's fetch does."""
    store.flush()
    out = []
    for bucket in store.buckets:
        names = bucket.segments_to_fetch()
        bucket.fetch(store.stager, names)
        out.append({n: bucket.flat[n].clone() for n in names})
        bucket.release()
    return out


def test_fp32_is_bit_identical_and_uses_the_raw_codec(tmp_path):
    ref, _, _ = run(None)
    params, store, _ = run("fp32", tmp=tmp_path)
    assert all(isinstance(c, Fp32Codec) for c in store.codecs.values())
    assert all(torch.equal(a, b) for a, b in zip(ref, params))
    store.close()


@pytest.mark.parametrize("moment_dtype", NARROW)
def test_narrow_moments_track_in_memory_adam(tmp_path, moment_dtype):
    ref, _, ref_step = run(None)
    params, store, step = run(moment_dtype, tmp=tmp_path)
    assert all(torch.isfinite(p).all() for p in params)
    # Adam moves a param by about lr per step; a surviving exp_avg_sq keeps it so
    assert step < 3 * max(ref_step, 1.0), f"largest step {step:.3g} lr vs {ref_step:.3g} lr in memory"
    # RMS over elements of the distance from the in-memory run, in units of the run's total movement
    # (8 decades of gradient scale inside every block: the worst case for block scaling)
    drift = torch.cat([(a - b).view(-1) for a, b in zip(ref, params)]).pow(2).mean().sqrt().item() / (LR * 12)
    assert drift < {"bf16": 0.005, "fp16": 0.001, "fp8e4m3": 0.25, "fp8e5m2": 0.25}[moment_dtype], drift
    for segments in streamed_state(store):
        assert all(torch.isfinite(t).all() for t in segments.values())
        assert (segments[EXP_AVG_SQ] >= 0).all()
    store.close()


def expected_bytes(moment_dtype, numel):
    blocks = math.ceil(numel / BLOCK_SIZE)
    return {"fp32": 4 * numel, "bf16": 2 * numel, "fp16": 2 * numel + 4 * blocks,
            "fp8e4m3": numel + 4 * blocks, "fp8e5m2": numel + 4 * blocks}[moment_dtype]


@pytest.mark.parametrize("moment_dtype", ("fp32",) + NARROW)
def test_files_and_stats_hold_exactly_the_formats_bytes(tmp_path, moment_dtype):
    """Masters + moments stream (mixed-precision optimizer): per bucket of n elements the file holds
    4n + 2 * encoded(n) payload bytes, each segment on a 4 KiB boundary, and a step moves exactly that."""
    params = params_like(SIZES)
    opt = ShardedMixedPrecisionAdam(params, lr=LR)
    store = stream_optimizer_state(opt, dir=str(tmp_path), moment_dtype=moment_dtype, bucket_numel=4096 + 100)
    numels = [b.numel for b in store.buckets]
    assert len(numels) >= 4 and sum(numels) == sum(SIZES)
    mains = sum(4 * n for n in numels)
    payload = sum(4 * n + 2 * expected_bytes(moment_dtype, n) for n in numels)
    files = sum(align_up(4 * n) + 2 * align_up(expected_bytes(moment_dtype, n)) for n in numels)
    assert store.stats.state_bytes == files
    for bucket in store.buckets:
        segs = bucket.layout.segments
        assert [segs[k].nbytes for k in (MAIN, EXP_AVG, EXP_AVG_SQ)] == [
            4 * bucket.numel] + 2 * [expected_bytes(moment_dtype, bucket.numel)]
        assert all(s.offset % ALIGN_BYTES == 0 for s in segs.values())
        assert os.path.getsize(bucket.file.path) == bucket.layout.file_bytes
    steps = []
    for grads in wide_range_grads(SIZES, 3):
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()
        steps.append((store.stats.last_step.bytes_read, store.stats.last_step.bytes_written))
    assert steps[0] == (mains, payload), "the first step reads the mains only: moments do not exist yet"
    assert steps[1] == steps[2] == (payload, payload)
    per_param = payload / sum(SIZES)
    nominal = {"fp32": 12, "bf16": 8, "fp16": 8, "fp8e4m3": 6, "fp8e5m2": 6}[moment_dtype]
    assert nominal <= per_param <= nominal + 2 * 4 * len(numels) / sum(SIZES) + 8 / BLOCK_SIZE
    store.close()


def test_unsupported_moment_dtype_is_rejected_before_touching_disk(tmp_path):
    params = params_like((10,))
    with pytest.raises(StoreConfigError, match=r"'fp8' is not supported; choose one of fp32, bf16, fp16, "
                                               r"fp8e4m3, fp8e5m2"):
        stream_optimizer_state(torch.optim.AdamW(params), dir=str(tmp_path), moment_dtype="fp8")
    assert os.listdir(tmp_path) == []
