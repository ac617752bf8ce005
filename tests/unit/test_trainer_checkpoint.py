"""The torch backend trainer in-process (world size 1, tiny model, no Ray): sleep/wake keeps training
bit-exact, and miles.checkpoint save/load resumes model + optimizer exactly (non-streamed state; the
streamed state's resume is covered end to end in tests/e2e)."""

import os
import socket

import pytest
import torch

from miles.backends.torch_backend.trainer import TorchTrainer
from miles.config import parse_args
from miles.preflight import validate_args
from miles.rollout.types import Sample


def _rendezvous():
    """A rendezvous address on loopback: ``127.0.0.1:<free port>``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _args(tmp_path, *extra):
    return validate_args(parse_args(["--tiny-model", "--micro-batch-size", "2",
                                     "--offload-train-disk-dir", str(tmp_path / "offload"),
                                     "--metrics-file", str(tmp_path / "metrics.jsonl"), *extra]))


def _samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        p = torch.randint(4, 90, (3 + i,), generator=g).tolist()
        r = torch.randint(4, 90, (2 + i % 3,), generator=g).tolist()
        out.append(Sample(index=i, prompt_index=i // 2, prompt_ids=p, response_ids=r,
                          response_logprobs=[-4.0] * len(r), response_text="", finish_reason="length"))
    return out, [1.0, -1.0, 0.5, -0.5]


def _params(trainer):
    return {k: v.detach().clone() for k, v in trainer.engine.model.state_dict().items()}


def _opt_state(trainer):
    opt = trainer.engine.optimizer
    masters = [s.master.detach().clone() for s in opt.shards]
    moments = [v.detach().clone() for st in opt.inner.state.values() for v in st.values() if torch.is_tensor(v)]
    return masters + moments


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def trainers():
    made = []
    yield made
    for t in made:
        t.shutdown()


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_sleep_wake_is_transparent_to_training(tmp_path, trainers, target):
    samples, adv = _samples()
    ref = TorchTrainer(_args(tmp_path / "ref"), rank=0, world_size=1)
    trainers.append(ref)
    ref.init(_rendezvous())
    for i in range(2):
        ref.train(i, samples, adv)
    ref.shutdown()
    trainers.remove(ref)
    expected = _params(ref)

    # the offloader itself: every weight and optimizer tensor moves (the sleep plan: test_sleep_plan_torch.py)
    args = _args(tmp_path, "--offload-train", "--offload-train-target", target, "--offload-train-plan", "offload-all")
    rank_dir = str(tmp_path / "rank")
    t = TorchTrainer(args, rank=0, world_size=1, rank_dir=rank_dir)
    trainers.append(t)
    t.init(_rendezvous())
    for i in range(2):
        t.train(i, samples, adv)
        before_p, before_o = _params(t), _opt_state(t)
        s = t.sleep()
        assert s["bytes"] > 0 and not s["skipped"]
        assert all(p.untyped_storage().nbytes() == 0 for p in t.engine.model.parameters())
        assert all(sh.master.untyped_storage().nbytes() == 0 for sh in t.engine.optimizer.shards)  # resident state too
        assert t.sleep()["skipped"]
        if target == "disk":
            assert os.path.getsize(os.path.join(rank_dir, "offload.bin")) == s["bytes"]
        t.wake()
        assert t.wake()["skipped"]
        assert _same(_params(t), before_p) and _same(_opt_state(t), before_o)
    assert _same(_params(t), expected)  # bit-identical to never sleeping
    t.shutdown()
    assert not os.path.exists(rank_dir)


def test_save_load_resumes_exactly(tmp_path, trainers):
    from miles import checkpoint

    samples, adv = _samples()
    a = TorchTrainer(_args(tmp_path), rank=0, world_size=1)
    trainers.append(a)
    a.init(_rendezvous())
    a.train(0, samples, adv)
    a.train(1, samples, adv)
    base = checkpoint.prepare(str(tmp_path / "ckpt"), 2)
    info = a.save(base)
    assert info["optimizer"] == "state_dict"
    checkpoint.write_meta(base, next_rollout_id=2, data_state={"consumed_prompts": 8}, world_size=1)
    checkpoint.publish(str(tmp_path / "ckpt"), base)
    assert checkpoint.resolve(str(tmp_path / "ckpt")) == base
    saved_p, saved_o = _params(a), _opt_state(a)
    a.train(2, samples, adv)
    after_a = _params(a)
    a.shutdown()

    b = TorchTrainer(_args(tmp_path, "--seed", "99"), rank=0, world_size=1)  # different initial weights
    trainers.append(b)
    b.init(_rendezvous())
    assert not _same(_params(b), saved_p)
    loaded = b.load(checkpoint.resolve(str(tmp_path / "ckpt")), load_optimizer=True)
    assert loaded["optimizer"] == "state_dict"
    assert _same(_params(b), saved_p) and _same(_opt_state(b), saved_o)
    b.train(2, samples, adv)
    assert _same(_params(b), after_a)


def test_load_without_optimizer_and_bad_world_size(tmp_path, trainers):
    from miles import checkpoint

    samples, adv = _samples()
    a = TorchTrainer(_args(tmp_path), rank=0, world_size=1)
    trainers.append(a)
    a.init(_rendezvous())
    a.train(0, samples, adv)
    base = checkpoint.prepare(str(tmp_path / "ckpt"), 1)
    a.save(base)
    checkpoint.write_meta(base, next_rollout_id=1, data_state={}, world_size=2)  # pretend: saved by 2 ranks
    saved = _params(a)
    a.shutdown()

    b = TorchTrainer(_args(tmp_path), rank=0, world_size=1)
    trainers.append(b)
    b.init(_rendezvous())
    with pytest.raises(checkpoint.CheckpointError, match="same data-parallel size"):
        b.load(base, load_optimizer=True)
    info = b.load(base, load_optimizer=False)  # --no-load-optim: weights only, masters follow the weights
    assert info["optimizer"] == "skipped" and _same(_params(b), saved)
    assert all(torch.equal(s.master, s.model_view.float()) for s in b.engine.optimizer.shards)


def test_resolve_without_checkpoint(tmp_path):
    from miles import checkpoint

    assert checkpoint.resolve(str(tmp_path)) is None
    assert checkpoint.resolve(str(tmp_path / "missing")) is None
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.publish(str(tmp_path), str(tmp_path / "rollout_000001"))


def test_sgd_optimizer_trains(tmp_path, trainers):
    samples, adv = _samples()
    t = TorchTrainer(_args(tmp_path, "--optimizer", "sgd", "--lr", "0.1"), rank=0, world_size=1)
    trainers.append(t)
    t.init(_rendezvous())
    before = _params(t)
    m = t.train(0, samples, adv)
    assert m["grad_norm"] > 0 and not _same(_params(t), before)


def test_data_cursor_resumes_at_any_batch_size():
    from miles.rl import arithmetic_task
    from miles.rl.data import PromptSource
    from miles.train import _DataCursor

    source = PromptSource(arithmetic_task(num_prompts=10, seed=3), seed=3)
    straight = _DataCursor(source).next_batch(12)  # crosses an epoch boundary
    c = _DataCursor(source)
    first = c.next_batch(4)
    resumed = _DataCursor(source, c.position)
    assert first + resumed.next_batch(3) + resumed.next_batch(5) == straight


def test_streamed_host_cache_is_used_and_changes_nothing(tmp_path, trainers):
    """--stream-optimizer-state-host-cache-mb reaches the store: from the second step on, reads come from
    host RAM, and the trained weights are bit-identical to streaming without the cache."""
    samples, adv = _samples()
    results = {}
    for cache_mb in ("0", "64"):
        (tmp_path / f"c{cache_mb}" / "offload").mkdir(parents=True)  # the driver creates the offload root
        args = _args(tmp_path / f"c{cache_mb}", "--stream-optimizer-state-to-disk", "--offload-train-target=disk",
                     "--stream-optimizer-state-bucket-numel", "20000",
                     "--stream-optimizer-state-host-cache-mb", cache_mb)
        t = TorchTrainer(args, rank=0, world_size=1, rank_dir=str(tmp_path / f"rank{cache_mb}"))
        trainers.append(t)
        t.init(_rendezvous())
        for i in range(3):
            t.train(i, samples, adv)
        last = t.store.stats.last_step
        results[cache_mb] = (_params(t), last.cache_bytes_read, last.bytes_read, t.store.stats.num_buckets)
        t.shutdown()
        trainers.remove(t)
    params0, cached0, _, _ = results["0"]
    params64, cached64, read64, buckets = results["64"]
    assert buckets > 1
    assert cached0 == 0
    assert 0 < cached64 <= read64  # the tiny model's state fits 64 MiB: at least some buckets hit the cache
    assert _same(params64, params0)


def test_streamed_device_budget_reaches_the_store(tmp_path, trainers):
    """--stream-optimizer-state-device-budget-mb reaches the store: its stats report the budget, the bound
    and the measured peak stay under it, and the weights are bit-identical to the default budget's."""
    samples, adv = _samples()
    results = {}
    for budget_mb in ("default", "1"):
        (tmp_path / f"b{budget_mb}" / "offload").mkdir(parents=True)  # the driver creates the offload root
        budget_flag = [] if budget_mb == "default" else ["--stream-optimizer-state-device-budget-mb", budget_mb]
        args = _args(tmp_path / f"b{budget_mb}", "--stream-optimizer-state-to-disk", "--offload-train-target=disk",
                     *budget_flag)
        t = TorchTrainer(args, rank=0, world_size=1, rank_dir=str(tmp_path / f"rank{budget_mb}"))
        trainers.append(t)
        t.init(_rendezvous())
        for i in range(2):
            t.train(i, samples, adv)
        results[budget_mb] = (_params(t), t.store.stats)
        t.shutdown()
        trainers.remove(t)
    (params0, default), (params1, budget) = results["default"], results["1"]
    assert budget.device_budget_bytes == 2**20 < default.device_budget_bytes
    assert budget.peak_resident_bytes <= budget.residency_bound_bytes <= budget.device_budget_bytes
    assert _same(params1, params0)


