"""The host tier (issue 17): write-back images of bucket files in host RAM (io/hostcache.py).

A write into a file with an image stays in RAM; the disk gets it on flush, save_to, a dropped image
(set_io, load_from) or a closed file. Read-ahead into the tier after a load: test_tier_fill.py. Bit-exactness against resident Adam at 0%, 50% and 100% of the
state in the tier; no disk I/O at all on steady steps when the tier holds every bucket; flush leaves
the files equal to the images; save/load through dirty images; write-back errors poison the store;
verify records the bytes that land; release_device frees the device without waiting for the disk.
"""

import errno
import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import (  # noqa: E402,F401  (_restarted_process: autouse fixture)
    _restarted_process, assert_same, build, groups_of, load, make_params, restart, save, state, train)

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam  # noqa: E402
from miles_plugins.optimizers.nvme_stream import CheckpointError, StateCorruptionError, StorePoisonedError  # noqa: E402
from miles_plugins.optimizers.streaming.io import engine as engine_mod  # noqa: E402
from miles_plugins.optimizers.streaming.io.stager import Stager  # noqa: E402
from miles_plugins.optimizers.streaming.units import MiB  # noqa: E402

# ~676k elements: 5.4 MB of moments (plain AdamW), 8.1 MB with the mains (sharded); 14 buckets
SHAPES = [(300, 1000), (1000,), (3,), (140999,), (257, 910), (11,)]
BUCKET_NUMEL = 50_000
STEPS = 5


def tier_mb(kind, fraction):
    """host_cache_mb holding about `fraction` of the state (1.0: all of it)."""
    if fraction == 0:
        return 0
    per_element = 12 if kind == "sharded" else 8
    state_bytes = per_element * sum(torch.Size(s).numel() for s in SHAPES)
    return max(1, round(fraction * state_bytes / MiB)) + (1 if fraction == 1 else 0)


def tiered(kind, root, fraction, **kw):
    """A store whose every bucket has a file, under a write-back tier of `fraction` of the state: set after
    construction (a tier given when the store is built holds its buckets in RAM only: test_tier_files.py)."""
    params, opt, store = build(kind, root, shapes=SHAPES, bucket_numel=BUCKET_NUMEL, **kw)
    if fraction:
        store.set_io(host_cache_mb=tier_mb(kind, fraction))
    return params, opt, store


def images(store):
    """{bucket index: its image slot} for the buckets the tier holds (write-back images, and buckets in RAM only)."""
    slots = {id(s.owner.file): s for s in store.stager.engine.cache.slots if s.owner is not None}
    homes = {id(b.file): store.stager.engine._state(b.file).slot for b in store.buckets if b.file.home is not None}
    return {b.index: {**slots, **homes}[id(b.file)] for b in store.buckets if id(b.file) in {**slots, **homes}}


def resident_run(kind, steps):
    """The same training with the optimizer state in memory: the reference, in state()'s format."""
    params = make_params(torch.bfloat16 if kind == "sharded" else torch.float32, SHAPES)
    opt = ShardedMixedPrecisionAdam(groups_of(params)) if kind == "sharded" else torch.optim.AdamW(groups_of(params))
    train(params, opt, steps)
    out = {"params": [p.detach().clone() for p in params]}
    mains = [s.master for s in opt.shards] if kind == "sharded" else params
    adam = opt.inner if kind == "sharded" else opt
    for i, main in enumerate(mains):
        st = adam.state.get(main)
        moments = (st["exp_avg"].view(-1).clone(), st["exp_avg_sq"].view(-1).clone()) if st else (None, None)
        out[f"param{i}"] = (main.detach().view(-1).clone(), *moments, float(st["step"]) if st else None)
    return out


class DiskSpy:
    """Counts the engine's preads and pwrites (the file primitives are called through engine.py's names)."""

    def __init__(self, monkeypatch):
        self.reads = self.writes = 0
        real_read, real_write = engine_mod.pread_into, engine_mod.pwrite_all

        def read(*args):
            self.reads += 1
            return real_read(*args)

        def write(*args):
            self.writes += 1
            return real_write(*args)
        monkeypatch.setattr(engine_mod, "pread_into", read)
        monkeypatch.setattr(engine_mod, "pwrite_all", write)


def file_bytes(bucket) -> bytes:
    with open(bucket.file.path, "rb") as f:
        return f.read()


