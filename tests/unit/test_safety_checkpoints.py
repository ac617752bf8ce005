"""Safety of checkpoints and of the store's lifetime (issue 22, items 3, 4, 6, 7, 14, 15): no checkpoint
deleted by a store or a re-save, no code run from a checkpoint, no crash from a crafted manifest, the
documented recovery on a poisoned store, and a dropped store that cleans up after itself."""

import gc
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import weakref
import zlib

import pytest
import torch

from miles_plugins.optimizers.nvme_stream import (CheckpointError, StoreConfigError, StorePoisonedError,
                                                  stream_optimizer_state)
from miles_plugins.optimizers.streaming.io import engine as engine_mod

from test_store import make_adamw, make_params, streamed_moments
from test_checkpoint_confinement import _edit_manifest

BUCKET = 4096 + 100


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _train(opt, params, steps, first=0):
    for k in range(first, first + steps):
        _grads(params, k)
        opt.step()


def _tree(path):
    """{relative path: bytes} of every file under `path`."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def _trained_store(directory, steps=2):
    params = make_params()
    opt = make_adamw(params)
    store = stream_optimizer_state(opt, dir=str(directory), bucket_numel=BUCKET)
    _train(opt, params, steps)
    return store, opt, params


# ---- 3. a store directory and a checkpoint never overlap ------------------------------------------
@pytest.fixture
def checkpoint_x(tmp_path):
    """A checkpoint base X holding the streamed state of a closed store."""
    store, _, _ = _trained_store(tmp_path / "live")
    store.save_to(str(tmp_path / "X"))
    store.close()
    return tmp_path / "X"


@pytest.mark.parametrize("inside", ["nvme_opt_state", "", "nvme_opt_state/rank00000/opt0_0", "model"])
def test_store_directory_inside_a_checkpoint_is_refused_before_anything_is_deleted(checkpoint_x, inside):
    before = _tree(checkpoint_x)
    params = make_params()
    with pytest.raises(StoreConfigError, match=r"inside the checkpoint .*X.*choose a store directory outside"):
        stream_optimizer_state(make_adamw(params), dir=str(checkpoint_x / inside), bucket_numel=BUCKET)
    assert _tree(checkpoint_x) == before


def test_store_directory_with_a_streamed_component_is_refused(tmp_path):
    with pytest.raises(StoreConfigError, match="nvme_opt_state"):
        stream_optimizer_state(make_adamw(make_params()), dir=str(tmp_path / "a" / "nvme_opt_state"))
    assert not os.path.exists(tmp_path / "a")


def test_save_to_or_load_from_inside_the_store_directory_is_refused(tmp_path):
    store, _, _ = _trained_store(tmp_path / "live")
    inside = os.path.join(store.path, "ck")
    for call in (store.save_to, store.load_from):
        with pytest.raises(CheckpointError, match=r"overlaps the store's live directory .*opt0_0.*outside"):
            call(inside)
    assert not os.path.exists(inside)
    store.close()
    assert os.listdir(tmp_path / "live") == []


# ---- 4. re-saving the rollout `latest` names keeps a loadable checkpoint -----------------------------
def _complete_checkpoint(save, completed, payload):
    from miles import checkpoint
    base = checkpoint.prepare(save, completed)
    os.makedirs(os.path.join(base, "model"))
    with open(os.path.join(base, "model", "weights"), "w") as f:
        f.write(payload)
    checkpoint.write_meta(base, next_rollout_id=completed, data_state={"payload": payload}, world_size=1)
    checkpoint.publish(save, base)
    return base


def _loadable(save):
    from miles import checkpoint
    base = checkpoint.resolve(save)
    with open(os.path.join(base, "model", "weights")) as f:
        return checkpoint.read_meta(base)["data_state"]["payload"], f.read()


def test_resaving_the_latest_rollout_keeps_it_loadable_until_the_new_one_is_published(tmp_path):
    from miles import checkpoint
    save = str(tmp_path / "save")
    final = _complete_checkpoint(save, 2, "old")
    base = checkpoint.prepare(save, 2)  # resumed from an older checkpoint: the same rollout again
    assert base == final
    assert _loadable(save) == ("old", "old")  # a crash here: --load still finds the old checkpoint
    os.makedirs(os.path.join(base, "model"))
    with open(os.path.join(base, "model", "weights"), "w") as f:
        f.write("new")
    assert _loadable(save) == ("old", "old")
    checkpoint.write_meta(base, next_rollout_id=2, data_state={"payload": "new"}, world_size=1)
    assert _loadable(save) == ("old", "old")
    checkpoint.publish(save, base)
    assert _loadable(save) == ("new", "new")
    assert sorted(os.listdir(save)) == [checkpoint.LATEST_FILE, "rollout_000002"]


def test_a_crash_while_setting_the_old_checkpoint_aside_leaves_it_loadable(tmp_path, monkeypatch):
    from miles import checkpoint
    save = str(tmp_path / "save")
    _complete_checkpoint(save, 2, "old")

    def crash(path, text):
        raise KeyboardInterrupt("killed between the rename and the marker")
    monkeypatch.setattr(checkpoint, "_atomic_write", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prepare(save, 2)
    monkeypatch.undo()
    assert _loadable(save) == ("old", "old")
    _complete_checkpoint(save, 2, "new")  # the next save of that rollout
    assert _loadable(save) == ("new", "new")
    assert sorted(os.listdir(save)) == [checkpoint.LATEST_FILE, "rollout_000002"]


def _unfinished_by(path, pid):
    """A checkpoint folder that a save of process ``pid`` (on this host) started and never finished."""
    from miles_plugins.host.ownership import CREATED_FILE
    os.makedirs(path)
    with open(os.path.join(path, CREATED_FILE), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": pid, "run_id": "dead-run", "since": 0.0}, f)


def test_next_save_cleans_what_interrupted_saves_set_aside(tmp_path):
    from miles import checkpoint
    save = str(tmp_path / "save")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _complete_checkpoint(save, 1, "one")
    _complete_checkpoint(save, 2, "two")
    os.rename(os.path.join(save, "rollout_000001"), os.path.join(save, f"rollout_000001.prev-{dead.pid}"))
    _unfinished_by(os.path.join(save, "rollout_000001"), dead.pid)  # its replacement never completed
    _complete_checkpoint(save, 3, "three")
    os.rename(os.path.join(save, "rollout_000003"), os.path.join(save, f"rollout_000003.prev-{dead.pid}"))
    _unfinished_by(os.path.join(save, "rollout_000003"), dead.pid)  # the replacement of 3 is incomplete, and ...
    with open(os.path.join(save, checkpoint.LATEST_FILE), "w") as f:
        f.write(f"rollout_000003.prev-{dead.pid}\n")  # ... latest names the copy set aside
    os.makedirs(os.path.join(save, "rollout_000002.prev-notapid"))  # not our naming: never touched
    os.makedirs(os.path.join(save, f"rollout_000002.prev-{os.getppid()}"))  # a live process's: left alone
    assert _loadable(save) == ("three", "three")
    _complete_checkpoint(save, 4, "four")
    names = sorted(os.listdir(save))
    assert names == sorted([checkpoint.LATEST_FILE, "rollout_000001", "rollout_000002", "rollout_000002.prev-notapid",
                            f"rollout_000002.prev-{os.getppid()}", "rollout_000003", "rollout_000004"])
    # an incomplete replacement gives way to the complete checkpoint set aside for it
    assert checkpoint.read_meta(os.path.join(save, "rollout_000001"))["data_state"]["payload"] == "one"
    assert checkpoint.read_meta(os.path.join(save, "rollout_000003"))["data_state"]["payload"] == "three"


# ---- 6. no code runs from a checkpoint ---------------------------------------------------------------
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _torch_checkpoint(tmp_path):
    from miles import checkpoint
    from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = ShardedMixedPrecisionAdam(list(model.parameters()), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    base = checkpoint.prepare(str(tmp_path / "save"), 1)
    checkpoint.save_train_state(base, model=model, optimizer=opt, store=None, rank=0, world_size=1)
    checkpoint.write_meta(base, next_rollout_id=1, data_state={}, world_size=1)
    return base, model, opt


def test_a_crafted_optimizer_file_is_refused_without_running_its_code(tmp_path):
    from miles import checkpoint
    base, model, opt = _torch_checkpoint(tmp_path)
    marker = str(tmp_path / "pwned")
    torch.save({"state": _RunsCode(marker)}, checkpoint.optimizer_file(base, 0))
    with pytest.raises(checkpoint.CheckpointError, match=r"rank00000\.pt.*cannot be loaded safely"):
        checkpoint.load_train_state(base, model=model, optimizer=opt, store=None, rank=0, world_size=1,
                                    load_optimizer=True)
    assert not os.path.exists(marker)


def test_resident_optimizer_states_round_trip_with_weights_only(tmp_path):
    from miles import checkpoint
    from miles.backends.megatron_backend.checkpoint_views import ResidentOptimizerState
    base, model, opt = _torch_checkpoint(tmp_path)
    saved = opt.state_dict()
    _train(opt, list(model.parameters()), 1)
    checkpoint.load_train_state(base, model=model, optimizer=opt, store=None, rank=0, world_size=1,
                                load_optimizer=True)
    assert all(torch.equal(a, b) for a, b in zip(saved["masters"], opt.state_dict()["masters"]))
    # Megatron's resident state: its members' inner torch optimizers over fp32 mains
    mains = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(3))]
    member = type("Member", (), {"optimizer": torch.optim.AdamW(mains, lr=1e-2, betas=(0.8, 0.95))})()
    _train(member.optimizer, mains, 2)
    state = ResidentOptimizerState(member)
    path = tmp_path / "megatron.pt"
    torch.save(state.state_dict(), path)
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    before = [p.detach().clone() for p in mains]
    with torch.no_grad():
        for p in mains:
            p.zero_()
    state.load_state_dict(loaded)
    assert all(torch.equal(a, b) for a, b in zip(before, mains))


# ---- 7. a crafted manifest is refused before any live file changes ----------------------------------


def _set_step(value):
    return lambda m: m["buckets"][1]["pieces"][0].__setitem__(3, value)


def _set(bucket, **fields):
    return lambda m: m["buckets"][bucket].update(fields)


def _offset(segment, value):
    return lambda m: m["buckets"][1]["segments"][segment].__setitem__(0, value)


def _deep_json(directory):
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)


def _symlinked_bucket(directory):
    """A bucket file that is a symbolic link to another bucket file of the same size in the checkpoint."""
    by_size = {}
    for name in sorted(n for n in os.listdir(directory) if n.startswith("bucket")):
        by_size.setdefault(os.path.getsize(os.path.join(directory, name)), []).append(name)
    target, link = next(names for names in by_size.values() if len(names) > 1)[:2]
    os.unlink(os.path.join(directory, link))
    os.symlink(target, os.path.join(directory, link))


BAD_MANIFESTS = {
    "moments false with steps": lambda d: _edit_manifest(d, _set(1, moments=False)),
    "step NaN": lambda d: _edit_manifest(d, _set_step(float("nan"))),
    "step -1": lambda d: _edit_manifest(d, _set_step(-1)),
    "step 0": lambda d: _edit_manifest(d, _set_step(0)),
    "step 1e300": lambda d: _edit_manifest(d, _set_step(1e300)),
    "step true": lambda d: _edit_manifest(d, _set_step(True)),
    "step abc": lambda d: _edit_manifest(d, _set_step("abc")),
    "step 10**400": lambda d: _edit_manifest(d, _set_step(10 ** 400)),
    "segment offset -4096": lambda d: _edit_manifest(d, _offset("exp_avg", -4096)),
    "segment offset unaligned": lambda d: _edit_manifest(d, _offset("exp_avg", 4095)),
    "segment past the file": lambda d: _edit_manifest(d, _offset("exp_avg_sq", 1 << 40)),
    "numel true": lambda d: _edit_manifest(d, _set(1, numel=True)),
    "200k-deep json": _deep_json,
    "bucket file symlinked inside the checkpoint": _symlinked_bucket,
}


@pytest.mark.parametrize("bad", list(BAD_MANIFESTS))
def test_crafted_manifest_is_refused_and_the_live_store_is_unchanged(tmp_path, bad):
    ref, ref_opt, ref_params = _trained_store(tmp_path / "ref")
    store, opt, params = _trained_store(tmp_path / "live")
    store.save_to(str(tmp_path / "ckpt"))
    _train(opt, params, 1, first=2)  # the live state moves past the checkpoint
    _train(ref_opt, ref_params, 1, first=2)
    BAD_MANIFESTS[bad](str(tmp_path / "ckpt" / "nvme_opt_state" / store.relative_dir))
    with pytest.raises(CheckpointError):
        store.load_from(str(tmp_path / "ckpt"))
    assert store.poisoned_by is None
    _train(opt, params, 1, first=3)
    _train(ref_opt, ref_params, 1, first=3)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    got, want = streamed_moments(store), streamed_moments(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [b.adam_steps() for b in store.buckets] == [b.adam_steps() for b in ref.buckets]
    store.close()
    ref.close()


def test_the_untouched_checkpoint_still_loads_bit_identically(tmp_path):
    ref, ref_opt, ref_params = _trained_store(tmp_path / "ref", steps=4)
    store, opt, params = _trained_store(tmp_path / "live")
    store.save_to(str(tmp_path / "ckpt"))
    saved = [p.detach().clone() for p in params]
    _train(opt, params, 1, first=2)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    assert store.load_from(str(tmp_path / "ckpt")) is True
    _train(opt, params, 2, first=2)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    store.close()
    ref.close()


# ---- 14. refresh on a poisoned store, then load_from: the documented recovery ---------------------
def test_refresh_then_load_from_recovers_a_poisoned_store(tmp_path, monkeypatch):
    ref, ref_opt, ref_params = _trained_store(tmp_path / "ref", steps=5)
    store, opt, params = _trained_store(tmp_path / "live", steps=3)
    store.save_to(str(tmp_path / "ckpt"))
    saved = [p.detach().clone() for p in params]
    real, seen = engine_mod.pwrite_all, [0]

    def failing(fd, buffers, offset):
        seen[0] += 1
        if seen[0] > 3:
            raise OSError(5, "Input/output error (injected)")
        return real(fd, buffers, offset)
    monkeypatch.setattr(engine_mod, "pwrite_all", failing)
    with pytest.raises(OSError, match="injected"):
        _train(opt, params, 1, first=3)
        store.flush()
    monkeypatch.setattr(engine_mod, "pwrite_all", real)
    assert store.poisoned_by is not None
    with torch.no_grad():  # Megatron's loader order: model weights, refresh, then load_from
        for p, s in zip(params, saved):
            p.copy_(s)
    store.refresh_main_from_model_params()
    assert store.poisoned_by is not None  # only a load clears it
    with pytest.raises(StorePoisonedError):
        opt.step()
    assert store.load_from(str(tmp_path / "ckpt")) is True
    _train(opt, params, 2, first=3)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params))
    store.close()
    ref.close()


# ---- 15. a dropped store cleans up: threads, descriptors, files -------------------------------------
def _io_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("miles-io"))


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


def _dropped_store(directory):
    store, opt, params = _trained_store(directory)
    assert _io_threads()
    return weakref.ref(store), store.path


def test_a_dropped_store_is_collected_with_its_threads_descriptors_and_files(tmp_path):
    gc.collect()
    threads, fds = _io_threads(), _open_fds()
    gone, path = _dropped_store(tmp_path / "live")
    gc.collect()
    assert gone() is None, "something keeps the dropped store alive"
    assert _io_threads() == threads
    assert _open_fds() <= fds
    assert not os.path.exists(path) and os.listdir(tmp_path / "live") == []


EXITS = textwrap.dedent("""
    import gc, sys, torch
    from miles_plugins.optimizers.nvme_stream import stream_optimizer_state
    def build(instance):
        p = [torch.nn.Parameter(torch.randn(5000))]
        opt = torch.optim.AdamW(p)
        store = stream_optimizer_state(opt, dir=sys.argv[1], bucket_numel=1000, instance=instance)
        p[0].grad = torch.randn(5000); opt.step()
        return opt, store
    kept = build(0)  # alive at exit
    build(1)  # dropped
    if sys.argv[2] == "collect":
        gc.collect()
    build(2)  # dropped, collected or not
""")


@pytest.mark.parametrize("collect", ["collect", "exit"])
def test_a_process_that_never_closes_its_stores_leaves_nothing(tmp_path, collect):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", EXITS, str(tmp_path), collect], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path) == []
