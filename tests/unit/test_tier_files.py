"""RAM first, disk for the rest: with a host tier, a bucket the tier holds lives in host RAM only and has
no file on the live disk; files exist only for the buckets the tier cannot hold, and the disk is asked
only for their space. A save copies the RAM buckets straight into the checkpoint (each byte written
once); a load installs a checkpoint straight into them; a sleep with the whole state in RAM writes
nothing. "auto" leaves the run's other host memory free; a state larger than the RAM share and the free
disk together is refused before anything is allocated. `miles plan` predicts the same split.
"""

import os
import shutil
import sys
from collections import namedtuple

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import _restarted_process, assert_same, build, load, restart, save, state, train  # noqa: E402,F401
from test_host_tier import BUCKET_NUMEL, SHAPES, DiskSpy, resident_run, tier_mb  # noqa: E402

from miles_plugins.optimizers.nvme_stream import StoreConfigError  # noqa: E402
from miles_plugins.optimizers.streaming.io import stager as stager_mod  # noqa: E402
from miles_plugins.optimizers.streaming.units import MiB  # noqa: E402

STEPS = 4


def tiered(kind, root, fraction, **kw):
    """A store built with a host tier of `fraction` of the state (1.0: all of it)."""
    return build(kind, root, shapes=SHAPES, bucket_numel=BUCKET_NUMEL, host_cache_mb=tier_mb(kind, fraction), **kw)


def live_files(store) -> tuple[int, int]:
    """(bucket files, their bytes) in the store's live directory, as the disk sees them."""
    names = [n for n in os.listdir(store.path) if n.startswith("bucket")]
    return len(names), sum(os.path.getsize(os.path.join(store.path, n)) for n in names)


def expected_split(store, budget_bytes: int) -> tuple[int, int]:
    """(buckets that need a file, their bytes): the tier takes each bucket, in order, that still fits whole."""
    used = files = disk = 0
    for bucket in store.buckets:
        if used + bucket.layout.file_bytes <= budget_bytes:
            used += bucket.layout.file_bytes
        else:
            files, disk = files + 1, disk + bucket.layout.file_bytes
    return files, disk


# ---- 1. files only for what the tier cannot hold ------------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_a_partial_tier_leaves_files_only_for_the_rest(tmp_path, kind):
    ref = resident_run(kind, range(STEPS))
    params, opt, store = tiered(kind, tmp_path, 0.5)
    files, disk = expected_split(store, store.stats.host_cache_bytes)
    assert 0 < files < store.stats.num_buckets
    assert live_files(store) == (files, disk)
    train(params, opt, range(STEPS))
    store.flush()
    assert live_files(store) == (files, disk), "a step or a flush made files for the buckets in RAM"
    assert store.stats.ram_state_bytes == store.stats.state_bytes - disk
    assert_same(state(store, params), ref, "half the state in RAM, half in files")


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_the_whole_state_in_the_tier_has_no_bucket_files(tmp_path, monkeypatch, kind):
    params, opt, store = tiered(kind, tmp_path, 1.0)
    assert live_files(store) == (0, 0)
    spy = DiskSpy(monkeypatch)
    train(params, opt, range(2))
    store.flush()
    store.release_device()  # what a trainer's sleep calls
    assert spy.reads == spy.writes == 0, "steps, a flush or a sleep with every bucket in RAM touched the disk"
    assert live_files(store) == (0, 0)


