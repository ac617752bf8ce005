"""The store's core contract on CPU: bit-exactness, streaming volume, residency, disk hygiene, errors."""

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state

SIZES = (1000, 3, 5000, 12345, 7, 8191, 20011)  # odd sizes, none a multiple of 1024


def make_params(seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]


def make_adamw(params):
    return torch.optim.AdamW([
        {"params": params[:2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ])


def run_steps(opts_and_params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    params0 = opts_and_params[0][1]
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in params0]
        for opt, params in opts_and_params:
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
            if step == 2:  # lr changes between steps are re-read from the master groups
                opt.param_groups[1]["lr"] = 1e-3
                opt.param_groups[0]["weight_decay"] = 0.2


def streamed_moments(store):
    """Concatenated (exp_avg, exp_avg_sq) per entry, read back from the bucket files."""
    out = {}
    for bucket in store.buckets:
        bucket.fetch(store.stager, bucket.segments_to_fetch())
        for piece, views in zip(bucket.pieces, bucket.moment_views):
            for k, v in views.items():
                out.setdefault((piece.entry, k), []).append((piece.start, v.clone()))
        bucket.release()
    return {key: torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])]) for key, parts in out.items()}


@pytest.mark.parametrize("bucket_numel", [200_000_000, 4096 + 100])
def test_plain_adamw_is_bit_identical_to_in_memory(tmp_path, bucket_numel):
    ref_params, params = make_params(), make_params()
    ref, opt = make_adamw(ref_params), make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=bucket_numel)
    if bucket_numel < 10_000:
        assert store.stats.num_buckets >= 10
        assert any(p.start > 0 for b in store.buckets for p in b.pieces), "expected a split param"
    run_steps([(ref, ref_params), (opt, params)], steps=6)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    moments = streamed_moments(store)
    for i, p in enumerate(ref_params):
        assert torch.equal(moments[(i, "exp_avg")], ref.state[p]["exp_avg"].view(-1))
        assert torch.equal(moments[(i, "exp_avg_sq")], ref.state[p]["exp_avg_sq"].view(-1))
    store.close()


def test_streaming_volume_and_residency(tmp_path):
    params = make_params()
    opt = make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=4096 + 100)
    moment_bytes = 4 * sum(SIZES)
    run_steps([(opt, params)], steps=1)
    # plain fp32 Adam: params are the masters, only moments stream; none exist before step 1
    assert store.stats.last_step.bytes_read == 0
    assert store.stats.last_step.bytes_written == 2 * moment_bytes
    run_steps([(opt, params)], steps=2)
    assert store.stats.last_step.bytes_read == 2 * moment_bytes
    assert store.stats.last_step.bytes_written == 2 * moment_bytes
    # residency bound: (2 * depth + 1) buckets in flight (engine.py / store.py document it)
    assert 0 < store.stats.peak_resident_bytes <= store.stats.residency_bound_bytes
    assert store.stats.residency_bound_bytes == (2 * store.stats.depth + 1) * store.stats.max_bucket_bytes
    assert store.stats.max_bucket_bytes <= 2 * 4 * (4096 + 100)
    store.flush()  # write-behind: the last write-backs may still hold their buckets until flushed
    assert store.stats.resident_bytes == 0
    for bucket in store.buckets:
        assert all(f.untyped_storage().nbytes() == 0 for f in bucket.flat.values())
    store.close()


def test_state_dict_marker_and_store_attribute(tmp_path):
    params = make_params()
    opt = make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path))
    assert opt._nvme_state_store is store
    assert "nvme_stream" in opt.state_dict()
    assert opt.load_state_dict(opt.state_dict()) is None
    with pytest.raises(StoreConfigError, match=r"store.load_from"):
        opt.load_state_dict({"anything": 1})
    store.close()


