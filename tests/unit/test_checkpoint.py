"""Checkpoints of streamed optimizer state: exact resume, background save, verification errors.

"New process" resumes run in forked children of a parent that never built a store (so each child
starts from the same store identity, as a restarted job does). The harness here is shared by
test_checkpoint_crash.py and test_checkpoint_reshard.py. The save benchmark is `miles bench checkpoint`
(miles/bench/checkpoint.py).
"""

import json
import os
import tempfile
import time
import traceback
import types
import zlib

import pytest
import torch

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
from miles_plugins.optimizers.nvme_stream import NVMeOptimizerStateStore, StreamConfig, stream_optimizer_state
from miles_plugins.optimizers.streaming.bucket import StreamEntry
from miles_plugins.optimizers.streaming import codec
from miles_plugins.optimizers.streaming.checkpoint import save_load as checkpoint
from miles_plugins.optimizers.streaming.errors import CheckpointError

# torch builds its first optimizer slowly (lazy imports, seconds): do it once here, not in every fork.
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])

SHAPES = [(37, 29), (1000,), (3,), (4099,), (257, 31), (11,)]
BUCKET_NUMEL = 2000  # several buckets, params split across buckets


# ---- the training run -------------------------------------------------------------------------------
def make_params(dtype=torch.float32, shapes=SHAPES, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in shapes]


def groups_of(params):
    return [{"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
            {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)}]


def has_grad(step, rank, i):
    if i == 4 and step < 3:
        return False  # no Adam state at a step-3 checkpoint: buckets without moments
    if i == 5 and step < 2:
        return False  # state arrives late: its step count lags the others
    if i == 2 and step == 3:
        return False  # skipped on every rank
    return not (i == 1 and rank == 0 and step in (1, 4))  # absent on one rank only


def grad(step, rank, i, shape):
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + i)
    return torch.randn(shape, generator=g) * (0.1 + i)


def set_grads(params, step, rank=0, world=1, virtual_world=1):
    """Real DP: this rank's grads. virtual_world > 1 at DP=1: the fp32 average of that many ranks'
    grads, bit-identical to what the sharded optimizer's DP reduction computes (fp32 params only)."""
    for i, p in enumerate(params):
        ranks = [r for r in range(virtual_world) if has_grad(step, r, i)] if world == 1 else \
            ([rank] if has_grad(step, rank, i) else [])
        if virtual_world > 1:
            acc = torch.zeros(p.shape)
            for r in ranks:
                acc = acc + grad(step, r, i, p.shape)
            p.grad = (acc / virtual_world).to(p.device, p.dtype) if ranks else None
        else:
            p.grad = grad(step, rank, i, p.shape).to(p.device, p.dtype) if ranks else None


def build(kind, dir, dtype=None, bucket_numel=BUCKET_NUMEL, shapes=SHAPES, device="cpu", **kw):
    dtype = dtype or (torch.bfloat16 if kind == "sharded" else torch.float32)
    params = make_params(dtype, shapes, device)
    opt = (ShardedMixedPrecisionAdam(groups_of(params)) if kind == "sharded"
           else torch.optim.AdamW(groups_of(params)))
    store = stream_optimizer_state(opt, dir=str(dir), bucket_numel=bucket_numel, **kw)
    _OPEN_STORES.append(store)
    return params, opt, store


def train(params, opt, steps, rank=0, world=1, virtual_world=1):
    for k in steps:
        set_grads(params, k, rank, world, virtual_world)
        opt.param_groups[1]["lr"] = 3e-3 if k < 3 else 1e-3  # a schedule: read from the master groups
        opt.step()


def save(params, store, base, wait=True):
    """What the framework does: model weights, then the streamed state."""
    os.makedirs(base, exist_ok=True)
    tmp = os.path.join(base, f"model.pt.tmp{os.getpid()}")
    torch.save([p.detach().clone() for p in params], tmp)
    os.replace(tmp, os.path.join(base, "model.pt"))
    return store.save_to(base, wait=wait)