# ---- bit-exact at every tier size -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "sharded"])
@pytest.mark.parametrize("fraction", [0, 0.5, 1.0])
def test_tier_is_bit_identical_to_resident_adam(tmp_path, kind, fraction):
    ref = resident_run(kind, range(STEPS))
    params, opt, store = tiered(kind, tmp_path, fraction)
    assert store.stats.num_buckets >= 10
    train(params, opt, range(STEPS))
    held = len(images(store))
    if fraction == 0:
        assert held == 0
    elif fraction == 1:
        assert held == store.stats.num_buckets
    else:
        assert 0 < held < store.stats.num_buckets
    last = store.stats.last_step
    assert last.disk_bytes_read + last.cache_bytes_read + last.reused_bytes == last.bytes_read
    assert_same(state(store, params), ref, f"{fraction:.0%} of the state in the host tier")
    store.flush()
    assert_same(state(store, params), ref, "after flush")
    store.set_io(host_cache_mb=0)  # the images go: every read from here on comes from the files
    assert images(store) == {}
    assert_same(state(store, params), ref, "read back from the files")


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_full_tier_steps_touch_no_disk(tmp_path, monkeypatch, kind):
    params, opt, store = tiered(kind, tmp_path, 1.0)
    train(params, opt, range(2))
    spy = DiskSpy(monkeypatch)
    train(params, opt, range(2, 4))
    last = store.stats.last_step
    assert last.bytes_read > 0 and last.bytes_written > 0
    assert last.disk_bytes_read == 0 and last.disk_bytes_written == 0
    assert last.cache_bytes_read + last.reused_bytes == last.bytes_read
    assert spy.reads == 0 and spy.writes == 0, "a step with every bucket in the tier touched the disk"
    assert last.io_task_seconds >= 0
    store.flush()  # the trainer's call before the files must hold the state: now they do
    assert spy.writes > 0 and spy.reads == 0


def test_zero_tier_steps_write_the_disk(tmp_path):
    params, opt, store = tiered("plain", tmp_path, 0)
    train(params, opt, range(3))
    last = store.stats.last_step
    assert last.disk_bytes_written == last.bytes_written > 0
    assert last.disk_bytes_read > 0 and last.cache_bytes_read == 0
    assert last.io_task_seconds > 0


def test_images_are_written_back_only_when_the_files_must_hold_them(tmp_path):
    params, opt, store = tiered("sharded", tmp_path, 1.0)
    train(params, opt, range(3))
    held = images(store)
    assert all(slot.dirty for slot in held.values())
    # write-back, not write-through: the files still hold what the store was built with (the evicted
    # mains, no moments)
    exp_avg = store.buckets[0].layout.segments["exp_avg"]
    assert set(file_bytes(store.buckets[0])[exp_avg.offset:exp_avg.offset + exp_avg.nbytes]) == {0}
    store.flush()
    for bucket in store.buckets:
        slot, data = held[bucket.index], file_bytes(bucket)
        assert slot.dirty == {}
        assert slot.valid, "every image holds its bucket"
        for start, stop in slot.valid:  # the file holds exactly the image's bytes
            assert data[start:stop] == bytes(slot.image[start:stop].numpy())
        for name, seg in bucket.layout.segments.items():
            if name == "main" or bucket.moments_on_disk:  # param 4 has no grads yet: no moments
                assert slot.covers(seg.offset, seg.offset + seg.nbytes), name


def test_release_device_frees_the_device_without_waiting_for_the_disk(tmp_path, monkeypatch):
    ref = resident_run("sharded", range(4))
    params, opt, store = tiered("sharded", tmp_path, 1.0, depth=2)
    train(params, opt, range(2))
    store.prefetch()  # nothing to read ahead from disk: every bucket is in the tier
    gate = threading.Event()
    real_write = engine_mod.pwrite_all

    def blocked(*args):  # a disk write would hold release_device until the gate opens
        gate.wait()
        return real_write(*args)
    monkeypatch.setattr(engine_mod, "pwrite_all", blocked)
    opener = threading.Timer(10, gate.set)  # a wrong release_device fails below instead of hanging
    opener.start()
    store.release_device()
    assert not gate.is_set(), "release_device waited for the disk"
    assert store.stats.resident_bytes == 0
    assert all(f.untyped_storage().nbytes() == 0 for b in store.buckets for f in b.flat.values())
    assert all(slot.dirty for slot in images(store).values()), "release_device wrote images back"
    train(params, opt, range(2, 4))  # the step after the sleep: still no disk
    assert not gate.is_set()
    opener.cancel()
    gate.set()
    assert_same(state(store, params), ref, "after release_device")


