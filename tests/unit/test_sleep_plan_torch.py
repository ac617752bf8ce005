"""The sleep plan executed by the torch backend (CPU, world size 1, tiny model): each way the plan picks
brings the weights back torch.equal, and training with the plan is bit-identical to offload-all."""

import socket

import pytest
import torch

from miles.backends.torch_backend.trainer import TorchTrainer
from miles.config import parse_args
from miles.preflight import validate_args
from miles.offload.plan import EngineNeeds
from miles.rollout.types import Sample

HUGE = EngineNeeds(kv_bytes=1 << 60)  # a KV pool no device has: the plan must release everything releasable
STREAM = ("--stream-optimizer-state-to-disk", "--stream-optimizer-state-bucket-numel", "20000")


def _rendezvous():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        p = torch.randint(4, 90, (3 + i,), generator=g).tolist()
        r = torch.randint(4, 90, (2 + i % 3,), generator=g).tolist()
        out.append(Sample(index=i, prompt_index=i // 2, prompt_ids=p, response_ids=r,
                          response_logprobs=[-4.0] * len(r), response_text="", finish_reason="length"))
    return out, [1.0, -1.0, 0.5, -0.5]


def _trainer(tmp_path, name, *extra):
    (tmp_path / name / "offload").mkdir(parents=True)
    config = validate_args(parse_args(["--tiny-model", "--micro-batch-size", "2", "--model-dtype", "bf16",
                                       "--offload-train", "--offload-train-target", "disk",
                                       "--offload-train-disk-dir", str(tmp_path / name / "offload"),
                                       "--metrics-file", str(tmp_path / name / "metrics.jsonl"),
                                       "--offload-train-plan", "auto", *extra]))
    t = TorchTrainer(config, rank=0, world_size=1, rank_dir=str(tmp_path / name / "rank"))
    t.init(_rendezvous())
    return t


def _weights(t):
    return {k: v.detach().clone() for k, v in t.engine.model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def trainers():
    made = []
    yield made
    for t in made:
        t.shutdown()


def _run(t, engine, rollouts=3):
    """Train, sleep, wake per rollout; after every wake the weights equal those before the sleep."""
    samples, adv = _samples()
    losses, sleeps, wakes = [], [], []
    for i in range(rollouts):
        losses.append(t.train(i, samples, adv)["loss"])
        before = _weights(t)
        sleeps.append(t.sleep(engine))
        wakes.append(t.wake())
        assert _same(_weights(t), before), f"rollout {i}: weights changed across sleep/wake"
    return losses, sleeps, wakes


def test_weights_come_back_from_the_masters_and_train_as_offload_all(tmp_path, trainers):
    ref = _trainer(tmp_path, "all", *STREAM, "--stream-optimizer-state-host-cache-mb", "64",
                   "--offload-train-plan", "offload-all")
    trainers.append(ref)
    ref_losses, ref_sleeps, _ = _run(ref, HUGE)
    assert ref_sleeps[0]["to_disk_bytes"] > 0 and ref_sleeps[0]["plan"] == "offload-all"

    t = _trainer(tmp_path, "plan", *STREAM, "--stream-optimizer-state-host-cache-mb", "64")
    trainers.append(t)
    assert t.store.mains_in_host_ram
    samples, adv = _samples()
    t.train(0, samples, adv)
    storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in t.engine.model.parameters()}
    s = t.sleep(HUGE)
    assert all(p.untyped_storage().nbytes() == 0 for p in t.engine.model.parameters())  # released, no copy
    assert s["released_for_masters_bytes"] == sum(storages.values()) > 0
    assert s["to_disk_bytes"] < s["released_for_masters_bytes"]  # only buffers had nowhere else to go
    w = t.wake()
    assert w["rebuilt_from_masters_bytes"] == s["released_for_masters_bytes"]
    assert {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in t.engine.model.parameters()} == storages
    t.shutdown()
    trainers.remove(t)

    t = _trainer(tmp_path, "plan2", *STREAM, "--stream-optimizer-state-host-cache-mb", "64")
    trainers.append(t)
    losses, sleeps, wakes = _run(t, HUGE)
    assert losses == ref_losses  # bit for bit: the same floats
    assert _same(_weights(t), _weights(ref))
    assert all(w["rebuilt_from_masters_bytes"] > 0 for w in wakes)
    assert all(s["moved_bytes"] < r["moved_bytes"] for s, r in zip(sleeps, ref_sleeps))