def test_store_config_leaves_defaults_to_the_store(tmp_path):
    from miles.config import store_config

    cfg = _args(tmp_path, "--stream-optimizer-state-to-disk", "--offload-train-target=disk")
    sc = store_config(cfg, rank=0, ranks_on_node=1)
    assert sc.device_budget_mb is None and sc.bucket_numel is None and sc.depth is None
    cfg = _args(tmp_path, "--stream-optimizer-state-to-disk", "--offload-train-target=disk",
                "--stream-optimizer-state-device-budget-mb", "512", "--stream-optimizer-state-bucket-numel", "1000")
    sc = store_config(cfg, rank=0, ranks_on_node=1)
    assert sc.device_budget_mb == 512 and sc.bucket_numel == 1000


def test_eps_clip_zero_reaches_the_loss(tmp_path, trainers, monkeypatch):
    """A validated --eps-clip 0 is 0 in the loss (it used to become 0.2 through `x or 0.2`)."""
    from miles.backends import step  # the rank's loss, handed to the engine

    seen = []
    real = step.policy_gradient_loss

    def spy(*a, **k):
        seen.append(k["eps_clip"])
        return real(*a, **k)

    monkeypatch.setattr(step, "policy_gradient_loss", spy)
    t = TorchTrainer(_args(tmp_path, "--eps-clip", "0", "--rollout-temperature", "0.5"), rank=0, world_size=1)
    trainers.append(t)
    t.init(_rendezvous())
    samples, adv = _samples()
    t.train(0, samples, adv)
    assert seen and all(e == 0.0 for e in seen)


def test_store_gets_its_own_chunk_flag(tmp_path):
    from miles.config import store_config

    cfg = _args(tmp_path, "--stream-optimizer-state-to-disk", "--offload-train-target=disk",
                "--stream-optimizer-state-chunk-mb", "8", "--offload-train-disk-chunk-mb", "32",
                "--stream-optimizer-state-moment-dtype", "bf16")
    sc = store_config(cfg, rank=3, ranks_on_node=1)
    assert sc.chunk_mb == 8 and sc.moment_dtype == "bf16" and sc.rank == 3
    assert sc.dir == cfg.paths.optimizer_state