def load(params, opt, store, base):
    """Framework order: model weights -> reload masters (through the store) -> streamed state."""
    with torch.no_grad():
        for p, w in zip(params, torch.load(os.path.join(base, "model.pt"))):
            p.copy_(w)
    if hasattr(opt, "reload_model_params"):
        opt.reload_model_params()
    return store.load_from(base)


def state_parts(store):
    """{name: [(start, main, exp_avg, exp_avg_sq, step)]} per piece, read back from the files; moments
    and step are None where the piece has no Adam state."""
    parts = {}
    for b in store.buckets:
        b.fetch(store.stager, tuple(n for n in b.segment_names if n == "main" or b.moments_on_disk))
        for j, piece in enumerate(b.pieces):
            e = store.entries[piece.entry]
            st = b.optimizer.state.get(b.params[j])
            moments = tuple(b.moment_views[j][k].clone() for k in ("exp_avg", "exp_avg_sq")) if st else (None, None)
            parts.setdefault(e.name, []).append(
                (e.start + piece.start, b.params[j].clone(), *moments, float(st["step"]) if st else None))
        b.release()
    return parts


def gather(parts_per_rank, params=None):
    """Merge per-rank `state_parts` into {name: (main, exp_avg, exp_avg_sq, step)} over the full param,
    plus "params" (the model params, when given)."""
    merged = {}
    for parts in parts_per_rank:
        for name, ps in parts.items():
            merged.setdefault(name, []).extend(ps)
    out = {"params": None if params is None else [p.detach().clone() for p in params]}
    for name, ps in merged.items():
        ps.sort(key=lambda x: x[0])
        assert [p[0] for p in ps] == sorted({p[0] for p in ps}), f"{name}: overlapping pieces"
        steps = {p[4] for p in ps}
        assert len(steps) == 1, f"{name}: steps {steps}"
        cat = lambda k: None if ps[0][k] is None else torch.cat([p[k] for p in ps])  # noqa: E731
        out[name] = (cat(1), cat(2), cat(3), steps.pop())
    return out


def state(store, params=None):
    return gather([state_parts(store)], params)


def assert_same(a, b, what=""):
    assert a.keys() == b.keys(), f"{what}: {sorted(a)} vs {sorted(b)}"
    for name in a:
        if name == "params":
            if a[name] is not None and b[name] is not None:
                assert all(torch.equal(x, y) for x, y in zip(a[name], b[name])), f"{what}: model params"
            continue
        for k, (x, y) in enumerate(zip(a[name], b[name])):
            same = x == y if not isinstance(x, torch.Tensor) else isinstance(y, torch.Tensor) and torch.equal(x, y)
            assert same, f"{what}: {name} {['main', 'exp_avg', 'exp_avg_sq', 'step'][k]} differs"


_OPEN_STORES = []  # built by build(), not yet closed by restart()


def restart():
    """What a restarted process starts from: none of this process's stores is open, so the next store
    built takes the same identity (directory, checkpoint name) as the first one did."""
    while _OPEN_STORES:
        _OPEN_STORES.pop().close()


@pytest.fixture(autouse=True)
def _restarted_process():
    restart()
    yield
    restart()