def test_without_masters_in_ram_the_plan_writes_to_the_target(tmp_path, trainers):
    t = _trainer(tmp_path, "disk", *STREAM, "--stream-optimizer-state-host-cache-mb", "0")
    trainers.append(t)
    assert not t.store.mains_in_host_ram
    _, sleeps, wakes = _run(t, HUGE, rollouts=2)
    assert sleeps[0]["released_for_masters_bytes"] == 0 and sleeps[0]["to_disk_bytes"] > 0
    assert any("masters not used" in n for n in sleeps[0]["plan_notes"])
    assert wakes[0]["from_disk_bytes"] == sleeps[0]["to_disk_bytes"]


def test_resident_state_and_room_to_spare(tmp_path, trainers):
    t = _trainer(tmp_path, "resident")
    trainers.append(t)
    _, sleeps, wakes = _run(t, HUGE, rollouts=2)  # no store: weights and Adam state to disk
    assert sleeps[0]["to_disk_bytes"] > 0 and wakes[0]["from_disk_bytes"] == sleeps[0]["to_disk_bytes"]
    _, sleeps, wakes = _run(t, EngineNeeds(kv_bytes=0), rollouts=1)  # the engine needs nothing: nothing moves
    assert sleeps[0]["moved_bytes"] == 0 and wakes[0]["moved_bytes"] == 0 and sleeps[0]["kept_bytes"] > 0
    assert all(p.untyped_storage().nbytes() > 0 for p in t.engine.model.parameters())


def _engine_holding(trainer, version):
    """An embedded engine (in-process, CPU) holding the trainer's weights, as after the handoff."""
    import copy

    from miles.rollout.embedded import EmbeddedRolloutEngine

    engine = EmbeddedRolloutEngine(model=copy.deepcopy(trainer.engine.model), tokenizer=trainer.engine.tokenizer, device="cpu",
                                   backup="cpu")
    engine.begin_weight_update(version)
    engine.update_weights_from_tensor(list(trainer.engine.hf_weights()), load_format=None)
    engine.end_weight_update(version)
    return engine


def test_weights_come_back_from_the_engine_copy(tmp_path, trainers):
    """The driver promises the engine's copy at the next wake: the weights are released without a copy and
    rebuilt from it, torch.equal, and 3 rollouts train as the forced offload."""
    copy_at_wake = EngineNeeds(kv_bytes=1 << 60, weight_bytes=1 << 20, copy_at_wake=True)
    ref = _trainer(tmp_path, "forced", "--offload-train-plan", "offload-all")
    trainers.append(ref)
    ref_losses, _, _ = _run(ref, HUGE)

    t = _trainer(tmp_path, "engine")
    trainers.append(t)
    samples, adv = _samples()
    losses = []
    for i in range(3):
        losses.append(t.train(i, samples, adv)["loss"])
        engine = _engine_holding(t, i + 1)
        before = _weights(t)
        weight_bytes = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in t.engine.model.parameters()}
        s = t.sleep(copy_at_wake)
        assert s["released_for_engine_bytes"] == sum(weight_bytes.values()) > 0  # freed without a copy
        assert all(p.untyped_storage().nbytes() == 0 for p in t.engine.model.parameters())
        w = t.wake(engine.share_weights())
        assert w["rebuilt_from_engine_bytes"] == s["released_for_engine_bytes"]
        assert _same(_weights(t), before)
        engine.close()
    assert losses == ref_losses and _same(_weights(t), _weights(ref))


def test_a_wake_without_the_promised_engine_copy_says_so(tmp_path, trainers):
    t = _trainer(tmp_path, "broken")
    trainers.append(t)
    samples, adv = _samples()
    t.train(0, samples, adv)
    t.sleep(EngineNeeds(kv_bytes=1 << 60, copy_at_wake=True))
    with pytest.raises(RuntimeError, match="was not handed it"):
        t.wake()


def test_an_engine_copy_in_another_dtype_is_refused(tmp_path, trainers):
    t = _trainer(tmp_path, "dtype")
    trainers.append(t)
    samples, adv = _samples()
    t.train(0, samples, adv)
    engine = _engine_holding(t, 1)
    engine.model.float()  # the engine now holds fp32: not a bit-equal copy of bf16 weights
    t.sleep(EngineNeeds(kv_bytes=1 << 60, copy_at_wake=True))
    with pytest.raises(RuntimeError, match="an exact rebuild needs both equal"):
        t.wake(engine.share_weights())
    engine.close()
