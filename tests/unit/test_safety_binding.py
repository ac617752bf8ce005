"""The bound optimizer takes no silent wrong step: with fp32 moments it is bit-identical to the same optimizer
keeping its state in memory, or it refuses with an error saying what to do. Each test reproduces a finding."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
from miles.offload.storage import StorageOffloader
from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state

from test_store import make_adamw, make_params, run_steps, streamed_moments
from test_store_sharded import make_model_params, make_opt

BUCKET = 4096 + 100


def stream(optimizer, tmp_path, bucket_numel=BUCKET, **kwargs):
    return stream_optimizer_state(optimizer, dir=str(tmp_path), bucket_numel=bucket_numel, **kwargs)


def assert_state_matches(ref, ref_params, store, params):
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params)), "params differ from the resident run"
    moments = streamed_moments(store)
    for e, p in enumerate(ref_params):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[p][k].view(-1), moments[(e, k)]), f"param {e} {k}"


def grads_for(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def set_grads(ref_params, params, step, dtype=None):
    """The same seeded grads on the resident reference and the streamed params (cast to ``dtype``)."""
    for ps in (ref_params, params):
        for p, g in zip(ps, grads_for(ps, step)):
            p.grad = g if dtype is None else g.to(dtype)


# ---- 8. torch.amp.GradScaler: unscaled grads, overflowed steps skipped ------------------------------
@pytest.mark.parametrize("fused, unscale_first", [(True, False), (True, True), (False, False)])
def test_grad_scaler_unscales_and_skips_overflowed_steps_like_resident(tmp_path, fused, unscale_first):
    ref_params, params = make_params(), make_params()
    ref, opt = (torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=fused) for ps in (ref_params, params))
    store = stream(opt, tmp_path)
    runs = [(ref, ref_params, torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)),
            (opt, params, torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2))]
    for step in range(6):
        grads = grads_for(params, step)
        if step in (1, 4):
            grads[3][7] = float("inf")  # an overflow: GradScaler must skip this step
        for optimizer, ps, scaler in runs:
            optimizer.zero_grad()
            scaler.scale(sum((p * g).sum() for p, g in zip(ps, grads))).backward()
            if unscale_first:  # as before clipping grads: the step then gets found_inf and no grad_scale
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        assert all(torch.isfinite(p).all() for p in params), f"step {step}: the overflowed step was applied"
        assert all(torch.equal(a, b) for a, b in zip(ref_params, params)), f"step {step}"
    assert runs[0][2].get_scale() == runs[1][2].get_scale()
    assert_state_matches(ref, ref_params, store, params)
    store.close()


# ---- 9. ShardedMixedPrecisionAdam: param.data replaced after binding --------------------------------
def test_sharded_param_data_replaced_after_binding_is_refused(tmp_path):
    params = make_model_params()
    opt = make_opt(params)
    store = stream(opt, tmp_path)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    old = params[1].data
    params[1].data = old.clone()
    with pytest.raises(StoreConfigError, match=r"param 1 .*param.data replaced.*param.data.copy_"):
        opt.step()
    with pytest.raises(StoreConfigError, match=r"param 1 .*param.data replaced"):
        opt.reload_model_params()
    params[1].data = old
    opt.step()  # refused before anything changed: the store is not poisoned
    assert store.poisoned_by is None
    store.close()


def test_sharded_sleep_wake_by_storage_trains_on_exactly(tmp_path):
    ref_params, params = make_model_params(), make_model_params()
    ref, opt = make_opt(ref_params), make_opt(params)
    store = stream(opt, tmp_path / "store", bucket_numel=1000)
    offloader = StorageOffloader("cpu")
    for step in range(3):
        offloader.sleep(params)
        offloader.wake()
        set_grads(ref_params, params, step, torch.bfloat16)
        ref.step()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    offloader.close()
    store.close()


# ---- 10. params sharing storage, a param listed twice -----------------------------------------------
def test_two_params_over_one_storage_are_refused_at_bind(tmp_path):
    base = torch.nn.Parameter(torch.randn(6000))
    alias = torch.nn.Parameter(base.data[1000:5000])  # overlaps `base`
    opt = torch.optim.AdamW([{"params": [base]}, {"params": [torch.nn.Parameter(torch.randn(10)), alias]}])
    with pytest.raises(StoreConfigError, match=r"params 0 and 2 share memory"):
        stream(opt, tmp_path)


def test_disjoint_params_over_one_storage_stay_exact(tmp_path):
    def split():
        flat = torch.randn(9000, generator=torch.Generator().manual_seed(3))
        return [torch.nn.Parameter(flat[:4000]), torch.nn.Parameter(flat[4000:])]
    ref_params, params = split(), split()
    ref, opt = torch.optim.AdamW(ref_params, lr=1e-2), torch.optim.AdamW(params, lr=1e-2)
    store = stream(opt, tmp_path, bucket_numel=4096)
    assert store.stats.num_buckets == 3
    for step in range(4):
        set_grads(ref_params, params, step)
        ref.step()
        opt.step()
    assert_state_matches(ref, ref_params, store, params)
    store.close()


def test_one_param_in_two_groups_is_refused_at_bind(tmp_path):
    params = make_params()
    opt = make_adamw(params)
    opt.param_groups[1]["params"].append(params[0])
    with pytest.raises(StoreConfigError, match=r"param 0 .*more than once"):
        stream(opt, tmp_path)


def test_sharded_model_params_over_one_storage_are_refused_at_bind(tmp_path):
    weight = torch.nn.Parameter(torch.randn(64, 32).to(torch.bfloat16))
    tied = torch.nn.Parameter(weight.data)
    opt = ShardedMixedPrecisionAdam([weight, torch.nn.Parameter(torch.randn(7).to(torch.bfloat16)), tied])
    with pytest.raises(StoreConfigError, match=r"params 0 and 2 share memory"):
        stream(opt, tmp_path)


# ---- 11. step hooks, load_state_dict ----------------------------------------------------------------
def test_step_hooks_of_the_bound_optimizer_run_once_per_step(tmp_path):
    params = make_params()
    opt = make_adamw(params)
    store = stream(opt, tmp_path)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    handles = [register_optimizer_step_pre_hook(
                   lambda o, args, kwargs: calls.append(("global pre", o))),
               register_optimizer_step_post_hook(
                   lambda o, args, kwargs: calls.append(("global post", o)))]
    try:
        run_steps([(opt, params)], steps=2)
    finally:
        for handle in handles:
            handle.remove()
    assert store.stats.num_buckets > 1
    assert calls == 2 * [("global pre", opt), ("pre", opt), ("post", opt), ("global post", opt)]
    store.close()


def test_global_step_hooks_see_the_sharded_inner_optimizer_once_per_step_like_resident(tmp_path):
    seen = {}
    for streamed in (False, True):
        params = make_model_params()
        opt = make_opt(params)
        store = stream(opt, tmp_path, bucket_numel=1000) if streamed else None
        calls = []
        opt.inner.register_step_post_hook(lambda o, args, kwargs: calls.append("inner post"))
        handle = register_optimizer_step_pre_hook(
            lambda o, args, kwargs: calls.append("global pre" if o is opt.inner else f"global pre on {o!r}"))
        try:
            for _ in range(2):
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
        finally:
            handle.remove()
        seen[streamed] = calls
        if store is not None:
            store.close()
    assert seen[True] == seen[False] == 2 * ["global pre", "inner post"]


def test_load_state_dict_of_resident_state_is_refused_and_the_marker_loads(tmp_path):
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    run_steps([(ref, ref_params)], steps=1)
    store = stream(opt, tmp_path)
    with pytest.raises(StoreConfigError, match=r"store.load_from"):
        opt.load_state_dict(ref.state_dict())
    assert opt.load_state_dict(opt.state_dict()) is None  # its own marker: nothing to load
    store.close()


# ---- 12. an LR scheduler built after binding; a non-contiguous grad ---------------------------------
def test_lr_scheduler_created_after_binding_matches_resident(tmp_path, recwarn):
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream(opt, tmp_path)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step) for o in (ref, opt)]
    for step in range(4):
        set_grads(ref_params, params, step)
        for o, scheduler in zip((ref, opt), schedulers):
            o.step()
            scheduler.step()
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    assert_state_matches(ref, ref_params, store, params)
    store.close()


def test_non_contiguous_grad_matches_resident(tmp_path):
    def model():
        return [torch.nn.Parameter(torch.randn(97, 61, generator=torch.Generator().manual_seed(5))),
                *make_params()]
    ref_params, params = model(), model()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream(opt, tmp_path, bucket_numel=4096)
    for step in range(3):
        grads = grads_for(params, step)
        grads[0] = grads[0].t().contiguous().t()  # the param's values, column-major
        for ps in (ref_params, params):
            for p, g in zip(ps, grads):
                p.grad = g.clone()  # keeps the strides
        assert not params[0].grad.is_contiguous()
        ref.step()
        opt.step()
    assert store.poisoned_by is None
    assert_state_matches(ref, ref_params, store, params)
    store.close()


# ---- 13. sleep/wake by storage and share_memory() train on, exactly ---------------------------------
def test_storage_offloader_sleep_wake_trains_on_exactly(tmp_path):
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream(opt, tmp_path / "store")
    offloader = StorageOffloader("cpu")
    for step in range(4):
        offloader.sleep(params)
        offloader.wake()
        set_grads(ref_params, params, step)
        ref.step()
        opt.step()
    assert_state_matches(ref, ref_params, store, params)
    offloader.close()
    store.close()


def test_share_memory_after_binding_trains_on_exactly(tmp_path):
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream(opt, tmp_path)
    run_steps([(ref, ref_params), (opt, params)], steps=2)
    torch.nn.ParameterList(params).share_memory()
    assert all(p.is_shared() for p in params)
    run_steps([(ref, ref_params), (opt, params)], steps=3, seed=7)
    assert_state_matches(ref, ref_params, store, params)
    store.close()
