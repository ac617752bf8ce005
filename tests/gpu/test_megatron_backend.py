"""The megatron backend on one GPU: conversion through a real GPTModel, and MegatronTrainer in-process.

Run on the GPU host: ``python -m pytest -q -x tests/gpu/test_megatron_backend.py`` (needs CUDA and
megatron-core, which needs Python >= 3.12). Tiny models only; the file runs in well under 2 minutes.

Tolerances: with both models in fp32 the Megatron and transformers log-probs agree to < 1e-3 (only
reduction order differs); in bf16 (the trainer's dtype) to < 0.05.
"""

import dataclasses
import math
import os
import socket
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (megatron-core has no CPU path)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")
transformers = pytest.importorskip("transformers")

from megatron.core import parallel_state  # noqa: E402

from miles import checkpoint  # noqa: E402
from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf  # noqa: E402
from miles.backends.megatron_backend.model import build_gpt_model  # noqa: E402
from miles.backends.megatron_backend.trainer import MegatronTrainer  # noqa: E402
from miles.config import parse_args  # noqa: E402
from miles.preflight import validate_args  # noqa: E402
from miles.rl.loss import token_logprobs  # noqa: E402

FP32_LOGPROB_TOL = 1e-3
BF16_LOGPROB_TOL = 0.05


def _rendezvous() -> str:
    """A rendezvous address on loopback: ``127.0.0.1:<free port>``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def megatron_world():
    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", init_method=f"tcp://{_rendezvous()}", rank=0,
                                             world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture(autouse=True)
def _no_megatron_state_left():
    """A trainer that failed mid-init leaves megatron's process groups; later tests build their own."""
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def _tiny_hf(family: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if family == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return cls(config).cuda().eval()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_converted_weights_give_the_hf_logits(megatron_world, family):
    hf_model = _tiny_hf(family)
    gpt, _, uses_te = build_gpt_model(hf_model.config, params_dtype=torch.float32)
    gpt.cuda().eval()
    hf_state = hf_model.state_dict()
    mcore = hf_to_megatron(hf_state, hf_model.config, fused_norms=uses_te)
    built = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    assert built == set(mcore), f"missing {sorted(built - set(mcore))[:4]}, extra {sorted(set(mcore) - built)[:4]}"
    gpt.load_state_dict(mcore, strict=False)
    back = megatron_to_hf(gpt.state_dict(), hf_model.config, fused_norms=uses_te,
                          hf_moe_layout=hf_moe_layout(hf_state))
    assert set(back) == set(hf_state) and all(torch.equal(back[k].float(), hf_state[k].float()) for k in hf_state)

    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 128, (3, 24), device="cuda", generator=g)
    positions = torch.arange(24, device="cuda").expand(3, 24)
    with torch.no_grad():
        ours = token_logprobs(gpt(tokens, positions, None)[:, :-1], tokens[:, 1:])
        theirs = token_logprobs(hf_model(input_ids=tokens, position_ids=positions).logits[:, :-1], tokens[:, 1:])
    diff = (ours - theirs).abs().max().item()
    print(f"\n{family} ({'TE' if uses_te else 'local'} spec), fp32: max |logprob diff| {diff:.2e}")
    assert diff < FP32_LOGPROB_TOL


# ---- MegatronTrainer, driven in-process (world size 1, no Ray) ------------------------------------
def _config(tmp_path, *, stream: bool):
    tmp_path.mkdir(parents=True, exist_ok=True)  # a run creates its disk root, not the root's parents
    argv = ["--tiny-model", "--model-dtype", "bf16", "--micro-batch-size", "2", "--lr", "1e-3",
            "--offload-train-disk-dir", str(tmp_path / "disk")]
    if stream:  # the offloader itself (the sleep plan: test_sleep_plan_gpu.py)
        argv += ["--stream-optimizer-state-to-disk", "--offload-train-target", "disk", "--offload-train-plan", "offload-all"]
    config = validate_args(parse_args(argv))
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, train_backend="megatron"),
        optimizer=dataclasses.replace(config.optimizer, stream_optimizer_state_bucket_numel=20_000))


def _trainer(config) -> MegatronTrainer:
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


def _run(trainer, steps) -> list[dict]:
    return [trainer.train(step, *_rollout(step)) for step in steps]