def inject_faults(fault):
    """Call fault() at every point of a save where a kill matters: each chunk copied or checksummed, each
    file the copier opens, each fsync, each durable file, each rename of the publish. Wraps the stager
    functions the save calls (the product carries no test hook); for forked children: never undone."""
    io = checkpoint.io
    copy_with_crc, publish_dir, open_new = io.copy_with_crc, io.publish_dir, io.open_new

    def then_fault(fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            fault()
            return result
        return wrapped

    io.copy_with_crc = lambda *args, **kwargs: copy_with_crc(*args, **kwargs, on_chunk=fault)
    io.publish_dir = lambda tmp, final: publish_dir(tmp, final, on_step=fault)
    io.open_new = lambda path: (fault(), open_new(path))[1]
    for name in ("make_dirs", "close_fd", "write_file_durable", "fsync_dir"):
        setattr(io, name, then_fault(getattr(io, name)))


def start_copier_late(delay=0.5):
    """The save's copier thread starts `delay` s late, so the next steps reach every bucket before it
    and copy each first. For forked children: never undone."""
    run = checkpoint.SaveJob._run
    checkpoint.SaveJob._run = lambda job: (time.sleep(delay), run(job))[1]


def in_children(fn, argss, timeout=120):
    """Run fn(*args) for each args in `argss`, each in its own forked child, all at once (new processes
    holding no optimizer state; the parent has paid torch's import cost for them). Returns the results."""
    children = []
    for args in argss:
        fd, out = tempfile.mkstemp(suffix=".pt")
        os.close(fd)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.save(fn(*args), out)
                code = 0
            except BaseException:
                with open(out, "w") as f:
                    f.write(traceback.format_exc())
            finally:
                os._exit(code)
        children.append((pid, out))
    deadline, results, errors = time.monotonic() + timeout, [], []
    for pid, out in children:
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            errors.append(f"child {pid} timed out")
        elif os.waitstatus_to_exitcode(done[1]) != 0:
            with open(out, errors="replace") as f:
                errors.append(f"child failed ({done[1]}):\n{f.read()[-4000:]}")
        else:
            results.append(torch.load(out, weights_only=False))
        os.unlink(out)
    assert not errors, "\n".join(errors)
    return results


def in_child(fn, *args):
    """Run fn(*args) in a forked child (a new process with no optimizer state); return its result."""
    return in_children(fn, [args])[0]


# ---- exact resume -----------------------------------------------------------------------------------
def _run6(kind, root):
    params, opt, store = build(kind, root)
    train(params, opt, range(6))
    return state(store, params)


def _run3_save(kind, root, base, background):
    params, opt, store = build(kind, root)
    train(params, opt, range(3))
    at_save = state(store, params)
    if background:  # a copier that starts late: the next step reaches every bucket first and copies it
        start_copier_late()
    stats = save(params, store, base, wait=not background)
    # In the background case the next steps overwrite buckets while the copy runs: it must still
    # capture step 3's state.
    train(params, opt, range(3, 6))
    stats = store.wait_for_save() if background else stats
    return at_save, state(store, params), stats


def _load_run3(kind, root, base):
    params, opt, store = build(kind, root)
    assert load(params, opt, store, base) is True
    loaded = state(store, params)
    train(params, opt, range(3, 6))
    return loaded, state(store, params)


@pytest.mark.parametrize("kind, background", [("plain", False), ("sharded", True)])
def test_resume_is_bit_identical(tmp_path, kind, background):
    ref = in_child(_run6, kind, tmp_path / "live")
    at_save, after, stats = in_child(_run3_save, kind, tmp_path / "live", str(tmp_path / "iter3"), background)
    assert stats["bytes"] > 0 and stats["blocked_seconds"] >= 0 and stats["seconds"] > 0
    assert_same(after, ref, "saving must not change training")
    loaded, resumed = in_child(_load_run3, kind, tmp_path / "live", str(tmp_path / "iter3"))
    assert_same(loaded, at_save, "state after load")
    assert (stats["copied_by_writer"] > 0) == background, stats
    assert_same(resumed, ref, "resumed run")
    manifest = json.loads((tmp_path / "iter3/nvme_opt_state/rank00000/opt0_0/manifest.json").read_text())
    assert manifest["group_steps"] == {"0": 3, "1": 3}
    assert {s["storage_dtype"] for s in manifest["segments"].values()} == {"float32"}
    assert set(manifest["segments"]) == ({"main", "exp_avg", "exp_avg_sq"} if kind == "sharded"
                                         else {"exp_avg", "exp_avg_sq"})
    assert not any(m["moments"] for m in manifest["buckets"] if all(p[0] == 4 for p in m["pieces"]))


def test_resident_adam_state_is_saved_and_restored(tmp_path):
    """Megatron's binding keeps native-fp32 params (router biases) under a small in-memory Adam
    (store.resident_adam); a checkpoint must carry its state too."""
    def run(steps, base_in=None, base_out=None, resident=True):
        restart()
        params = make_params()
        opt = torch.optim.AdamW(groups_of(params))
        entries = [StreamEntry(main=p, group=g, name=f"param{i}") for i, (p, g) in enumerate(
            (p, g) for g, group in enumerate(opt.param_groups) for p in group["params"])]
        extra = torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(5)))
        adam = torch.optim.AdamW([extra], lr=1e-2)
        store = NVMeOptimizerStateStore(entries, opt, StreamConfig(dir=str(tmp_path / "live"), rank=0,
                                                                    bucket_numel=BUCKET_NUMEL),
                                        resident_adam=types.SimpleNamespace(optimizer=adam) if resident else None)
        opt.step = store.step
        if base_in:
            with torch.no_grad():
                extra.copy_(torch.load(os.path.join(base_in, "extra.pt")))
            assert load(params, opt, store, base_in)
        for k in steps:
            extra.grad = grad(k, 0, 9, (7,))
            adam.step()
            train(params, opt, [k])
        if base_out:
            save(params, store, base_out)
            torch.save(extra.detach().clone(), os.path.join(base_out, "extra.pt"))
        streamed = state(store, params)
        store.close()
        return extra.detach().clone(), adam.state[extra]["exp_avg_sq"].clone(), streamed

    ref = run(range(6))
    run(range(3), base_out=str(tmp_path / "ck"))
    resumed = run(range(3, 6), base_in=str(tmp_path / "ck"))
    assert torch.equal(resumed[0], ref[0]) and torch.equal(resumed[1], ref[1])
    assert_same(resumed[2], ref[2], "streamed state")
    with pytest.raises(CheckpointError, match="holds the state of a resident Adam"):
        run([], base_in=str(tmp_path / "ck"), resident=False)


