"""The pipelined I/O engine on CUDA (skipped without a GPU): CUDA streams, events, pinned staging.

pipelined == sync bit for bit (mixed precision and plain fp32 Adam), read-ahead / write-behind /
host cache variants, device memory peak within the documented residency bound, O_DIRECT and pinned
staging in use, and an error in a worker thread raised by step().

    python -m pytest -q tests/gpu/test_pipelined_engine_gpu.py
"""

import errno
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam  # noqa: E402
from miles_plugins.optimizers.nvme_stream import stream_optimizer_state  # noqa: E402
from miles_plugins.optimizers.streaming.io import engine as engine_mod  # noqa: E402

DEV = torch.device("cuda", 0)
SIZES = ((1031, 517), (1 << 20,), (3,), (4099,), (3_000_001,), (257, 31), (2_500_000,), (7,))
BUCKET = 1 << 20  # ~8 buckets, split params


def make_model(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, device=DEV).to(torch.bfloat16)) for s in SIZES]


def make_opt(params):
    return ShardedMixedPrecisionAdam([
        {"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0},
    ], betas=(0.9, 0.95), fused=True)


def set_grads(params, step):
    g = torch.Generator(device=DEV).manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if (i == 2 and step == 1) else torch.randn(p.shape, generator=g, device=DEV).to(torch.bfloat16)


def busy(ms=20):
    """Some device work between steps, like a forward/backward (prefetch copies overlap with it)."""
    a = torch.randn(2048, 2048, device=DEV)
    for _ in range(ms):
        a = a @ a
        a /= a.norm()


def run(root, steps=5, prefetch=False, **kwargs):
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(root), bucket_numel=BUCKET, chunk_mb=1, **kwargs)
    history = []
    for k in range(steps):
        if prefetch:
            store.prefetch()
        busy()
        set_grads(params, k)
        opt.step()
        history.append([p.detach().clone() for p in params])
        if k == 2:
            opt.param_groups[1]["lr"] = 1e-3
    return store, history


def file_bytes(store):
    store.flush()
    out = []
    for b in store.buckets:  # through the descriptor: a bucket in host RAM only has no file to open
        out.append(os.pread(b.file.fd, b.file.nbytes, 0))
    return out


@pytest.mark.parametrize("variant", [
    dict(depth=2),
    dict(depth=1, prefetch=True, direct_io=False),
    dict(depth=3, prefetch=True, host_cache_mb=64),
    dict(depth=2, write_behind=False, io_threads=1),
    dict(depth=2, prefetch=True, moment_dtype="bf16"),
])
def test_pipelined_is_bit_identical_to_sync_on_cuda(tmp_path, variant):
    variant = dict(variant)
    moment_dtype = variant.pop("moment_dtype", "fp32")
    ref, ref_hist = run(tmp_path / "sync", io_engine="sync", moment_dtype=moment_dtype)
    store, hist = run(tmp_path / "pipe", moment_dtype=moment_dtype, **variant)
    assert store.stats.num_buckets >= 8
    for k, (a, b) in enumerate(zip(ref_hist, hist)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"params differ after step {k + 1}"
    assert file_bytes(ref) == file_bytes(store), "bucket files differ"
    last = store.stats.last_step
    assert last.disk_bytes_read + last.cache_bytes_read + last.reused_bytes == last.bytes_read
    if variant.get("host_cache_mb"):
        assert last.cache_bytes_read > 0
    ref.close()
    store.close()


def test_plain_fp32_adamw_on_cuda_is_bit_identical(tmp_path):
    def go(root, **kw):
        g = torch.Generator(device=DEV).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g, device=DEV)) for s in SIZES]
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        store = stream_optimizer_state(opt, dir=str(root), bucket_numel=BUCKET, chunk_mb=1, **kw)
        for k in range(4):
            store.prefetch()
            gg = torch.Generator(device=DEV).manual_seed(7 + k)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gg, device=DEV)
            opt.step()
        return store, params
    ref, a = go(tmp_path / "sync", io_engine="sync")
    store, b = go(tmp_path / "pipe")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert file_bytes(ref) == file_bytes(store)
    ref.close()
    store.close()


