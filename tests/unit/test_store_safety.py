"""Safety of the store's disk (issue 13): one owner per directory, descriptors that never follow a path,
no torn state published, a live integrity check, and the smaller findings. Each test reproduces a finding."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from miles_plugins.optimizers.nvme_stream import DirectoryInUseError, StoreConfigError, stream_optimizer_state
from miles_plugins.optimizers.streaming.io import engine as engine_mod
from miles_plugins.host.ownership import LOCK_FILE

from test_store import make_adamw, make_params, run_steps

BUCKET = 4096 + 100


def _assert_matches_resident(tmp_path, steps=6, **kwargs):
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET, **kwargs)
    run_steps([(ref, ref_params), (opt, params)], steps=steps)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    return store


# ---- 1. one owner per store directory; descriptors opened once ------------------------------------
HOLDER = textwrap.dedent("""
    import sys, torch
    from miles_plugins.optimizers.nvme_stream import stream_optimizer_state
    p = torch.nn.Parameter(torch.randn(5000))
    store = stream_optimizer_state(torch.optim.AdamW([p]), dir=sys.argv[1], rank=0, bucket_numel=1000)
    print("ready", flush=True)
    sys.stdin.readline()
    store.close()
""")


def test_second_process_on_the_same_store_directory_is_refused_naming_the_first(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DirectoryInUseError, match=rf"rank00000/opt0_0 is in use by pid {holder.pid} .*another directory"):
            stream_optimizer_state(torch.optim.AdamW(make_params()), dir=str(tmp_path), rank=0, bucket_numel=BUCKET)
        # the refused store touched nothing: the holder's files are all there
        assert len([n for n in os.listdir(tmp_path / "rank00000" / "opt0_0") if n.endswith(".bin")]) == 5
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    assert not os.path.exists(tmp_path / "rank00000")  # the holder removed its directory, lock included
    _assert_matches_resident(tmp_path).close()


def test_lock_survives_the_wipe_and_close_removes_it(tmp_path):
    leftover = tmp_path / "rank00000" / "opt0_0"
    leftover.mkdir(parents=True)
    (leftover / "bucket00000.bin").write_bytes(b"old run")
    store = stream_optimizer_state(torch.optim.AdamW(make_params()), dir=str(tmp_path), bucket_numel=BUCKET)
    assert (leftover / LOCK_FILE).exists() and store.directory_lock.held
    store.close()
    assert not os.path.exists(tmp_path / "rank00000")


def test_descriptors_are_opened_at_creation_and_never_follow_the_path(tmp_path):
    """A file replaced at its path after construction (another run recreating the directory) is
    neither read nor written: the store keeps its own files' descriptors."""
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET, direct_io=None)
    if all(b.file.direct_refusal is not None for b in store.buckets):
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    assert all(b.file.dfd >= 0 and os.path.samestat(os.fstat(b.file.fd), os.fstat(b.file.dfd)) for b in store.buckets)
    garbage = b"\x7f" * store.buckets[0].file.nbytes
    for b in store.buckets:
        os.unlink(b.file.path)
        with open(b.file.path, "wb") as f:
            f.write(garbage[:b.file.nbytes])
    run_steps([(ref, ref_params), (opt, params)], steps=6)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    for b in store.buckets:
        with open(b.file.path, "rb") as f:
            assert f.read() == garbage[:b.file.nbytes], f"{b.file.path} was written through its path"
    store.close()


def test_store_directory_that_is_a_symlink_is_refused_naming_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / "rank00000")
    with pytest.raises(StoreConfigError, match=rf"{root / 'rank00000'}.* is a symbolic link"):
        stream_optimizer_state(torch.optim.AdamW(make_params()), dir=str(root), bucket_numel=BUCKET)
    assert os.listdir(elsewhere) == []


# ---- 3. a step lands every bucket or poisons the store ---------------------------------------------
def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _fail_writes_after(monkeypatch, module, calls):
    """The `calls`-th positional write from now on, and every later one, fails with EIO (a dying disk)."""
    real, seen = module.pwrite_all, [0]

    def pwrite_all(fd, buffers, offset):
        seen[0] += 1
        if seen[0] > calls:
            raise OSError(5, "Input/output error (injected)")
        return real(fd, buffers, offset)
    monkeypatch.setattr(module, "pwrite_all", pwrite_all)
    return lambda: monkeypatch.setattr(module, "pwrite_all", real)


