"""GLM-5 (transformers ``glm_moe_dsa``) in the Megatron backend on one GPU, against transformers' own code.

Run on the GPU host: ``python -m pytest -q -x -s tests/gpu/test_megatron_glm_moe_dsa.py`` (CUDA, megatron-core;
no Transformer Engine, no tilelang: megatron's DSA runs its PyTorch path). Tiny models only.

- The same random weights (every norm, norm bias and router expert bias off its init value) in transformers
  (eager attention) and in megatron-core's GPTModel (pieces/dsa_layers), 8 sequences of 128 tokens, fp32: the
  built state's names and shapes are the converter's, the export is ``torch.equal`` to the loaded state, max
  per-token |log-prob diff| < 1e-3, one backward's grad norm within 1%. Twice: an indexer top-k of 128 (the
  sparse attention is dense) and of 64 (sparse; the last layer reuses the previous layer's top-k).
- MegatronTrainer in-process on a GLM-5 folder (bf16): streamed optimizer state bit-identical to resident
  Adam for 3 steps, the routers' fp32 weight and expert bias updated, save + load resume exact, and the
  trainer's log-probs against transformers' (the embedded engine's model) on 8 x 128 tokens: mean <= 0.02.
"""

import dataclasses
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (megatron-core has no CPU path)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")
transformers = pytest.importorskip("transformers")

from test_megatron_backend import (  # noqa: E402,F401  (fixtures: megatron_world, the autouse cleanup)
    _no_megatron_state_left,
    _rendezvous,
    _run,
    _same_weights,
    megatron_world,
)

from miles import checkpoint  # noqa: E402
from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf  # noqa: E402
from miles.backends.megatron_backend.model import build_gpt_model  # noqa: E402
from miles.backends.megatron_backend.trainer import MegatronTrainer  # noqa: E402
from miles.config import parse_args  # noqa: E402
from miles.preflight import validate_args  # noqa: E402
from miles.models import RANDOM_MODEL_PRESETS, build_tiny_tokenizer, load_policy, write_random_model  # noqa: E402
from miles.rl.loss import forward_logprobs, token_logprobs  # noqa: E402

FP32_LOGPROB_TOL = 1e-3
BF16_MEAN_LOGPROB_TOL = 0.02
GRAD_NORM_RTOL = 0.01
BATCH, SEQ = 8, 128


