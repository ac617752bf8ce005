"""Read-ahead into the host tier (store.fill_host_tier): a load or set_io drops the tier's images, and
the store reads the buckets back into the tier on the I/O threads, so the step after a resume finds
them in host RAM. The fill runs in the background (release_device does not wait for it), stops at the
tier's budget, surfaces its I/O errors at the next step, and the resumed run stays bit-identical.
"""

import errno
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import _restarted_process, assert_same, load, restart, save, state, train  # noqa: E402,F401
from test_host_tier import DiskSpy, images, resident_run, tiered  # noqa: E402

from miles_plugins.optimizers.nvme_stream import StorePoisonedError  # noqa: E402
from miles_plugins.optimizers.streaming.io import engine as engine_mod  # noqa: E402


def streamed(store):
    """Buckets with state in their files (a param that never had a grad has no moments to read)."""
    return {b.index for b in store.buckets if b.segments_to_fetch()}


def saved_then_resumed(tmp_path, kind, fraction, **kw):
    """Train 2 steps, save, restart, load into a fresh store with a tier of `fraction` of the state."""
    params, opt, store = tiered(kind, tmp_path / "live", fraction, **kw)
    train(params, opt, range(2))
    save(params, store, str(tmp_path / "ckpt"))
    restart()
    params, opt, store = tiered(kind, tmp_path / "live", fraction, **kw)
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True
    return params, opt, store


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_the_step_after_a_load_reads_the_tier_not_the_disk(tmp_path, monkeypatch, kind):
    ref = resident_run(kind, range(4))
    params, opt, store = saved_then_resumed(tmp_path, kind, 1.0)
    assert set(images(store)) == streamed(store)
    store.stager.wait_all()  # the fill has landed (in a run: during the rollout after the load)
    spy = DiskSpy(monkeypatch)
    train(params, opt, range(2, 3))
    last = store.stats.last_step
    assert spy.reads == 0 and last.disk_bytes_read == 0, "the step after the load read the disk"
    assert spy.writes == 0 and last.disk_bytes_written == 0, "the load's own write-back counted as the step's"
    assert last.tier_fill_bytes == last.cache_bytes_read == last.bytes_read > 0
    train(params, opt, range(3, 4))
    assert store.stats.last_step.tier_fill_bytes == 0
    assert_same(state(store, params), ref, "resumed through the filled tier")


def test_a_half_tier_fills_up_to_its_budget_and_the_step_reads_the_rest(tmp_path):
    ref = resident_run("plain", range(4))
    params, opt, store = saved_then_resumed(tmp_path, "plain", 0.5)
    held = len(images(store))
    assert 0 < held < len(streamed(store))
    assert store.stager.counters.fill_bytes_read <= store.host_cache_bytes
    train(params, opt, range(2, 4))
    first = store.stats.last_step
    assert first.disk_bytes_read > 0 and first.cache_bytes_read > 0
    assert len(images(store)) == held, "images are fixed once given"
    assert_same(state(store, params), ref, "half tier, resumed")


def test_the_fill_does_not_hold_release_device_and_the_step_waits_for_it(tmp_path, monkeypatch):
    ref = resident_run("sharded", range(3))
    params, opt, store = tiered("sharded", tmp_path / "live", 1.0)
    train(params, opt, range(2))
    save(params, store, str(tmp_path / "ckpt"))
    gate = threading.Event()
    real_read = engine_mod.pread_into

    def blocked(*args):  # every disk read (the fill's) waits for the gate
        gate.wait()
        return real_read(*args)
    monkeypatch.setattr(engine_mod, "pread_into", blocked)
    opener = threading.Timer(10, gate.set)  # a wrong release_device fails below instead of hanging
    opener.start()
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True
    store.release_device()  # a trainer going to sleep right after the load
    assert not gate.is_set(), "release_device waited for the tier's fill"
    gate.set()
    opener.cancel()
    train(params, opt, range(2, 3))  # reads the images once their fill has landed
    assert_same(state(store, params), ref, "a step after a fill in flight")


def test_a_failed_fill_poisons_the_store_at_the_next_step(tmp_path, monkeypatch):
    params, opt, store = tiered("plain", tmp_path / "live", 1.0)
    train(params, opt, range(2))
    save(params, store, str(tmp_path / "ckpt"))

    gate = threading.Event()

    def fail(*args):  # the fill's reads fail once the load has returned: in the background
        gate.wait()
        raise OSError(errno.EIO, "injected read error")
    monkeypatch.setattr(engine_mod, "pread_into", fail)
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True
    gate.set()
    with pytest.raises(OSError, match="injected read error"):
        train(params, opt, range(2, 3))
    assert store.poisoned_by is not None
    with pytest.raises(StorePoisonedError):
        train(params, opt, range(3, 4))
    monkeypatch.undo()
    assert load(params, opt, store, str(tmp_path / "ckpt")) is True  # the usual recovery
    assert store.poisoned_by is None