def test_device_peak_within_the_residency_bound(tmp_path):
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET, chunk_mb=1, depth=2)
    for k in range(3):
        set_grads(params, k)
        opt.reduce_grads()  # the sharded optimizer's own buffers stay outside the measurement
        store.flush()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        store.step()  # what opt.update runs
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        opt.gather_params()
        s = store.stats
        print(f"step {k + 1}: device peak {peak / 2**20:.1f} MiB, store peak {s.last_step.peak_resident_bytes / 2**20:.1f}"
              f" MiB, bound {s.residency_bound_bytes / 2**20:.1f} MiB")
        assert s.last_step.peak_resident_bytes <= s.residency_bound_bytes
        assert peak <= s.residency_bound_bytes + (8 << 20)  # + allocator rounding
    assert store.stats.peak_resident_bytes > store.stats.max_bucket_bytes  # buckets really overlapped
    store.close()


def test_staging_is_pinned_and_direct_io_is_used(tmp_path):
    store, _ = run(tmp_path, steps=2, direct_io=None)
    eng = store.stager.engine
    bufs = []
    while True:
        try:
            bufs.append(eng._read_staging._free.get_nowait())
        except Exception:
            break
    # page-locked in place (cudaHostRegister; torch's is_pinned() does not always report such memory)
    registered = set(eng._memory._registered)
    assert bufs and all(b.tensor.data_ptr() % 4096 == 0 for b in bufs)
    assert all(b.tensor.is_pinned() or b.tensor.data_ptr() in registered for b in bufs)
    for b in bufs:
        eng._read_staging.release(b)
    if eng.direct:
        assert all(b.file.dfd >= 0 for b in store.buckets)
    store.close()


def test_error_in_a_worker_raises_from_step_on_cuda(tmp_path, monkeypatch):
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET, chunk_mb=1)
    set_grads(params, 0)
    opt.step()
    real, calls = engine_mod.pread_into, {"n": 0}

    def failing(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "injected read error")
        return real(fd, buffers, offset)
    monkeypatch.setattr(engine_mod, "pread_into", failing)
    set_grads(params, 1)
    with pytest.raises(OSError, match="injected read error"):
        opt.step()
    assert store.stats.resident_bytes == 0
    monkeypatch.setattr(engine_mod, "pread_into", real)
    store.close()
    assert not os.path.exists(store.path)


def test_a_load_puts_a_whole_tier_state_in_ram_on_cuda(tmp_path):
    """With a tier that holds the whole state, a load reads the checkpoint straight into the tier's RAM
    images (no bucket file on the live disk, nothing left to read back); the next step reads no disk and
    matches the sync engine bit for bit."""
    ref, ref_hist = run(tmp_path / "sync", io_engine="sync", steps=4)
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path / "pipe"), bucket_numel=BUCKET, chunk_mb=1,
                                   host_cache_mb=256)
    for k in range(3):
        set_grads(params, k)
        opt.step()
        if k == 2:
            opt.param_groups[1]["lr"] = 1e-3
    store.save_to(str(tmp_path / "ckpt"))
    assert store.load_from(str(tmp_path / "ckpt"))
    assert store.stager.counters.fill_bytes_read == 0, "the load put the state into RAM itself"
    assert not any(os.path.exists(b.file.path) for b in store.buckets), "a bucket in RAM has a file on disk"
    store.release_device()
    store.stager.wait_all()
    set_grads(params, 3)
    opt.step()
    last = store.stats.last_step
    assert last.disk_bytes_read == 0 and last.cache_bytes_read == last.bytes_read > 0
    assert all(torch.equal(x, y) for x, y in zip(ref_hist[3], params)), "params differ after the refilled step"
    assert file_bytes(ref) == file_bytes(store), "bucket files differ"
    ref.close()
    store.close()