def _perturbed(model):
    """Norm weights, the indexer's key-norm bias and the routers' expert bias off their init values (ones,
    zeros), so a misplaced or ignored one shows; the bias is large enough to steer the expert choice."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                t.add_(0.1 * torch.randn(t.shape, generator=g).to(t))
            elif name.endswith(("k_norm.bias", "e_score_correction_bias")):
                t.add_(0.05 * torch.randn(t.shape, generator=g).to(t))
    return model


def _tiny_hf(index_topk: int, preset: str = "glm5-tiny"):
    spec = {k: v for k, v in RANDOM_MODEL_PRESETS[preset].items() if k != "model_type"}
    config = transformers.GlmMoeDsaConfig(**{**spec, "vocab_size": 256, "index_topk": index_topk,
                                             "max_position_embeddings": 256})
    assert config.mlp_layer_types[0] == "dense"
    assert preset != "glm5-tiny" or config.indexer_types == ["full", "full", "shared"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return _perturbed(model).cuda().eval()


def _grad_norm(params) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


@pytest.mark.parametrize("preset,index_topk", [("glm5-tiny", 128), ("glm5-tiny", 64), ("glm5-2b", 2048)],
                         ids=["dense-topk", "sparse-topk", "glm5-2b-shape"])
def test_megatron_matches_transformers_in_fp32(megatron_world, preset, index_topk):
    """At the tiny preset's shape (dense and sparse top-k) and at the 1.86B preset's (the shape `miles train`
    runs in scripts/validate_megatron.sh arch: 16 heads, 24 experts, top-4, LoRA ranks 768/256)."""
    hf_model = _tiny_hf(index_topk, preset)
    gpt, _, uses_te = build_gpt_model(hf_model.config, params_dtype=torch.float32)
    gpt.cuda().eval()
    assert not uses_te
    hf_state = hf_model.state_dict()
    mcore = hf_to_megatron(hf_state, hf_model.config)
    built = {k: tuple(v.shape) for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    assert built == {k: tuple(v.shape) for k, v in mcore.items()}, \
        f"built-only {sorted(set(built) - set(mcore))[:4]}, converted-only {sorted(set(mcore) - set(built))[:4]}"
    gpt.load_state_dict(mcore, strict=False)
    back = megatron_to_hf(gpt.state_dict(), hf_model.config, hf_moe_layout=hf_moe_layout(hf_state))
    assert set(back) == set(hf_state) and all(torch.equal(back[k], hf_state[k]) for k in hf_state)

    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 256, (BATCH, SEQ), device="cuda", generator=g)
    positions = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)
    ours = token_logprobs(gpt(tokens, positions, None)[:, :-1], tokens[:, 1:])
    theirs = token_logprobs(hf_model(input_ids=tokens, position_ids=positions).logits[:, :-1], tokens[:, 1:])
    diff = (ours - theirs).detach().abs()
    (-ours.mean()).backward()
    (-theirs.mean()).backward()
    ours_norm, theirs_norm = _grad_norm(gpt.parameters()), _grad_norm(hf_model.parameters())
    print(f"\nglm_moe_dsa {preset} index_topk={index_topk}, fp32: max |logprob diff| {diff.max().item():.2e} "
          f"(mean {diff.mean().item():.2e}); grad norm megatron {ours_norm:.6f} transformers {theirs_norm:.6f}")
    assert diff.max().item() < FP32_LOGPROB_TOL
    assert abs(ours_norm - theirs_norm) <= GRAD_NORM_RTOL * theirs_norm


# ---- MegatronTrainer on a GLM-5 folder ----------------------------------------------------------
@pytest.fixture(scope="module")
def glm_folder(tmp_path_factory):
    """The glm5-tiny preset as scripts/make_random_model.py writes it (fp32), then perturbed (see _perturbed)."""
    written, folder = (str(tmp_path_factory.mktemp(name)) for name in ("glm5-tiny", "glm5-tiny-perturbed"))
    write_random_model(written, "glm5-tiny", seed=0, dtype="fp32")
    model = _perturbed(transformers.AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32))
    model.save_pretrained(folder, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def _config(tmp_path, folder, *, stream: bool):
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = ["--hf-checkpoint", folder, "--model-dtype", "bf16", "--micro-batch-size", "2", "--lr", "1e-3",
            "--offload-train-disk-dir", str(tmp_path / "disk")]
    if stream:
        argv += ["--stream-optimizer-state-to-disk", "--offload-train-target", "disk"]
    config = validate_args(parse_args(argv))
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, train_backend="megatron"),
        optimizer=dataclasses.replace(config.optimizer, stream_optimizer_state_bucket_numel=20_000))


def _trainer(config) -> MegatronTrainer:
    trainer = MegatronTrainer(config, rank=0, world_size=1, rank_dir=config.paths.rank_dir(0, 0))
    trainer.init(_rendezvous())
    return trainer


def _router(trainer, layer: int = 1):
    router = trainer.engine.gpt.decoder.layers[layer].mlp.router
    return router.weight.detach().clone(), router.expert_bias.detach().clone()


def test_glm_streamed_training_is_bit_identical_to_resident(tmp_path, glm_folder):
    resident = _trainer(_config(tmp_path / "resident", glm_folder, stream=False))
    weight0, bias0 = _router(resident)
    assert weight0.dtype == bias0.dtype == torch.float32, "the router's weight and expert bias stay fp32"
    ref_metrics = _run(resident, range(3))
    ref = resident.export_weights()
    weight3, bias3 = _router(resident)
    resident.shutdown()

    streamed = _trainer(_config(tmp_path / "streamed", glm_folder, stream=True))
    assert streamed.store is not None and streamed.info()["store"]["num_buckets"] >= 2
    # the fp32 router weights are native-fp32 params: Megatron keeps no master for them, the store's
    # resident Adam steps them (miles_plugins/optimizers/streaming/bind/megatron_optimizer.py)
    members = getattr(streamed.engine.optimizer, "chained_optimizers", [streamed.engine.optimizer])
    native_fp32 = sum(p.numel() for m in members for g in getattr(m, "shard_fp32_groups", []) for p in g)
    routers = [layer.mlp.router.weight for layer in streamed.engine.gpt.decoder.layers if hasattr(layer.mlp, "router")]
    assert native_fp32 == sum(w.numel() for w in routers) > 0 and all(w.dtype == torch.float32 for w in routers)
    metrics = _run(streamed, range(3))
    weights = streamed.export_weights()
    streamed.shutdown()
    print(f"\nglm5-tiny losses resident {[m['loss'] for m in ref_metrics]} streamed {[m['loss'] for m in metrics]}; "
          f"layer-1 router: |weight change| {(weight3 - weight0).abs().max().item():.3e}, expert bias "
          f"{bias0.tolist()} -> {bias3.tolist()}")
    assert [m["loss"] for m in metrics] == [m["loss"] for m in ref_metrics]
    assert _same_weights(ref, weights), "streamed weights differ from resident after 3 steps"
    assert not torch.equal(weight3, weight0) and not torch.equal(bias3, bias0), "router weight and bias train"
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert ref[bias].dtype == torch.float32 and torch.equal(ref[bias], bias3.cpu())
    assert all(math.isfinite(m["grad_norm"]) for m in metrics)


def test_glm_save_load_resume_equals_uninterrupted(tmp_path, glm_folder):
    trainer = _trainer(_config(tmp_path / "a", glm_folder, stream=True))
    _run(trainer, range(2))
    base = checkpoint.prepare(str(tmp_path / "ck"), 2)
    trainer.save(base)
    trainer.finish_save()
    checkpoint.write_meta(base, next_rollout_id=2, data_state={}, world_size=1)
    _run(trainer, [2])
    uninterrupted = trainer.export_weights()
    trainer.shutdown()

    fresh = _trainer(_config(tmp_path / "b", glm_folder, stream=True))
    info = fresh.load(base, load_optimizer=True)
    assert info["optimizer"] == "streamed", info
    _run(fresh, [2])
    resumed = fresh.export_weights()
    fresh.shutdown()
    assert _same_weights(resumed, uninterrupted), "resumed step differs from the uninterrupted one"


def test_glm_trainer_logprobs_match_transformers_in_bf16(tmp_path, glm_folder):
    """The trainer (bf16 Megatron) against transformers loading the same folder in bf16, as the embedded
    rollout engine does; and the trainer's HF export against that model's state."""
    config = _config(tmp_path, glm_folder, stream=False)
    trainer = _trainer(config)
    hf_model, _, _ = load_policy(config, device="cuda")
    exported, hf_state = trainer.export_weights(), hf_model.state_dict()
    assert set(exported) == set(hf_state)
    for k, t in exported.items():  # transformers keeps the indexer's weights_proj fp32; Megatron trains it bf16
        assert torch.equal(t.float(), hf_state[k].cpu().to(t.dtype).float()), k
    g = torch.Generator(device="cuda").manual_seed(3)
    batch = {"input_ids": torch.randint(4, 100, (BATCH, SEQ), device="cuda", generator=g),
             "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long, device="cuda")}
    with torch.no_grad():
        ours = trainer.engine.logprobs(batch, 1.0)
        theirs = forward_logprobs(hf_model, batch["input_ids"], batch["attention_mask"])
    trainer.shutdown()
    diff = (ours.float() - theirs.float()).abs()
    print(f"\nglm5-tiny bf16 trainer vs transformers: mean |logprob diff| {diff.mean().item():.4f}, "
          f"max {diff.max().item():.4f}")
    assert diff.mean().item() <= BF16_MEAN_LOGPROB_TOL
