"""The sleep plan on the megatron backend (one GPU, in-process, tiny model): after every wake the weights
are torch.equal to what they were before the sleep, whichever way the plan chose (kept, rebuilt from the
store's masters in host RAM, written to disk), and 3 rollouts with the plan give the loss series and the
weights of the forced offload, bit for bit.

    python -m pytest -q tests/gpu/test_sleep_plan_gpu.py
"""

import dataclasses
import socket
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")

from megatron.core import parallel_state  # noqa: E402

from miles.backends.megatron_backend.trainer import MegatronTrainer  # noqa: E402
from miles.config import parse_args  # noqa: E402
from miles.preflight import validate_args  # noqa: E402
from miles.offload.plan import EngineNeeds  # noqa: E402

HUGE = EngineNeeds(kv_bytes=1 << 60)  # a KV pool no device has: the plan releases everything releasable


@pytest.fixture(autouse=True)
def _no_megatron_state_left():
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def _rendezvous() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _trainer(tmp_path, *extra) -> MegatronTrainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = ["--tiny-model", "--model-dtype", "bf16", "--micro-batch-size", "2", "--lr", "1e-3",
            "--offload-train-disk-dir", str(tmp_path / "disk"), "--offload-train", "--offload-train-target", "disk",
            "--stream-optimizer-state-to-disk", "--offload-train-plan", "auto", *extra]
    config = validate_args(parse_args(argv))
    config = dataclasses.replace(
        config, training=dataclasses.replace(config.training, train_backend="megatron"),
        optimizer=dataclasses.replace(config.optimizer, stream_optimizer_state_bucket_numel=20_000))
    trainer = MegatronTrainer(config, rank=0, world_size=1, rank_dir=config.paths.rank_dir(0, 0))
    trainer.init(_rendezvous())
    return trainer


def _rollout(step: int):
    g = torch.Generator().manual_seed(step)
    samples = []
    for i in range(4):
        prompt = torch.randint(4, 100, (5 + i,), generator=g).tolist()
        response = torch.randint(4, 100, (6,), generator=g).tolist()
        samples.append(SimpleNamespace(prompt_ids=prompt, response_ids=response,
                                       response_logprobs=(-torch.rand(6, generator=g) * 4).tolist()))
    return samples, [1.0, -1.0, 0.5, -0.5]


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.engine.gpt.state_dict().items() if torch.is_tensor(v)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rollouts(trainer, engine: EngineNeeds, engine_copy=None) -> tuple[list[float], list[dict], list[dict]]:
    """3 rollouts of train, sleep, wake; ``engine_copy(trainer, step)``: an engine holding the trainer's
    weights, whose copy the wake is handed."""
    losses, sleeps, wakes = [], [], []
    for step in range(3):
        losses.append(trainer.train(step, *_rollout(step))["loss"])
        before = _weights(trainer)
        rollout_engine = engine_copy(trainer, step) if engine_copy else None
        sleeps.append(trainer.sleep(engine))
        wakes.append(trainer.wake(rollout_engine.share_weights() if rollout_engine else None))
        if rollout_engine:
            rollout_engine.close()
        assert _same(_weights(trainer), before), f"rollout {step}: the weights changed across sleep/wake"
    return losses, sleeps, wakes


def test_plan_rebuilds_from_masters_and_trains_as_offload_all(tmp_path):
    forced = _trainer(tmp_path / "forced", "--stream-optimizer-state-host-cache-mb", "64",
                      "--offload-train-plan", "offload-all")
    ref_losses, ref_sleeps, _ = _rollouts(forced, HUGE)
    ref_weights = _weights(forced)
    forced.shutdown()

    planned = _trainer(tmp_path / "planned", "--stream-optimizer-state-host-cache-mb", "64")
    assert planned.store.mains_in_host_ram
    losses, sleeps, wakes = _rollouts(planned, HUGE)
    weights = _weights(planned)
    planned.shutdown()
    print(f"\nforced offload: sleep moved {[s['moved_bytes'] for s in ref_sleeps]}; plan: sleep moved "
          f"{[s['moved_bytes'] for s in sleeps]}, rebuilt from masters "
          f"{[w['rebuilt_from_masters_bytes'] for w in wakes]}")
    assert losses == ref_losses
    assert _same(weights, ref_weights)
    assert all(s["released_for_masters_bytes"] > 0 for s in sleeps)
    assert all(w["rebuilt_from_masters_bytes"] == s["released_for_masters_bytes"] for s, w in zip(sleeps, wakes))
    assert all(s["moved_bytes"] < r["moved_bytes"] for s, r in zip(sleeps, ref_sleeps))