# ---- errors -----------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    """A sharded DP=1 checkpoint after 3 steps; returns (tmp_path, base, state dir)."""
    restart()
    params, opt, store = build("sharded", tmp_path / "live")
    train(params, opt, range(3))
    save(params, store, str(tmp_path / "ck"))
    store.close()
    restart()
    return tmp_path, str(tmp_path / "ck"), tmp_path / "ck/nvme_opt_state/rank00000/opt0_0"


def rewrite_manifest(d, m: dict) -> None:
    """Replace the manifest in directory `d` with `m`, its checksum recomputed: a consistent, other manifest."""
    m = {k: v for k, v in m.items() if k != "manifest_crc32"}
    m["manifest_crc32"] = zlib.crc32(json.dumps(m, sort_keys=True).encode())
    (d / "manifest.json").write_text(json.dumps(m))


def loaded_state(tmp_path, base, **kw):
    """The state a fresh sharded store (a restarted process) holds after loading `base`."""
    restart()
    params, opt, store = build("sharded", tmp_path / "live", **kw)
    assert load(params, opt, store, base)
    out = state(store)
    store.close()
    return out


def _expect_error(tmp_path, base, match, **kw):
    restart()
    params, opt, store = build(kw.pop("kind", "sharded"), tmp_path / "live", **kw)
    with pytest.raises(CheckpointError, match=match):
        if kw.get("shapes"):  # another model: its weights do not load either; the streamed state is the test
            store.load_from(base)
        else:
            load(params, opt, store, base)
    assert not any(b.moments_on_disk or b.optimizer.state for b in store.buckets), "reset to fresh state"
    train(params, opt, range(2))  # a failed load leaves a usable fresh store
    store.close()


def test_flipped_byte_names_the_file(saved):
    tmp_path, base, d = saved
    with open(d / "bucket00002.bin", "r+b") as f:
        f.seek(4100)
        byte = f.read(1)
        f.seek(4100)
        f.write(bytes([byte[0] ^ 0x10]))
    _expect_error(tmp_path, base, r"bucket00002\.bin: checksum mismatch")


