"""The I/O engine behind the stager, and the store's pipeline over it (CPU).

pipelined == sync bit for bit, residency bound, read-ahead / write-behind ordering, O_DIRECT and its
fallback, chunk packing, and errors raised in worker threads."""

import errno
import logging
import os
import threading
import time

import pytest
import torch

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
from miles_plugins.optimizers.nvme_stream import StorePoisonedError, stream_optimizer_state
from miles_plugins.optimizers.streaming.io import engine as engine_mod
from miles_plugins.optimizers.streaming.io import stager as stager_mod
from miles_plugins.optimizers.streaming.io.stager import Stager, StoreConfigError, check_host_cache_budget

SIZES = ((37, 29), (1000,), (3,), (4099,), (257, 31), (5000,), (12345,), (7,))
BUCKET = 4096 + 50  # many buckets, split params


def make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SIZES]


def make_opt(params):
    return ShardedMixedPrecisionAdam([
        {"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0},
    ], betas=(0.9, 0.95))


def set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if (i == 2 and step == 1) else torch.randn(p.shape, generator=g).to(torch.bfloat16)


def file_bytes(store):
    store.flush()
    out = []
    for b in store.buckets:  # through the descriptor: a bucket in host RAM only has no file to open
        out.append(os.pread(b.file.fd, b.file.nbytes, 0))
    return out


def run(tmp_path, name, steps=5, prefetch=False, **kwargs):
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path / name), bucket_numel=BUCKET, **kwargs)
    history = []
    for k in range(steps):
        if prefetch:
            store.prefetch()
        set_grads(params, k)
        opt.step()
        history.append([p.detach().clone() for p in params])
        if k == 2:
            opt.param_groups[1]["lr"] = 1e-3
    return store, history