def test_release_device_without_a_tier_leaves_disk_writes_running(tmp_path, monkeypatch):
    ref = resident_run("plain", range(4))
    params, opt, store = tiered("plain", tmp_path, 0, depth=2)
    train(params, opt, range(2))
    store.flush()
    gate = threading.Event()
    real_write = engine_mod.pwrite_all
    landed = []

    def slow(*args):
        gate.wait()
        real_write(*args)
        landed.append(args[2])
    monkeypatch.setattr(engine_mod, "pwrite_all", slow)
    set_done = threading.Timer(0.5, gate.set)
    set_done.start()
    train(params, opt, range(2, 3))  # its writes wait for the gate; the step's write-behind is in flight
    store.release_device()
    assert store.stats.resident_bytes == 0
    train(params, opt, range(3, 4))  # orders itself after the writes still landing
    set_done.join()
    store.flush()
    assert landed
    assert_same(state(store, params), ref, "after release_device with writes in flight")


# ---- checkpoints through dirty images ---------------------------------------------------------------
@pytest.mark.parametrize("kind, background", [("plain", False), ("sharded", True)])
def test_save_with_dirty_images_resumes_bit_identically(tmp_path, kind, background):
    ref = resident_run(kind, range(4))
    params, opt, store = tiered(kind, tmp_path / "live", 1.0)
    train(params, opt, range(3))
    assert all(slot.dirty for slot in images(store).values())
    at_save = state(store, params)
    save(params, store, str(tmp_path / "ckpt"), wait=not background)
    assert all(not slot.dirty for slot in images(store).values())  # written back, and kept
    train(params, opt, range(3, 4))  # overwrites the images while a background copy may still run
    store.wait_for_save()
    assert_same(state(store, params), ref, "the run that saved")
    restart()
    params, opt, store = tiered(kind, tmp_path / "live", 1.0)
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True
    assert_same(state(store, params), at_save, "loaded")
    train(params, opt, range(3, 4))
    assert_same(state(store, params), ref, "resumed")


def test_load_from_replaces_dirty_images(tmp_path):
    """load_from rewrites the files: images of the state before it must never serve a read after."""
    params, opt, store = tiered("plain", tmp_path / "live", 1.0)
    train(params, opt, range(2))
    at_save = state(store, params)
    save(params, store, str(tmp_path / "ckpt"))
    train(params, opt, range(2, 4))  # the images now hold step 4, dirty
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True
    # the tier is read back from the loaded files (test_tier_fill.py): clean images of the checkpoint
    assert images(store) and all(not slot.dirty for slot in images(store).values())
    assert_same(state(store, params), at_save, "after load_from")


# ---- failures ---------------------------------------------------------------------------------------
def failing_writes(monkeypatch):
    def fail(*args):
        raise OSError(errno.EIO, "injected write-back error")
    monkeypatch.setattr(engine_mod, "pwrite_all", fail)


def test_a_failed_write_back_in_flush_poisons_the_store(tmp_path, monkeypatch):
    params, opt, store = tiered("plain", tmp_path / "live", 1.0)
    train(params, opt, range(2))
    save(params, store, str(tmp_path / "ckpt"))
    at_save = state(store, params)
    train(params, opt, range(2, 3))  # steps touch no disk: nothing fails yet
    failing_writes(monkeypatch)
    with pytest.raises(OSError, match="injected write-back error"):
        store.flush()
    assert store.poisoned_by is not None
    with pytest.raises(StorePoisonedError, match="load_from"):
        train(params, opt, range(3, 4))
    monkeypatch.undo()
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True  # the recovery
    assert store.poisoned_by is None
    assert_same(state(store, params), at_save, "recovered")


def test_a_failed_write_back_in_save_poisons_and_publishes_nothing(tmp_path, monkeypatch):
    params, opt, store = tiered("plain", tmp_path / "live", 1.0)
    train(params, opt, range(2))
    failing_writes(monkeypatch)
    with pytest.raises(OSError, match="injected write-back error"):
        save(params, store, str(tmp_path / "ckpt"))
    assert store.poisoned_by is not None
    assert not (tmp_path / "ckpt" / "nvme_opt_state").exists()
    with pytest.raises(StorePoisonedError):
        store.save_to(str(tmp_path / "ckpt"))