def test_truncated_manifest_and_bucket(saved):
    tmp_path, base, d = saved
    with open(d / "bucket00001.bin", "r+b") as f:
        f.truncate(100)
    _expect_error(tmp_path, base, r"bucket00001\.bin: 100 bytes, the manifest says")
    text = (d / "manifest.json").read_text()
    (d / "manifest.json").write_text(text.replace('"version": 1', '"version": 2'))
    _expect_error(tmp_path, base, r"manifest\.json: manifest is truncated or unreadable \(its checksum does not match")
    (d / "manifest.json").write_text(text[: len(text) // 2])
    _expect_error(tmp_path, base, r"manifest\.json: manifest is truncated or unreadable")


def test_manifest_format_that_does_not_fit_the_bytes(saved):
    """Another moment format than the store's is converted on load (test_checkpoint_narrow.py), so the
    recorded format must fit the segment's bytes: a manifest that says bf16 over fp32 bytes is refused."""
    tmp_path, base, d = saved
    m = json.loads((d / "manifest.json").read_text())
    m["segments"]["exp_avg_sq"] = codec.make_moment_codecs("bf16")["exp_avg_sq"].describe()  # over fp32 bytes
    rewrite_manifest(d, m)
    _expect_error(tmp_path, base, r"exp_avg_sq of bucket00000.bin holds \d+ bytes, but its recorded format bf16 "
                  r"stores \d+ elements in \d+; the manifest does not describe the file")


def test_layout_mismatch_and_kind_mismatch(saved):
    tmp_path, base, _ = saved
    shapes = SHAPES[:3] + [(4090,)] + SHAPES[4:]
    _expect_error(tmp_path, base, r"entry 3: param3\[0:4099\] of 4099 \(group 1\) in checkpoint, param3\[0:4090\] "
                  r"of 4090 \(group 1\) now\) and cannot be mapped onto it: the checkpoint holds 6 params \(14153 elements\), "
                  r"this model 6 \(14144 elements\); first difference: param3: 4099 elements in the checkpoint, "
                  r"4090 elements now", shapes=shapes)
    _expect_error(tmp_path, base, "checkpoint holds fp32 masters and moments, this store streams moments only",
                  kind="plain")


def test_manifest_without_param_identities_loads_onto_the_same_layout(saved):
    """Checkpoints written before a binding gave its entries names (Megatron's, before this build) still
    load onto the same layout; only a reshard needs the names."""
    tmp_path, base, d = saved
    expected = loaded_state(tmp_path, base)
    m = json.loads((d / "manifest.json").read_text())
    m["entries"] = [{**e, "name": None, "start": 0, "stop": e["stop"] - e["start"], "full_numel": e["stop"] - e["start"]}
                    for e in m["entries"]]
    rewrite_manifest(d, m)
    assert_same(loaded_state(tmp_path, base), expected, "nameless manifest, same layout")
    _expect_error(tmp_path, base, "cannot be mapped onto it: entries without param identities|has entries without "
                  "param identities", bucket_numel=3000)


def test_other_bucket_size_reshards_exactly(saved):
    tmp_path, base, _ = saved
    assert_same(loaded_state(tmp_path, base, bucket_numel=3000), loaded_state(tmp_path, base), "bucket size 2000 -> 3000")


def test_no_streamed_state_returns_false_and_interrupted_save_is_an_error(tmp_path, caplog):
    restart()
    params, opt, store = build("plain", tmp_path / "live")
    os.makedirs(tmp_path / "old")
    with caplog.at_level("WARNING"):
        assert store.load_from(str(tmp_path / "old")) is False
    assert "has no streamed optimizer state" in caplog.text
    os.makedirs(tmp_path / "cut/nvme_opt_state/rank00000/opt0_0.tmp-123")
    with pytest.raises(CheckpointError, match=r"no complete state of store opt0_0 .*interrupted save"):
        store.load_from(str(tmp_path / "cut"))
    store.close()


def test_save_failure_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    restart()
    params, opt, store = build("plain", tmp_path / "live")
    train(params, opt, range(2))
    (tmp_path / "ro").write_text("a file where a directory must go")
    with pytest.raises((CheckpointError, OSError)):
        store.save_to(str(tmp_path / "ro"))
    monkeypatch.setattr(checkpoint.io, "copy_with_crc", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "ENOSPC")))
    store.save_to(str(tmp_path / "ok"), wait=False)
    train(params, opt, range(2, 3))  # the guard's copy fails: the step still runs
    with pytest.raises(CheckpointError, match="ENOSPC"):
        store.wait_for_save()
    assert not (tmp_path / "ok/nvme_opt_state/rank00000/opt0_0").exists()
    assert not list((tmp_path / "ok/nvme_opt_state/rank00000").iterdir()), "temporary files removed"
    store.close()