def test_a_tier_of_exactly_the_state_serves_every_write_from_ram(tmp_path, monkeypatch):
    """host_cache_mb='auto' sizes the tier to the state exactly, leaving nothing for write-back images:
    the RAM buckets' writes must still land in their memory, not go through staging and a file write."""
    from miles_plugins.optimizers.streaming import store as store_mod

    state_bytes = tiered("plain", tmp_path / "probe", 1.0)[2].stats.state_bytes
    monkeypatch.setattr(store_mod, "available_host_memory", lambda: 64 * state_bytes)
    params, opt, store = build("plain", tmp_path / "run", shapes=SHAPES, bucket_numel=BUCKET_NUMEL, host_cache_mb="auto",
                               host_cache_reserve_mb=0)
    assert store.stats.ram_state_bytes == store.stats.state_bytes == store.host_cache_bytes
    spy = DiskSpy(monkeypatch)
    written = store.stager.counters.disk_bytes_written
    train(params, opt, range(2))
    assert spy.reads == spy.writes == 0, "a step with the whole state in RAM wrote through a file descriptor"
    assert store.stager.counters.disk_bytes_written == written


def test_the_disk_check_asks_only_for_the_files(tmp_path, monkeypatch):
    """A disk with room for the files of the buckets the tier cannot hold, not for the whole state."""
    probe = tiered("plain", tmp_path / "probe", 0.5)[2]
    files_bytes, state_bytes = expected_split(probe, probe.stats.host_cache_bytes)[1], probe.stats.state_bytes
    restart()
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(stager_mod.shutil, "disk_usage",
                        lambda p: usage(real(p).total, 0, files_bytes + (state_bytes - files_bytes) // 2))
    params, opt, store = tiered("plain", tmp_path / "live", 0.5)
    train(params, opt, range(2))
    assert live_files(store)[1] == files_bytes


def test_a_state_larger_than_the_ram_share_and_the_free_disk_is_refused_before_any_allocation(tmp_path, monkeypatch):
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(stager_mod.shutil, "disk_usage", lambda p: usage(real(p).total, 0, 1 * MiB))
    built = []
    monkeypatch.setattr(stager_mod.Stager, "__init__",
                        lambda self, *a, **kw: built.append(1) or pytest.fail("the stager was built"))
    with pytest.raises(StoreConfigError, match=r"does not fit this rank's host RAM share and disk: the host tier "
                                               r"holds .* the other .* need files under .* which has 1\.00 MiB free"):
        tiered("plain", tmp_path / "live", 0.5)
    assert built == [] and not (tmp_path / "live" / "rank00000").exists()


# ---- 2. checkpoints write the RAM buckets directly ----------------------------------------------------
class WriteCounter:
    """Bytes written: to the live files by the I/O engine, and into checkpoints by the save's copies."""

    def __init__(self, monkeypatch):
        self.live = DiskSpy(monkeypatch)
        self.copied = 0
        real = stager_mod.copy_with_crc

        def counted(src, dst, nbytes, *args, **kw):
            if dst is not None:
                self.copied += nbytes
            return real(src, dst, nbytes, *args, **kw)
        monkeypatch.setattr(stager_mod, "copy_with_crc", counted)


@pytest.mark.parametrize("kind, background", [("plain", False), ("sharded", True)])
def test_a_save_with_the_state_in_ram_writes_each_byte_once_and_resumes_bit_identically(
        tmp_path, monkeypatch, kind, background):
    ref = resident_run(kind, range(STEPS + 2))
    params, opt, store = tiered(kind, tmp_path / "live", 1.0)
    train(params, opt, range(STEPS))
    at_save = state(store, params)
    counter = WriteCounter(monkeypatch)
    written0 = store.stager.counters.disk_bytes_written
    save(params, store, str(tmp_path / "ckpt"), wait=not background)
    train(params, opt, range(STEPS, STEPS + 1))  # overwrites the RAM buckets while a background copy may run
    store.wait_for_save()
    assert counter.live.writes == 0 and store.stager.counters.disk_bytes_written == written0, \
        "the save wrote the live state to disk before copying it"
    assert counter.copied == store.stats.state_bytes, "each byte of the state goes into the checkpoint once"
    saved = [f for f in (tmp_path / "ckpt").rglob("bucket*.bin")]
    assert sum(f.stat().st_size for f in saved) == store.stats.state_bytes
    monkeypatch.undo()

    restart()
    params, opt, store = tiered(kind, tmp_path / "live", 1.0)
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True
    assert live_files(store) == (0, 0)
    assert store.stager.counters.fill_bytes_read == 0, "the load put the state into RAM itself"
    assert_same(state(store, params), at_save, "loaded into RAM")
    spy = DiskSpy(monkeypatch)
    train(params, opt, range(STEPS, STEPS + 2))
    assert spy.reads == spy.writes == 0
    assert_same(state(store, params), ref, "resumed from RAM")


def test_a_partial_tier_saves_and_resumes_bit_identically(tmp_path):
    ref = resident_run("sharded", range(STEPS + 1))
    params, opt, store = tiered("sharded", tmp_path / "live", 0.5, verify=True)
    train(params, opt, range(STEPS))
    save(params, store, str(tmp_path / "ckpt"))
    restart()
    params, opt, store = tiered("sharded", tmp_path / "live", 0.5, verify=True)
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True
    train(params, opt, range(STEPS, STEPS + 1))
    assert_same(state(store, params), ref, "half in RAM, half in files, resumed")


# ---- 3. "auto" leaves the run's other host memory free ------------------------------------------------
def test_auto_leaves_the_runs_other_host_memory_free_and_says_so(tmp_path, monkeypatch, caplog):
    from miles_plugins.optimizers.streaming import store as store_mod

    available = 16 * 1024 * MiB + 5 * MiB  # the node reserve, and 5 MiB
    monkeypatch.setattr(store_mod, "available_host_memory", lambda: available)
    with caplog.at_level("INFO", logger=store_mod.__name__):
        store = build("plain", tmp_path, shapes=SHAPES, bucket_numel=BUCKET_NUMEL, host_cache_mb="auto",
                      host_cache_run_reserve_mb=3)[2]
    assert store.stats.host_cache_bytes == 2 * MiB
    assert "the run's other host memory 0.003 GB" in caplog.text


def test_the_run_reserve_is_checked():
    from miles_plugins.optimizers.streaming.config import StreamConfig, check_config

    with pytest.raises(StoreConfigError, match="host_cache_run_reserve_mb must be an integer >= 0"):
        check_config(StreamConfig(dir="/tmp/x", host_cache_run_reserve_mb=-1))


# ---- 4. miles plan predicts the split -----------------------------------------------------------------
def test_plan_predicts_the_split_and_the_floor_from_it():
    from miles.sizing.cli import main
    from miles.sizing.estimate import GB, Hardware, Training, estimate
    from miles.sizing.model_params import model_tensors
    from miles.sizing.presets import preset_config
    from miles.sizing.sharding import Parallelism

    model = model_tensors(preset_config("llama-9.2b-random"), "llama-9.2b-random")
    hw = Hardware(gpus_per_node=1, hbm_gb=140, host_ram_gb=125, disk_gb=64, host_tier_gb=60,
                  disk_read_gbps=2.0, disk_write_gbps=2.0, pcie_gbps=50.0)
    est = estimate(model, Parallelism(), hw, Training(moment_dtype="fp32"))
    split, s = est.floors, est.binding
    assert 9.1e9 < est.total_params < 9.3e9
    assert split.ram_bytes_per_rank + split.disk_bytes_per_rank == s.streamed_state_bytes
    assert 59 * GB < split.ram_bytes_per_rank <= 60 * GB  # whole buckets, as the store places them
    assert est.disk_bytes_per_node["streamed_state"] == split.disk_bytes_per_rank  # the files only
    disk_step = split.disk_bytes_per_rank / s.streamed_state_bytes * s.step_bytes
    ram_step = s.step_bytes - disk_step
    expected = disk_step / (2.0 * GB) + disk_step / (2.0 * GB) + ram_step / (50.0 * GB)
    assert split.tiered_seconds == pytest.approx(expected, rel=0.02)
    assert main(["--preset", "llama-9.2b-random", "--nodes", "1", "--gpus-per-node", "1", "--host-tier-gb", "60",
                 "--host-ram-gb", "125", "--disk-gb", "64"]) == 0
