"""Narrow moments on the device: a resume is bit-identical with the CUDA generators' states restored
from the checkpoint (codec_rng.py), for plain AdamW and the ZeRO-1 sharded optimizer. The CPU twin,
tests/unit/test_checkpoint_narrow.py, forks a process per leg; CUDA does not survive a fork, so the legs
run here one after another in this process, each with fresh store identities (a restarted job's)."""

import json
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))

from test_checkpoint import (  # noqa: E402,F401  (_restarted_process: autouse fixture)
    _restarted_process, assert_same, build, load, restart, save, state, train)


def _leg(kind, root, moment_dtype, steps, base=None, load_from=None):
    restart()
    params, opt, store = build(kind, root, device="cuda", moment_dtype=moment_dtype)
    if load_from is not None:
        assert load(params, opt, store, load_from) is True
    train(params, opt, steps)
    if base is not None:
        save(params, store, base)
    out = state(store, params)
    store.close()
    return out


@pytest.mark.parametrize("moment_dtype", ["bf16", "fp16", "fp8e4m3", "fp8e5m2"])
@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_narrow_resume_on_cuda_is_bit_identical(tmp_path, kind, moment_dtype):
    ref = _leg(kind, tmp_path / "live", moment_dtype, range(6))
    base = str(tmp_path / "iter3")
    _leg(kind, tmp_path / "live", moment_dtype, range(3), base=base)
    resumed = _leg(kind, tmp_path / "live", moment_dtype, range(3, 6), load_from=base)
    assert_same(resumed, ref, f"{kind} {moment_dtype} on cuda: resumed run")
    manifest = json.load(open(os.path.join(base, "nvme_opt_state/rank00000/opt0_0/manifest.json")))
    devices = manifest.get("codec_rng", {}).get("devices")
    print(f"\n{kind} {moment_dtype}: 6 steps == 3 + save + load + 3 on {torch.cuda.get_device_name()}; "
          f"generator states saved for {devices}")
    if moment_dtype != "fp16":
        assert devices == {"exp_avg": ["cuda:0"], "exp_avg_sq": ["cuda:0"]}


@pytest.mark.parametrize("saved_dtype, load_dtype", [("fp8e4m3", "fp32"), ("fp32", "fp8e4m3"), ("bf16", "fp16")])
def test_resume_with_another_moment_dtype_and_bucket_size_on_cuda(tmp_path, saved_dtype, load_dtype):
    """The conversion path (requantize.py) on device buffers: decode the saved moments, encode them in
    the live store's format and its other buckets; masters and steps exact, widening to fp32 exact."""
    restart()
    params, opt, store = build("plain", tmp_path / "live", device="cuda", moment_dtype=saved_dtype)
    train(params, opt, range(3))
    saved = state(store, params)
    save(params, store, str(tmp_path / "ck"))
    store.close()
    restart()
    params, opt, store = build("plain", tmp_path / "live", device="cuda", moment_dtype=load_dtype, bucket_numel=3000)
    assert load(params, opt, store, str(tmp_path / "ck")) is True
    got = state(store, params)
    worst = 0.0
    for name in (k for k in saved if k != "params"):
        (main, m, v, step), (ref_main, ref_m, ref_v, ref_step) = got[name], saved[name]
        assert torch.equal(main, ref_main) and step == ref_step, name
        if m is None:
            continue
        if load_dtype == "fp32":
            assert torch.equal(m, ref_m) and torch.equal(v, ref_v), name
        for x, y in ((ref_m, m), (ref_v, v)):
            worst = max(worst, float((y - x).abs().max() / x.abs().max().clamp_min(1e-30)))
    train(params, opt, range(3, 5))
    assert all(torch.isfinite(p).all() for p in params)
    print(f"\n{saved_dtype} -> {load_dtype} (bucket size 2000 -> 3000) on cuda: masters exact, "
          f"largest moment change {worst:.3g} of the segment's max")
    store.close()