@pytest.mark.parametrize("variant", [
    dict(depth=2),
    dict(depth=1, prefetch=True, direct_io=False),
    dict(depth=3, prefetch=True, host_cache_mb=1),
    dict(depth=2, write_behind=False, io_threads=1),
    dict(depth=2, prefetch=True, moment_dtype="bf16"),
])
def test_pipelined_is_bit_identical_to_sync(tmp_path, variant):
    variant = dict(variant)
    moment_dtype = variant.pop("moment_dtype", "fp32")
    ref, ref_hist = run(tmp_path, "sync", io_engine="sync", moment_dtype=moment_dtype)
    store, hist = run(tmp_path, "pipe", moment_dtype=moment_dtype, **variant)
    assert store.stats.num_buckets >= 8 and store.stats.io_engine == "pipelined"
    for k, (a, b) in enumerate(zip(ref_hist, hist)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"params differ after step {k + 1}"
    assert file_bytes(ref) == file_bytes(store), "bucket files differ"
    # same logical volume, whatever came from disk, the host cache or still-resident buffers
    assert store.stats.bytes_read == ref.stats.bytes_read and store.stats.bytes_written == ref.stats.bytes_written
    last = store.stats.last_step
    assert last.disk_bytes_read + last.cache_bytes_read + last.reused_bytes == last.bytes_read
    ref.close()
    store.close()


def test_residency_bound_from_stats(tmp_path):
    store, _ = run(tmp_path, "pipe", depth=2, prefetch=True)
    s = store.stats
    assert s.residency_bound_bytes == 5 * s.bucket_inflight_bytes == 5 * s.max_bucket_bytes
    assert s.max_bucket_bytes < s.peak_resident_bytes <= s.residency_bound_bytes  # several buckets in flight
    assert s.last_step.peak_resident_bytes <= s.residency_bound_bytes
    assert s.last_step.compute_seconds > 0 and s.last_step.io_seconds >= 0
    assert abs(s.last_step.io_seconds + s.last_step.compute_seconds - s.last_step.wall_seconds) < 1e-6
    assert 0 < s.resident_bytes <= 2 * store.depth * s.bucket_inflight_bytes  # between steps: ahead + behind
    assert s.last_step.prefetched_buckets == 2
    assert s.last_step.reused_bytes > 0  # the buckets written last were still resident: no read
    store.flush()
    assert s.resident_bytes == 0
    assert all(f.untyped_storage().nbytes() == 0 for b in store.buckets for f in b.flat.values())
    store.close()

    sync, _ = run(tmp_path, "sync", io_engine="sync")
    assert sync.stats.depth == 0 and sync.stats.residency_bound_bytes == sync.stats.max_bucket_bytes
    assert 0 < sync.stats.peak_resident_bytes <= sync.stats.max_bucket_bytes
    assert sync.stats.resident_bytes == 0  # nothing behind
    sync.close()


def test_host_cache_serves_hot_buckets_from_ram(tmp_path):
    store, _ = run(tmp_path, "pipe", depth=1, host_cache_mb=1, steps=4)
    last = store.stats.last_step
    assert last.cache_bytes_read > 0
    assert last.disk_bytes_read + last.cache_bytes_read + last.reused_bytes == last.bytes_read
    store.close()


class SlowWrites:
    """Delay every pwrite so that write-behind is really still in flight when the step returns."""

    def __init__(self, monkeypatch, delay=0.02):
        self.done = 0
        self.lock = threading.Lock()
        real = engine_mod.pwrite_all

        def slow(fd, buffers, offset):
            time.sleep(delay)
            real(fd, buffers, offset)
            with self.lock:
                self.done += 1
        monkeypatch.setattr(engine_mod, "pwrite_all", slow)


def test_write_behind_is_waited_by_reads_prefetch_and_close(tmp_path, monkeypatch):
    ref, ref_hist = run(tmp_path, "sync", io_engine="sync", steps=4)
    slow = SlowWrites(monkeypatch)
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path / "pipe"), bucket_numel=BUCKET, depth=2, direct_io=False)
    for k in range(4):
        set_grads(params, k)
        opt.step()
        assert store.stats.last_step.pending_writes > 0, "the step should return before its last writes land"
        assert all(torch.equal(a, b) for a, b in zip(ref_hist[k], params))
        if k == 2:
            opt.param_groups[1]["lr"] = 1e-3
        # the next step's first buckets are the ones written last: their reads wait for those writes
        store.prefetch()
    # a read of a bucket whose write is in flight returns what was written (after the write lands)
    for b, rb in zip(store.buckets, ref.buckets):
        b.fetch(store.stager, b.segments_to_fetch())
        rb.fetch(ref.stager, rb.segments_to_fetch())
        assert all(torch.equal(b.flat[n], rb.flat[n]) for n in b.segment_names)
        b.release()
        rb.release()
    set_grads(params, 4)
    opt.step()
    assert store.stats.last_step.pending_writes > 0
    done_before = slow.done
    store.close()  # waits for the write-behind: every submitted write ran before the files closed
    assert slow.done > done_before
    assert store.stager.engine.error is None  # no write hit a closed file
    assert not any(store.stager.writes_in_flight(b.file) for b in store.buckets)
    assert not os.path.exists(store.path)
    ref.close()


def test_step_end_to_end_and_flush_land_every_write(tmp_path, monkeypatch):
    SlowWrites(monkeypatch, delay=0.01)
    store, _ = run(tmp_path, "pipe", steps=2, direct_io=False)
    assert store.stats.last_step.pending_writes > 0
    store.flush()
    assert not any(store.stager.writes_in_flight(b.file) for b in store.buckets)
    store.close()
    store, _ = run(tmp_path, "nowb", steps=2, write_behind=False)
    assert store.stats.last_step.pending_writes == 0 and store.stats.resident_bytes == 0
    store.close()