def test_files_removed_at_close_and_two_stores_never_share_a_directory(tmp_path):
    a, b = make_params(), make_params()
    sa = stream_optimizer_state(make_adamw(a), dir=str(tmp_path))
    files = sorted(os.listdir(sa.path))
    with pytest.raises(StoreConfigError, match=r"another open store of this process already works in .*opt0_0 "
                                               r".*give this optimizer another identity"):
        stream_optimizer_state(make_adamw(b), dir=str(tmp_path))
    assert sorted(os.listdir(sa.path)) == files  # refused before touching the first store's files
    sb = stream_optimizer_state(make_adamw(b), dir=str(tmp_path), instance=1)
    assert (sa.relative_dir, sb.relative_dir) == ("rank00000/opt0_0", "rank00000/opt1_0")
    assert sa.path != sb.path and os.path.isdir(sa.path) and os.path.isdir(sb.path)
    assert sorted(n for n in os.listdir(sa.path) if not n.startswith("."))[0] == "bucket00000.bin"
    sa.close()
    assert not os.path.exists(sa.path) and os.path.isdir(sb.path)
    sb.close()
    sb.close()  # idempotent
    assert os.listdir(tmp_path) == []


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from miles_plugins.optimizers.nvme_stream import stream_optimizer_state
    p = [torch.nn.Parameter(torch.randn(5000))]
    opt = torch.optim.AdamW(p)
    store = stream_optimizer_state(opt, dir=sys.argv[1])
    p[0].grad = torch.randn(5000); opt.step()
    print(store.path, flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
""")


def test_files_removed_at_normal_exit_and_leftovers_wiped_after_sigkill(tmp_path):
    root = str(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", CHILD, root, "exit"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(done.stdout.strip())

    child = subprocess.Popen([sys.executable, "-c", CHILD, root, "hang"], stdout=subprocess.PIPE, text=True, env=env)
    path = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert os.path.isdir(path), "a SIGKILLed store leaves its files behind"
    open(os.path.join(path, "bucket00099.bin"), "w").close()

    nxt = subprocess.Popen([sys.executable, "-c", CHILD, root, "hang"], stdout=subprocess.PIPE, text=True, env=env)
    assert nxt.stdout.readline().strip() == path  # same identity on restart
    assert "bucket00099.bin" not in os.listdir(path)
    nxt.terminate()
    nxt.wait()


def test_unsupported_optimizer_is_rejected(tmp_path):
    opt = torch.optim.SGD(make_params(), lr=0.1)
    with pytest.raises(StoreConfigError, match=r"torch\.optim\.sgd\.SGD is not an Adam optimizer"):
        stream_optimizer_state(opt, dir=str(tmp_path))
    opt = torch.optim.Adam(make_params(), amsgrad=True)
    with pytest.raises(StoreConfigError, match="amsgrad"):
        stream_optimizer_state(opt, dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_mixed_devices_and_low_precision_params_are_rejected(tmp_path):
    params = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10, device="meta"))]
    with pytest.raises(StoreConfigError, match=r"mixed devices \['cpu', 'meta'\]"):
        stream_optimizer_state(torch.optim.AdamW(params), dir=str(tmp_path))
    bf16 = [torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))]
    with pytest.raises(StoreConfigError, match="torch.bfloat16"):
        stream_optimizer_state(torch.optim.AdamW(bf16), dir=str(tmp_path))


def test_root_errors(tmp_path):
    missing = tmp_path / "no" / "such" / "root"
    with pytest.raises(StoreConfigError, match="neither does its parent"):
        stream_optimizer_state(make_adamw(make_params()), dir=str(missing))
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(StoreConfigError, match="is not a directory"):
        stream_optimizer_state(make_adamw(make_params()), dir=str(afile))
    if os.geteuid() != 0:  # root bypasses permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(StoreConfigError, match="not writable"):
            stream_optimizer_state(make_adamw(make_params()), dir=str(ro))
    with pytest.raises(StoreConfigError, match="chunk_mb must be a positive host staging chunk"):
        stream_optimizer_state(make_adamw(make_params()), dir=str(tmp_path), chunk_mb=0)


def _existing_state(root):
    """Another store's files and an unrelated file that a failed construction must not touch."""
    other = root / "rank00000" / "opt9_99"
    other.mkdir(parents=True)
    (other / "bucket00000.bin").write_bytes(b"keep" * 1000)
    (root / "unrelated.txt").write_text("keep me")
    return {str(p): p.read_bytes() for p in (other / "bucket00000.bin", root / "unrelated.txt")}


def _unchanged(snapshot):
    return all(open(p, "rb").read() == data for p, data in snapshot.items())


def test_enospc_at_preallocation_is_clear_and_harmless(tmp_path, monkeypatch):
    snapshot = _existing_state(tmp_path)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    params = make_params()
    with pytest.raises(StoreConfigError, match="no space left to preallocate"):
        stream_optimizer_state(make_adamw(params), dir=str(tmp_path))
    assert _unchanged(snapshot)
    assert sorted(os.listdir(tmp_path / "rank00000")) == ["opt9_99"]


def test_not_enough_free_space_on_a_small_filesystem(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root; the ENOSPC injection test covers the path")
    try:
        snapshot = _existing_state(mnt)
        params = [torch.nn.Parameter(torch.randn(1_000_000))]  # 8 MB of moments on a 1 MiB filesystem
        with pytest.raises(StoreConfigError, match=r"not enough free space .* need 7\.6\d MiB"):
            stream_optimizer_state(torch.optim.AdamW(params), dir=str(mnt))
        assert _unchanged(snapshot)
        assert sorted(os.listdir(mnt / "rank00000")) == ["opt9_99"]
    finally:
        subprocess.run(["umount", str(mnt)])


def test_bind_after_state_exists_is_rejected(tmp_path):
    params = make_params()
    opt = make_adamw(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(StoreConfigError, match="before the first optimizer step"):
        stream_optimizer_state(opt, dir=str(tmp_path))


def test_ranks_sharing_a_new_root_start_concurrently(tmp_path):
    """The ranks of a node share one root that none of them has created yet: no rank may mistake the
    root another rank is creating for a bad path."""
    import threading

    root = tmp_path / "shared-root"
    errors, stores = [], []

    def start(rank):
        try:
            params = [torch.nn.Parameter(torch.randn(100))]
            stores.append(stream_optimizer_state(torch.optim.AdamW(params), dir=str(root), rank=rank))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    for _ in range(20):
        threads = [threading.Thread(target=start, args=(r,)) for r in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in stores:
            s.close()
        stores.clear()
        assert not errors, errors
        assert not root.exists() or os.listdir(root) == []
        if root.exists():
            root.rmdir()