def test_plan_keeps_what_fits_and_writes_what_has_no_other_source(tmp_path):
    trainer = _trainer(tmp_path / "a", "--stream-optimizer-state-host-cache-mb", "0")
    assert not trainer.store.mains_in_host_ram
    _, sleeps, wakes = _rollouts(trainer, EngineNeeds(kv_bytes=0))  # the engine needs nothing here: nothing moves
    assert all(s["moved_bytes"] == 0 and s["kept_bytes"] > 0 for s in sleeps)
    assert all(w["moved_bytes"] == 0 for w in wakes)
    _, sleeps, wakes = _rollouts(trainer, HUGE)  # masters on disk only: the weights go to RAM or disk
    assert all(s["released_for_masters_bytes"] == 0 and s["moved_bytes"] > 0 for s in sleeps)
    assert all(w["moved_bytes"] == s["moved_bytes"] for s, w in zip(sleeps, wakes))
    trainer.shutdown()


def _engine_holding(trainer, step):
    """An embedded engine holding the trainer's weights in HF layout, as after the handoff. On the CPU: its
    weights reach the trainer through /dev/shm, and the trainer's side (the inverse of the handoff's
    conversion, the copy) is what runs in the loop; the loop's CUDA IPC is the handoff's transport."""
    from miles.models import load_policy
    from miles.rollout.embedded import EmbeddedRolloutEngine

    hf_model, tokenizer, _ = load_policy(trainer.config)
    engine = EmbeddedRolloutEngine(model=hf_model.to(torch.bfloat16), tokenizer=tokenizer, device="cpu", backup="cpu")
    engine.begin_weight_update(step + 1)
    engine.update_weights_from_tensor(list(trainer.engine.hf_weights()), load_format=None)
    engine.end_weight_update(step + 1)
    return engine


def test_plan_rebuilds_from_the_engine_copy_through_the_inverse_conversion(tmp_path):
    forced = _trainer(tmp_path / "forced", "--offload-train-plan", "offload-all")
    ref_losses, _, _ = _rollouts(forced, HUGE)
    ref_weights = _weights(forced)
    forced.shutdown()

    planned = _trainer(tmp_path / "planned")
    copy_at_wake = EngineNeeds(kv_bytes=1 << 60, weight_bytes=1 << 20, copy_at_wake=True)
    losses, sleeps, wakes = _rollouts(planned, copy_at_wake, engine_copy=_engine_holding)
    weights = _weights(planned)
    planned.shutdown()
    assert losses == ref_losses and _same(weights, ref_weights)
    assert all(s["released_for_engine_bytes"] > 0 for s in sleeps)
    assert all(w["rebuilt_from_engine_bytes"] == s["released_for_engine_bytes"] for s, w in zip(sleeps, wakes))


def test_colocated_train_hands_back_the_cached_blocks(tmp_path):
    """Under --colocate the engine's weights come back on this device right after the train call, while the
    trainer is awake: free segments the caching allocator keeps (a forward's activations) must be returned.
    A 1 GiB block freed before the call stands for them (the tiny model's own allocations come from the small
    pool and never split it)."""
    trainer = _trainer(tmp_path, "--colocate")
    try:
        block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del block  # a free 1 GiB segment, kept reserved by the caching allocator
        trainer.train(0, *_rollout(0))
        reserved = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        still_cached = reserved - torch.cuda.memory_reserved()
    finally:
        trainer.shutdown()
    assert still_cached < 1 << 30, f"{still_cached} bytes of free segments stayed reserved after a colocated train call"


def test_the_cached_blocks_stay_when_the_engine_fits_beside_them(tmp_path):
    """Once the engine has said what it allocates and that fits beside the caching allocator's free blocks,
    neither the colocated train call nor the sleep returns them: the next forward reuses them instead of a
    cudaMalloc per segment."""
    trainer = _trainer(tmp_path, "--colocate")
    try:
        trainer.train(0, *_rollout(0))
        trainer.sleep(EngineNeeds(kv_bytes=1 << 30, weight_bytes=1 << 20))
        trainer.wake()
        block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del block
        trainer.train(1, *_rollout(1))
        cached_after_train = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        trainer.sleep()  # the engine as the last sleep was told
        cached_after_sleep = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        trainer.wake()
    finally:
        trainer.shutdown()
    assert cached_after_train >= 1 << 30 and cached_after_sleep >= 1 << 30, (cached_after_train, cached_after_sleep)