@pytest.mark.parametrize("io_engine", ["pipelined", "sync"])
def test_io_error_mid_step_poisons_the_store_until_load_from_recovers(tmp_path, monkeypatch, io_engine):
    from miles_plugins.optimizers.nvme_stream import StorePoisonedError
    from miles_plugins.optimizers.streaming.io import sync as sync_mod
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path / "live"), bucket_numel=BUCKET, io_engine=io_engine)
    for k in range(6):
        _grads(ref_params, k)
        ref.step()
    for k in range(3):
        _grads(params, k)
        opt.step()
    store.save_to(str(tmp_path / "ckpt"))
    saved_params = [p.detach().clone() for p in params]
    heal = _fail_writes_after(monkeypatch, engine_mod if io_engine == "pipelined" else sync_mod, calls=3)
    _grads(params, 3)
    with pytest.raises(OSError, match="injected"):
        opt.step()
        store.flush()  # write-behind: the failure may surface only when the writes are waited for
    heal()
    assert store.poisoned_by is not None
    for refused in (opt.step, lambda: store.save_to(str(tmp_path / "torn"))):
        with pytest.raises(StorePoisonedError, match=r"mix of two steps.*store.load_from\(<last checkpoint>\)"):
            refused()
    assert not os.path.exists(tmp_path / "torn" / "nvme_opt_state")  # the torn state was never published
    with torch.no_grad():  # the recovery: model weights from the checkpoint, then the optimizer state
        for p, saved in zip(params, saved_params):
            p.copy_(saved)
    assert store.load_from(str(tmp_path / "ckpt")) is True
    assert store.poisoned_by is None
    for k in range(3, 6):
        _grads(params, k)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    store.close()


# ---- 5. smaller findings ---------------------------------------------------------------------------
def test_buffered_io_of_a_bucket_with_more_params_than_iov_max(tmp_path):
    """A sync-engine bucket of 3000 params writes 3000 buffers in one vectored call: over IOV_MAX (1024)
    that was EINVAL on the first step."""
    ref_params = [torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(i))) for i in range(3000)]
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref, opt = torch.optim.AdamW(ref_params, lr=1e-2), torch.optim.AdamW(params, lr=1e-2)
    store = stream_optimizer_state(opt, dir=str(tmp_path), io_engine="sync")
    assert store.stats.num_buckets == 1
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        for a, b in zip(ref_params, params):
            a.grad = torch.randn(3, generator=g)
            b.grad = a.grad.clone()
        ref.step()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    store.close()


def test_failed_constructions_leak_no_threads(tmp_path, monkeypatch):
    def no_space(fd, buffers, offset):
        raise OSError(28, "No space left on device (injected)")
    from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
    monkeypatch.setattr(engine_mod, "pwrite_all", no_space)
    io_threads = lambda: [t.name for t in threading.enumerate() if t.name.startswith("miles-io")]  # noqa: E731
    before = io_threads()
    for _ in range(3):  # the engine's threads run when the mains are evicted, then the write fails
        params = [torch.nn.Parameter(torch.randn(10000).to(torch.bfloat16))]
        with pytest.raises(OSError, match="injected|failed earlier"):
            stream_optimizer_state(ShardedMixedPrecisionAdam(params, lr=1e-3), dir=str(tmp_path), bucket_numel=3000)
    assert io_threads() == before
    assert os.listdir(tmp_path) == []


def test_save_removes_temporaries_of_dead_saves_only(tmp_path):
    store = _assert_matches_resident(tmp_path / "live", steps=1)
    final = tmp_path / "ckpt" / "nvme_opt_state" / store.relative_dir
    final.parent.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (final.parent / f"{final.name}.tmp-{dead.pid}").mkdir()
    (final.parent / f"{final.name}.tmp-{os.getppid()}").mkdir()  # a live process's save in progress
    store.save_to(str(tmp_path / "ckpt"))
    assert sorted(os.listdir(final.parent)) == sorted([final.name, f"{final.name}.tmp-{os.getppid()}"])
    store.close()


def test_replaced_param_data_or_added_param_group_is_refused_at_step(tmp_path):
    params = make_params()
    opt = make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET)
    run_steps([(opt, params)], steps=1)
    old = params[2].data
    params[2].data = old.clone()
    with pytest.raises(StoreConfigError, match=r"param 2 .*new storage.*param.data.copy_"):
        opt.step()
    params[2].data = old
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(5))]})
    with pytest.raises(StoreConfigError, match=r"param groups changed.*2 groups.*3 of"):
        opt.step()
    store.close()