def test_set_io_fills_the_new_tier(tmp_path):
    ref = resident_run("plain", range(4))
    params, opt, store = tiered("plain", tmp_path / "live", 0)
    train(params, opt, range(2))
    assert store.fill_host_tier() == 0  # no tier
    store.set_io(host_cache_mb=64)
    assert set(images(store)) == streamed(store)  # set_io filled the new tier
    assert store.fill_host_tier() == 0  # nothing left to fill: every bucket has its image
    train(params, opt, range(2, 4))
    assert store.stats.last_step.disk_bytes_read == 0
    assert_same(state(store, params), ref, "after set_io filled the tier")


def test_the_sync_engine_has_no_tier_to_fill(tmp_path):
    params, opt, store = tiered("plain", tmp_path / "live", 0, io_engine="sync")
    train(params, opt, range(1))
    assert store.fill_host_tier() == 0


def test_a_resumed_trainer_refills_its_tier_while_asleep_and_trains_bit_identically(tmp_path):
    """The torch trainer's `--load` with a host tier holding the whole state: the load installs it in RAM,
    the trainer sleeps (as it does while the first rollout generates), and the first step after the wake
    reads the tier, not the disk; the weights match the run that never stopped."""
    from test_trainer_checkpoint import _args, _params, _rendezvous, _same, _samples

    from miles import checkpoint
    from miles.backends.torch_backend.trainer import TorchTrainer

    samples, adv = _samples()
    (tmp_path / "offload").mkdir()
    flags = ("--stream-optimizer-state-to-disk", "--offload-train-target=disk", "--offload-train",
             "--stream-optimizer-state-bucket-numel", "20000", "--stream-optimizer-state-host-cache-mb", "64")
    a = TorchTrainer(_args(tmp_path, *flags), rank=0, world_size=1, rank_dir=str(tmp_path / "a"))
    try:
        a.init(_rendezvous())
        for i in range(2):
            a.train(i, samples, adv)
        base = checkpoint.prepare(str(tmp_path / "ckpt"), 2)
        a.save(base)
        checkpoint.write_meta(base, next_rollout_id=2, data_state={"consumed_prompts": 8}, world_size=1)
        checkpoint.publish(str(tmp_path / "ckpt"), base)
        a.train(2, samples, adv)
        expected = _params(a)
    finally:
        a.shutdown()
    b = TorchTrainer(_args(tmp_path, *flags), rank=0, world_size=1, rank_dir=str(tmp_path / "b"))
    try:
        b.init(_rendezvous())
        b.load(checkpoint.resolve(str(tmp_path / "ckpt")), load_optimizer=True)
        # the tier holds the whole state in RAM only: the load put it there itself, with no read-ahead
        assert b.store.stats.ram_state_bytes == b.store.stats.state_bytes
        assert b.store.stager.counters.fill_bytes_read == 0
        assert not b.sleep()["skipped"]
        b.wake()
        b.train(2, samples, adv)
        last = b.store.stats.last_step
        assert last.disk_bytes_read == 0 and last.cache_bytes_read > 0
        assert _same(_params(b), expected)
    finally:
        b.shutdown()


def test_verify_checks_what_the_fill_reads(tmp_path):
    """With verify on, the tier's read-ahead checks each chunk against what the store wrote: a file
    changed on disk while the tier was off is caught at the next step, not trained on."""
    from miles_plugins.optimizers.nvme_stream import StateCorruptionError

    params, opt, store = tiered("sharded", tmp_path / "live", 0, verify=True)
    train(params, opt, range(3))
    store.flush()
    bucket = store.buckets[1]
    seg = bucket.layout.segments["exp_avg"]
    with open(bucket.file.path, "r+b") as f:
        f.seek(seg.offset + 100)
        byte = f.read(1)
        f.seek(seg.offset + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    try:
        store.set_io(host_cache_mb=64)  # the new tier is filled from the files
    except StateCorruptionError:
        pass  # the fill's chunk failed before set_io had submitted every bucket: raised (and poisoned) here
    else:
        with pytest.raises(StateCorruptionError, match=f"bucket {bucket.index}, segment exp_avg"):
            train(params, opt, range(3, 4))
    assert store.poisoned_by is not None