def test_close_does_not_write_images_of_files_it_removes(tmp_path, monkeypatch):
    params, opt, store = tiered("plain", tmp_path, 1.0)
    train(params, opt, range(2))
    spy = DiskSpy(monkeypatch)
    store.close()
    assert spy.writes == 0
    assert not os.path.exists(store.path)


# ---- verify ------------------------------------------------------------------------------------------
def test_verify_records_the_bytes_that_land(tmp_path):
    ref = resident_run("sharded", range(3))
    params, opt, store = tiered("sharded", tmp_path, 0.5, verify=True)
    train(params, opt, range(3))
    assert_same(state(store, params), ref, "verify with half the state in the tier")
    store.flush()
    bucket = next(b for b in store.buckets if b.index in images(store))
    seg = bucket.layout.segments["exp_avg_sq"]
    with open(bucket.file.path, "r+b") as f:  # corrupt what the write-back put on disk
        f.seek(seg.offset + 100)
        byte = f.read(1)
        f.seek(seg.offset + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    store.set_io(host_cache_mb=0)  # the next step reads that bucket from the file
    with pytest.raises(StateCorruptionError, match=f"bucket {bucket.index}, segment exp_avg_sq"):
        train(params, opt, range(3, 4))
    assert store.poisoned_by is not None


# ---- the engine: dirty chunks and reads that need the file ------------------------------------------
def test_partial_writes_and_uncovered_reads_write_dirty_chunks_back_first(tmp_path):
    size = 4 * 8192
    stager = Stager(torch.device("cpu"), chunk_bytes=8192, host_cache_bytes=size)
    path = stager.prepare_directory(str(tmp_path), "d", size).directory
    f = stager.create_file(os.path.join(path, "a.bin"), size)
    a = torch.arange(4096, dtype=torch.float32)  # 16 KiB: two dirty chunks of the image
    stager.write(f, 0, [a])
    with open(f.path, "rb") as fh:
        assert fh.read(16384) == bytes(16384)  # write-back: the file has nothing yet
    stager.write(f, 4096, [a[:1024] + 1])  # inside the first chunk only: that chunk goes to the file first
    expect = a.clone()
    expect[1024:2048] = a[:1024] + 1
    back = torch.empty(8192, dtype=torch.float32)  # [0, 32 KiB): the image holds only 16 KiB of it
    stager.read(f, 0, back)  # not covered by the image: its dirty chunks are written back, then read
    assert torch.equal(back[:4096], expect) and torch.equal(back[4096:], torch.zeros(4096))
    stager.write_back()
    with open(f.path, "rb") as fh:
        assert torch.equal(torch.frombuffer(bytearray(fh.read(16384)), dtype=torch.float32), expect)
    stager.close_file(f)
    stager.close()


# ---- host_cache_mb="auto" ----------------------------------------------------------------------------
def test_fit_host_cache_is_the_ranks_share_of_free_memory():
    from miles_plugins.optimizers.streaming.plan import fit_host_cache

    GiB = 1024 * MiB
    # (100 - 16) / 4 - 1 = 20 GiB of a 50 GiB state
    assert fit_host_cache(100 * GiB, 50 * GiB, 4, 16 * GiB, 1 * GiB) == 20 * GiB
    assert fit_host_cache(100 * GiB, 5 * GiB, 4, 16 * GiB, 1 * GiB) == 5 * GiB  # capped at the state
    assert fit_host_cache(10 * GiB, 5 * GiB, 1, 16 * GiB, 0) == 0  # the reserve takes it all: floored at 0
    assert fit_host_cache(100 * GiB, 50 * GiB, 8, 16 * GiB, 20 * GiB) == 0  # the rank reserve is larger
    assert fit_host_cache(100 * GiB, 50 * GiB, 1, 0, 0) == 50 * GiB


@pytest.mark.parametrize("field, value, match", [
    ("host_cache_mb", "big", "host_cache_mb must be an integer >= 0, the host tier in MiB .* or 'auto'"),
    ("host_cache_mb", -1, "host_cache_mb must be"),
    ("host_cache_mb", 1.5, "host_cache_mb must be"),
    ("host_cache_ranks_per_node", 0, "host_cache_ranks_per_node must be an integer >= 1"),
    ("host_cache_reserve_mb", -1, "host_cache_reserve_mb must be an integer >= 0"),
    ("host_cache_rank_reserve_mb", "1", "host_cache_rank_reserve_mb must be an integer >= 0"),
])
def test_host_cache_fields_are_checked(tmp_path, field, value, match):
    from miles_plugins.optimizers.nvme_stream import StoreConfigError, StreamConfig

    with pytest.raises(StoreConfigError, match=match) as e:
        StreamConfig(dir=str(tmp_path), **{field: value})
    assert e.value.field == field


def test_a_stream_config_checks_itself_when_built_and_when_replaced(tmp_path):
    """One place of the store's rules: a StreamConfig is valid from its construction, so nothing downstream
    (stream_optimizer_state, the store, set_io) checks it again; dataclasses.replace builds a new, checked one."""
    import dataclasses

    from miles_plugins.optimizers.nvme_stream import StoreConfigError, StreamConfig

    config = StreamConfig(dir=str(tmp_path), chunk_mb=8)
    with pytest.raises(StoreConfigError, match="chunk_mb must be a positive host staging chunk in MiB") as e:
        dataclasses.replace(config, chunk_mb=0)
    assert (e.value.field, e.value.expected) == ("chunk_mb", "a positive host staging chunk in MiB (default 256)")
    with pytest.raises(StoreConfigError, match="depth must be") as e:
        dataclasses.replace(config, depth=-1)
    assert e.value.field == "depth"
    from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

    params = [torch.nn.Parameter(torch.zeros(8))]
    with pytest.raises(TypeError, match="config must be a StreamConfig, got dict"):
        stream_optimizer_state(torch.optim.Adam(params), config={"dir": str(tmp_path)})


def test_auto_sizes_the_tier_from_mem_available_and_logs_it(tmp_path, monkeypatch, caplog):
    from miles_plugins.optimizers.streaming import store as store_mod

    available = {"bytes": 16 * 1024 * MiB + 4 * 3 * MiB}  # reserve + 3 MiB for each of 4 ranks
    monkeypatch.setattr(store_mod, "available_host_memory", lambda: available["bytes"])
    with caplog.at_level("INFO", logger=store_mod.__name__):
        params, opt, store = build("plain", tmp_path, shapes=SHAPES, bucket_numel=BUCKET_NUMEL,
                                   host_cache_mb="auto", host_cache_ranks_per_node=4, host_cache_rank_reserve_mb=1)
    assert store.stats.host_cache_bytes == 2 * MiB < store.stats.state_bytes
    assert "host tier (host_cache_mb='auto'): 0.002 GB" in caplog.text and "/ 4 ranks on the node" in caplog.text
    train(params, opt, range(3))
    assert 0 < len(images(store)) < store.stats.num_buckets
    assert_same(state(store, params), resident_run("plain", range(3)), "auto tier")
    available["bytes"] = 2**50  # a large host: capped at the state, every bucket in the tier
    store.set_io(host_cache_mb=0)
    store.set_io(host_cache_mb="auto")
    assert store.stats.host_cache_bytes == store.stats.state_bytes
    train(params, opt, range(3, 5))
    assert len(images(store)) == store.stats.num_buckets
    assert store.stats.last_step.disk_bytes_read == store.stats.last_step.disk_bytes_written == 0


def test_auto_without_meminfo_is_no_tier(tmp_path, monkeypatch, caplog):
    from miles_plugins.optimizers.streaming import store as store_mod

    monkeypatch.setattr(store_mod, "available_host_memory", lambda: None)
    params, opt, store = build("plain", tmp_path, shapes=SHAPES, bucket_numel=BUCKET_NUMEL, host_cache_mb="auto")
    assert store.stats.host_cache_bytes == 0
    assert "available memory cannot be read" in caplog.text


def test_the_run_flag_reaches_the_store_config():
    from miles.config import store_config
    from miles.config.arguments import parse_args
    from miles.preflight.validation import Environment, validate_args

    args = parse_args(["--stream-optimizer-state-to-disk", "--offload-train-target", "disk", "--num-train-ranks", "2",
                       "--stream-optimizer-state-host-cache-mb", "auto"])
    config = store_config(validate_args(args, Environment(cpu_count=lambda: 64)), rank=1, ranks_on_node=2)
    assert config.host_cache_mb == "auto" and config.host_cache_ranks_per_node == 2
    assert config.host_cache_rank_reserve_mb == 0


def test_a_trainer_shares_the_tier_with_the_ranks_of_its_node_only(tmp_path):
    """On a cluster the actor factory tells each rank how many train ranks its node holds; the auto tier
    divides the node's RAM by those, not by every rank of the run. In-process (no factory): all ranks."""
    from miles.config import store_config
    from miles.backends.torch_backend.trainer import TorchTrainer
    from miles.config.arguments import parse_args
    from miles.preflight.validation import Environment, validate_args

    args = parse_args(["--stream-optimizer-state-to-disk", "--offload-train-target", "disk", "--num-train-ranks", "8",
                       "--stream-optimizer-state-host-cache-mb", "auto",
                       "--offload-train-disk-dir", str(tmp_path / "root")])
    cfg = validate_args(args, Environment(cpu_count=lambda: 64))
    on_a_node_of_two = TorchTrainer(cfg, rank=5, world_size=8, ranks_on_node=2)
    alone = TorchTrainer(cfg, rank=5, world_size=8)
    assert store_config(cfg, 5, on_a_node_of_two.ranks_on_node).host_cache_ranks_per_node == 2
    assert store_config(cfg, 5, alone.ranks_on_node).host_cache_ranks_per_node == 8


# ---- the trainer's sleep ----------------------------------------------------------------------------
def test_trainer_sleep_releases_the_device_and_leaves_the_tier_dirty(tmp_path):
    """The torch trainer's sleep calls release_device, not flush: the host tier's images stay dirty
    through sleep and wake, and training is bit-identical to never sleeping."""
    from test_trainer_checkpoint import _args, _rendezvous, _samples, _same, _params
    from miles.backends.torch_backend.trainer import TorchTrainer

    samples, adv = _samples()
    results = {}
    for sleeps in (False, True):
        root = tmp_path / str(sleeps)
        (root / "offload").mkdir(parents=True)
        args = _args(root, "--stream-optimizer-state-to-disk", "--offload-train-target=disk",
                     "--stream-optimizer-state-bucket-numel", "20000",
                     "--stream-optimizer-state-host-cache-mb", "64", *(("--offload-train",) if sleeps else ()))
        t = TorchTrainer(args, rank=0, world_size=1, rank_dir=str(root / "rank"))
        try:
            t.init(_rendezvous())
            for i in range(3):
                t.train(i, samples, adv)
                if sleeps:
                    assert not t.sleep()["skipped"]
                    assert t.store.stats.resident_bytes == 0
                    assert any(slot.dirty or slot.home for slot in images(t.store).values()), "sleep wrote the tier back"
                    t.wake()
            results[sleeps] = _params(t)
        finally:
            t.shutdown()
    assert _same(results[True], results[False])


def test_a_load_drops_dirty_images_unwritten_and_a_refused_load_keeps_them(tmp_path, monkeypatch):
    """The load rewrites every file, so the tier's dirty images are not written back first (the disk
    would get bytes the load overwrites); a checkpoint that fails its checks leaves them as they were."""
    params, opt, store = tiered("plain", tmp_path / "live", 1.0)
    train(params, opt, range(2))
    save(params, store, str(tmp_path / "ckpt"))
    at_save = state(store, params)
    train(params, opt, range(2, 3))
    live = state(store, params)
    assert all(slot.dirty for slot in images(store).values())
    failing_writes(monkeypatch)  # a write-back would fail the load
    manifest = next((tmp_path / "ckpt").rglob("manifest.json"))
    good = manifest.read_bytes()
    manifest.write_bytes(good.replace(b'"file_bytes": ', b'"file_bytes": 1', 1))  # the checksum no longer fits
    with pytest.raises(CheckpointError):
        store.load_from(str(tmp_path / "ckpt"))  # the streamed state alone: the weights stay the live ones
    assert store.poisoned_by is None and all(slot.dirty for slot in images(store).values())
    assert_same(state(store, params), live, "after a refused load")
    manifest.write_bytes(good)
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True  # no write-back: the injected error never fires
    assert store.poisoned_by is None
    assert_same(state(store, params), at_save, "loaded over dirty images")