def _same_weights(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_streamed_training_is_bit_identical_to_resident(tmp_path):
    resident = _trainer(_config(tmp_path / "resident", stream=False))
    ref_metrics = _run(resident, range(3))
    ref = resident.export_weights()
    resident.shutdown()

    streamed = _trainer(_config(tmp_path / "streamed", stream=True))
    assert streamed.store is not None and streamed.info()["store"]["num_buckets"] >= 2
    metrics = _run(streamed, range(3))
    weights = streamed.export_weights()
    rank_dir = streamed.rank_dir
    streamed.shutdown()
    print(f"\nlosses resident {[m['loss'] for m in ref_metrics]} streamed {[m['loss'] for m in metrics]}; "
          f"stream bytes read/written at step 3: {metrics[-1]['stream_bytes_read']}/"
          f"{metrics[-1]['stream_bytes_written']}")
    assert [m["loss"] for m in metrics] == [m["loss"] for m in ref_metrics]
    assert _same_weights(ref, weights), "streamed weights differ from resident after 3 steps"
    assert metrics[-1]["stream_bytes_written"] > 0 and set(ref_metrics[0]) <= set(metrics[0])
    assert math.isfinite(ref_metrics[0]["grad_norm"])
    assert not os.path.exists(rank_dir), "shutdown removes the per-rank directory"


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
def test_save_load_resume_equals_uninterrupted(tmp_path, stream):
    trainer = _trainer(_config(tmp_path / "a", stream=stream))
    _run(trainer, range(2))
    base = checkpoint.prepare(str(tmp_path / "ck"), 2)
    trainer.save(base)
    trainer.finish_save()
    checkpoint.write_meta(base, next_rollout_id=2, data_state={}, world_size=1)
    _run(trainer, [2])
    uninterrupted = trainer.export_weights()
    trainer.shutdown()

    fresh = _trainer(_config(tmp_path / "b", stream=stream))
    assert not _same_weights(fresh.export_weights(), uninterrupted)
    info = fresh.load(base, load_optimizer=True)
    assert info["optimizer"] == ("streamed" if stream else "state_dict"), info
    _run(fresh, [2])
    resumed = fresh.export_weights()
    fresh.shutdown()
    assert _same_weights(resumed, uninterrupted), "resumed step differs from the uninterrupted one"


def test_exported_weights_load_into_transformers_and_round_trip(tmp_path):
    from miles.models import load_policy

    config = _config(tmp_path, stream=False)
    trainer = _trainer(config)
    _run(trainer, range(1))
    exported = trainer.export_weights()
    hf_model, _, _ = load_policy(config)
    assert set(exported) == set(hf_model.state_dict())
    hf_model.load_state_dict(exported, strict=True)
    hf_model.to(device="cuda", dtype=torch.bfloat16).eval()

    samples, advantages = _rollout(7)
    from miles.rl.loss import collate_samples, forward_logprobs

    batch = {k: v.cuda() for k, v in collate_samples(samples, trainer.engine.tokenizer.pad_token_id, advantages).items()}
    with torch.no_grad():
        ours = trainer.engine.logprobs(batch, 1.0)
        theirs = forward_logprobs(hf_model, batch["input_ids"], batch["attention_mask"])
    mask = batch["loss_mask"].bool()
    diff = (ours - theirs).abs()[mask].max().item()
    print(f"\nexported weights: max |logprob diff| Megatron vs transformers on response tokens, bf16: {diff:.3f}")
    assert diff < BF16_LOGPROB_TOL

    trainer.engine._load_hf_state(exported)  # HF -> Megatron -> HF is the identity on the trainer's own weights
    assert _same_weights(trainer.export_weights(), exported)
    trainer.shutdown()


def test_sleep_drops_grads_and_wake_resumes_bit_identically(tmp_path):
    """In-process the storage offloader backs up the weights; the grad buffers are dropped, not backed
    up, and come back zero-filled; training across a sleep equals training straight through."""
    straight = _trainer(_config(tmp_path / "straight", stream=True))
    _run(straight, range(2))
    reference = straight.export_weights()
    straight.shutdown()

    trainer = _trainer(_config(tmp_path / "slept", stream=True))
    _run(trainer, range(1))
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in trainer.engine.ddp.buffers)
    asleep = trainer.sleep()
    assert asleep["grad_bytes_dropped"] == grad_bytes > 0, asleep
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in trainer.engine.ddp.buffers)
    assert asleep["bytes"] < grad_bytes, "the backup holds bf16 params only (half the fp32 grads' bytes)"
    awake = trainer.wake()
    assert awake["grad_bytes_zeroed"] == grad_bytes
    assert all(not b.grad_data.any() for b in trainer.engine.ddp.buffers)
    _run(trainer, [1])
    slept = trainer.export_weights()
    trainer.shutdown()
    assert _same_weights(slept, reference), "a sleep between steps changed the training"


def _streamed_files(trainer, root) -> dict[str, bytes]:
    trainer.store.flush()
    paths = sorted(str(p) for p in root.rglob("bucket*.bin"))
    assert paths, "the streamed state's bucket files"
    return {p: open(p, "rb").read() for p in paths}


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("poison", ["nan-logprob", "nan-grads"])
def test_a_poisoned_rollout_is_skipped_and_changes_nothing(tmp_path, stream, poison):
    """A NaN in one rollout's engine log-probs is refused before any compute; NaN grads (here: a NaN loss)
    are found before the step. Either way weights and optimizer state (the store's files included) stay
    bit for bit, and training goes on exactly as if the rollout had never happened."""
    straight = _trainer(_config(tmp_path / "straight", stream=stream))
    _run(straight, range(2))
    reference = straight.export_weights()
    straight.shutdown()

    trainer = _trainer(_config(tmp_path / "skipped", stream=stream))
    _run(trainer, range(1))
    before = trainer.export_weights()
    files = _streamed_files(trainer, tmp_path / "skipped") if stream else None
    samples, advantages = _rollout(1)
    if poison == "nan-logprob":
        samples[2].response_logprobs[3] = float("nan")
    else:
        good = trainer.engine.logprobs
        trainer.engine.logprobs = lambda batch, temperature: good(batch, temperature) * float("nan")
    metrics = trainer.train(1, samples, advantages)
    if poison == "nan-grads":
        trainer.engine.logprobs = good
    expected = ("rank 0: sample 2: rollout log-prob of response token 3 is nan" if poison == "nan-logprob"
                else "non-finite gradients")
    print(f"\n{poison} ({'streamed' if stream else 'resident'}): step_skipped={metrics['step_skipped']!r}")
    assert metrics["step_skipped"].startswith(expected) and math.isnan(metrics["grad_norm"])
    assert _same_weights(trainer.export_weights(), before), "a skipped step changed the weights"
    if stream:
        assert _streamed_files(trainer, tmp_path / "skipped") == files, "a skipped step changed the store's files"
    after = trainer.train(1, *_rollout(1))
    assert after["step_skipped"] is None
    weights = trainer.export_weights()
    trainer.shutdown()
    assert _same_weights(weights, reference), "training after the skip differs from never seeing the rollout"