def test_direct_io_is_used_on_a_disk_that_has_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=engine_mod.__name__):
        store, _ = run(tmp_path, "pipe", steps=2, direct_io=True)
    if "falling back to buffered" in caplog.text:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    assert "uses O_DIRECT" in caplog.text
    assert all(b.file.dfd >= 0 for b in store.buckets)
    store.close()
    assert all(b.file.dfd == -1 and b.file.fd == -1 for b in store.buckets)


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK), reason="no /dev/shm")
def test_direct_io_on_tmpfs_works_or_falls_back_with_a_log_line(tmp_path, caplog):
    root = f"/dev/shm/miles-test-engine-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    try:
        with caplog.at_level(logging.INFO, logger=engine_mod.__name__):
            ref, ref_hist = run(tmp_path, "sync", io_engine="sync", steps=3)
            params = make_model()
            opt = make_opt(params)
            store = stream_optimizer_state(opt, dir=root, bucket_numel=BUCKET, direct_io=None)
            for k in range(3):
                set_grads(params, k)
                opt.step()
                assert all(torch.equal(a, b) for a, b in zip(ref_hist[k], params))
        assert ("uses O_DIRECT" in caplog.text) != ("falling back to buffered" in caplog.text)
        store.close()
        ref.close()
    finally:
        import shutil
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("where", ["open", "io"])
def test_o_direct_refused_falls_back_with_a_log_line(tmp_path, monkeypatch, caplog, where):
    def refuse(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")
    if where == "open":
        monkeypatch.setattr(stager_mod, "open_direct", refuse)
    else:  # the open succeeds, the first direct transfer is refused (some filesystems do that)
        real_read, real_write = engine_mod.pread_into, engine_mod.pwrite_all
        direct_fds = set()
        real_open = stager_mod.open_direct

        def open_direct(path):
            fd = real_open(path)
            direct_fds.add(fd)
            return fd

        def gate(real):
            def io(fd, buffers, offset):
                if fd in direct_fds:
                    refuse()
                return real(fd, buffers, offset)
            return io
        monkeypatch.setattr(stager_mod, "open_direct", open_direct)
        monkeypatch.setattr(engine_mod, "pread_into", gate(real_read))
        monkeypatch.setattr(engine_mod, "pwrite_all", gate(real_write))
    ref, ref_hist = run(tmp_path, "sync", io_engine="sync", steps=3)
    with caplog.at_level(logging.INFO, logger=engine_mod.__name__):
        store, hist = run(tmp_path, "pipe", steps=3, direct_io=True)
    assert "O_DIRECT is not supported" in caplog.text and "falling back to buffered I/O" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)  # asked for explicitly: a warning
    assert store.stager.engine.direct is False
    for a, b in zip(ref_hist, hist):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert file_bytes(ref) == file_bytes(store)
    store.close()
    ref.close()


def test_error_in_a_read_worker_raises_from_step(tmp_path, monkeypatch):
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET)
    set_grads(params, 0)
    opt.step()
    calls = {"n": 0}
    real = engine_mod.pread_into

    def failing(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "injected read error")
        return real(fd, buffers, offset)
    monkeypatch.setattr(engine_mod, "pread_into", failing)
    assert threading.current_thread() is threading.main_thread()
    set_grads(params, 1)
    with pytest.raises(OSError, match="injected read error"):
        opt.step()
    assert store.stats.resident_bytes == 0  # the pipeline let go of everything
    with pytest.raises(StorePoisonedError, match="load_from"):  # a torn state is never stepped on
        opt.step()
    store.close()
    assert not os.path.exists(store.path)


@pytest.mark.parametrize("write_behind", [False, True])
def test_error_in_a_write_worker_raises(tmp_path, monkeypatch, write_behind):
    params = make_model()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET, write_behind=write_behind)
    real = engine_mod.pwrite_all

    def failing(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "injected write error")
    monkeypatch.setattr(engine_mod, "pwrite_all", failing)
    set_grads(params, 0)
    with pytest.raises(OSError, match="injected write error"):
        opt.step()  # several buckets later the failure is known; without write-behind, surely
        store.flush()  # write-behind: at the latest here
    monkeypatch.setattr(engine_mod, "pwrite_all", real)
    store.close()


def test_chunking_packs_small_shards_and_pads_for_o_direct(tmp_path):
    """Stager level: many small tensors in one request, chunks smaller than the request, tails that are
    not 4 KiB multiples: the file holds exactly the same bytes with both engines (padding zeros)."""
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=g) for n in (3, 1000, 1, 5000, 77, 4096, 2)]
    total = sum(t.numel() for t in srcs) * 4
    size = 3 * 4096 * 8
    results = []
    for name, kwargs in (("sync", dict(io_engine="sync")), ("pipe", dict(io_threads=3)),
                         ("buffered", dict(direct_io=False))):
        stager = Stager(torch.device("cpu"), chunk_bytes=8192, **kwargs)
        path = stager.prepare_directory(str(tmp_path), name, size).directory
        f = stager.create_file(os.path.join(path, "b.bin"), size)
        with open(f.path, "r+b") as fh:
            fh.write(b"\xff" * size)
        stager.write_async(f, 4096, srcs, pad_tail=True)
        stager.write_async(f, 4096 * 12, srcs[:2])
        back = [torch.empty_like(t) for t in srcs]
        stager.read_async(f, 4096, back)  # waits for the writes of the same file first
        stager.wait_reads(f)
        assert all(torch.equal(a, b) for a, b in zip(srcs, back))
        one = torch.empty(total // 4)
        stager.read(f, 4096, one)
        assert torch.equal(one, torch.cat(srcs))
        stager.wait_all()
        with open(f.path, "rb") as fh:
            data = fh.read()
        results.append(data)
        stager.close_file(f)
        stager.close()
    # the pipelined engine may zero the reserved tail of a padded write; the rest is identical
    end = 4096 + total
    pad_end = 4096 + engine_mod.align_up(total)
    for data in results:
        assert data[:end] == results[0][:end] and data[pad_end:] == results[0][pad_end:]
    assert results[1][end:pad_end] in (b"\x00" * (pad_end - end), b"\xff" * (pad_end - end))


def test_closing_a_file_forgets_it_and_frees_its_host_image(tmp_path):
    """The engine keeps per-file state by id(file); closing the file drops that state (after its
    requests end) and gives its host-cache image to the next file, which the budget could not fit
    otherwise."""
    size = 4 * 4096
    stager = Stager(torch.device("cpu"), chunk_bytes=8192, host_cache_bytes=size)
    path = stager.prepare_directory(str(tmp_path), "d", 2 * size).directory
    data = torch.arange(size // 4, dtype=torch.float32)
    first = stager.create_file(os.path.join(path, "a.bin"), size)
    stager.write(first, 0, [data])
    assert stager.is_cached(first, 0, size)
    stager.write_async(first, 0, [data + 1])  # still in flight (written behind) when the file closes
    stager.close_file(first)
    assert stager.engine._files == {}
    with open(os.path.join(path, "a.bin"), "rb") as fh:  # its last write landed before the close
        assert torch.equal(torch.frombuffer(bytearray(fh.read()), dtype=torch.float32), data + 1)
    second = stager.create_file(os.path.join(path, "b.bin"), size)
    stager.write(second, 0, [data * 2])
    assert stager.is_cached(second, 0, size)  # the freed image; the budget holds only one
    back = torch.empty_like(data)
    stager.read(second, 0, back)
    assert torch.equal(back, data * 2)
    stager.close_file(second)
    stager.close()


def test_host_cache_budget_check():
    check_host_cache_budget(0, None)
    check_host_cache_budget(2**30, None)  # no /proc/meminfo: nothing to compare with
    check_host_cache_budget(2**30, 2**30)
    with pytest.raises(StoreConfigError, match=r"host cache of 2.00 GiB asked for, but this host has 1.00 GiB"):
        check_host_cache_budget(2**31, 2**30)
    with pytest.raises(StoreConfigError, match="must be >= 0"):
        check_host_cache_budget(-1, 2**30)


def test_bad_engine_arguments_are_rejected(tmp_path):
    params = make_model()
    for kwargs, match in ((dict(io_engine="aio"), "io_engine"), (dict(depth=-1), "depth"),
                          (dict(io_threads=0), "io_threads"), (dict(host_cache_mb=-1), "host_cache_mb"),
                          (dict(host_cache_mb=2**40), "memory available")):
        with pytest.raises(StoreConfigError, match=match):
            stream_optimizer_state(make_opt(params), dir=str(tmp_path), **kwargs)
    assert os.listdir(tmp_path) == []
