"""Qwen3.5-MoE (``qwen3_5_moe``) in the megatron backend on one GPU, against transformers' own model.

Run on the GPU host: ``python -m pytest -q -x -s tests/gpu/test_megatron_qwen35.py`` (needs CUDA,
megatron-core and the ``fla`` package, which megatron-core's Gated DeltaNet imports). transformers runs its
own torch Gated DeltaNet here (the exact reference); the megatron build uses fla's kernels, or megatron-core's
torch ones on Hopper with Triton < 3.7.1 (fla's gated backward is wrong there: ``gated_delta_rule_kwargs``).

The same random weights (the ``qwen3.5-moe-tiny`` preset's shape: 2 Gated DeltaNet + 2 gated attention
layers, 8 routed experts + a gated shared expert; every norm, ``dt_bias`` and ``A_log`` perturbed so that
a wrongly mapped one shows) in transformers and in the Megatron build: 8 sequences of 128 tokens, fp32 max
per-token log-prob |diff| < 1e-3, bf16 mean <= 0.02 (max printed), the HF export of the Megatron weights
``torch.equal`` to what was loaded, and one backward's grad norm within 1%. Then MegatronTrainer in-process
on a ``qwen3.5-moe-tiny`` folder: streamed == resident bit for bit over 3 steps, ``A_log`` kept in fp32
(under the store's resident Adam) and changing.
"""

import dataclasses
import inspect
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (megatron-core has no CPU path)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")
pytest.importorskip("fla", reason="needs flash-linear-attention (the Gated DeltaNet kernels)")
transformers = pytest.importorskip("transformers")

# tests/gpu is on sys.path (conftest.py); the two fixtures are used by name
from test_megatron_backend import _no_megatron_state_left, megatron_world  # noqa: E402, F401
from test_megatron_backend import _run, _same_weights, _trainer  # noqa: E402

from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf  # noqa: E402
from miles.backends.megatron_backend.model import build_gpt_model, native_fp32_param_names  # noqa: E402
from miles.config import parse_args  # noqa: E402
from miles.preflight import validate_args  # noqa: E402
from miles.models import RANDOM_MODEL_PRESETS, write_random_model  # noqa: E402
from miles.rl.loss import token_logprobs  # noqa: E402


@pytest.fixture(autouse=True)
def _transformers_torch_kernels(monkeypatch):
    """transformers' Qwen3.5 runs its own torch Gated DeltaNet (the functions its fla / causal_conv1d wrappers
    fall back to): the exact reference, with no Triton JIT; the megatron build picks its kernels itself."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        torch_function = inspect.unwrap(getattr(modeling, name))
        assert torch_function.__module__ == modeling.__name__, (name, torch_function.__module__)
        monkeypatch.setattr(modeling, name, torch_function)


FP32_LOGPROB_TOL = 1e-3
BF16_MEAN_LOGPROB_TOL = 0.02
GRAD_NORM_RTOL = 0.01
VOCAB, BATCH, SEQ = 128, 8, 128


def _tiny_hf(preset: str = "qwen3.5-moe-tiny") -> torch.nn.Module:
    spec = dict(RANDOM_MODEL_PRESETS[preset])
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), vocab_size=VOCAB, max_position_embeddings=256,
                                               **spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at 0 (zero-centred) or 1, dt_bias at 1: make every 1-D weight distinct
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model.cuda().eval()


def _tokens():
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    return tokens, torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)


def _megatron(hf_model, dtype):
    """The Megatron build loaded with ``hf_model``'s weights; native-fp32 params (A_log) in fp32, as the trainer."""
    gpt, _, uses_te = build_gpt_model(hf_model.config, params_dtype=dtype)
    assert not uses_te
    gpt.cuda()
    hf_state = hf_model.state_dict()
    mcore = hf_to_megatron(hf_state, hf_model.config)
    built = {k: tuple(v.shape) for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    converted = {k: tuple(v.shape) for k, v in mcore.items()}
    wrong = sorted(k for k in set(built) | set(converted) if built.get(k) != converted.get(k))
    assert not wrong, f"(name, built shape, converted shape): {[(k, built.get(k), converted.get(k)) for k in wrong[:6]]}"
    fp32 = native_fp32_param_names(gpt, hf_model.config)
    assert fp32 and all(name.endswith("self_attention.A_log") for name in fp32)
    for name in fp32:
        param = gpt.get_parameter(name)
        param.data = param.data.float()
    gpt.load_state_dict(mcore, strict=False)
    back = megatron_to_hf(gpt.state_dict(), hf_model.config, hf_moe_layout=hf_moe_layout(hf_state))
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[k].to(hf_state[k].dtype), hf_state[k]) for k in hf_state), "HF export != loaded"
    return gpt


def _logprobs(hf_model, gpt, tokens, positions):
    ours = token_logprobs(gpt(tokens, positions, None)[:, :-1], tokens[:, 1:])
    theirs = token_logprobs(hf_model(input_ids=tokens, position_ids=positions).logits[:, :-1], tokens[:, 1:])
    return ours, theirs


@pytest.mark.parametrize("preset", ["qwen3.5-moe-tiny", "qwen3.5-moe-1b"])
def test_forward_agrees_with_transformers_in_fp32_and_bf16(megatron_world, preset):
    """At the tiny preset's shape and at the 1.03B preset's (the shape `miles train` runs in
    scripts/validate_megatron.sh arch: head_dim 256, 8 query heads per KV head, 32 value heads, top-8 of 16)."""
    hf_model = _tiny_hf(preset)
    tokens, positions = _tokens()
    gpt = _megatron(hf_model, torch.float32).eval()
    rule = gpt.decoder.layers[0].self_attention.gated_delta_rule
    print(f"\nmegatron Gated DeltaNet rule: {rule.__module__}.{rule.__name__}")
    with torch.no_grad():
        ours, theirs = _logprobs(hf_model, gpt, tokens, positions)
    fp32 = (ours - theirs).abs()
    theirs_fp32 = theirs
    del gpt

    hf_bf16 = hf_model.to(torch.bfloat16)
    gpt = _megatron(hf_bf16, torch.bfloat16).eval()
    assert gpt.get_parameter("decoder.layers.0.self_attention.A_log").dtype == torch.float32
    with torch.no_grad():
        ours, theirs = _logprobs(hf_bf16, gpt, tokens, positions)
    bf16 = (ours - theirs).abs()
    # transformers' own bf16 forward against its fp32 one: at the 1B shape random top-8-of-16 routers flip
    # expert choices under bf16 rounding, layer after layer, so two bf16 implementations of the same weights
    # differ by about sqrt(2) x this however exact each is; 0.02 holds where that floor is small
    floor = (theirs - theirs_fp32).abs().mean().item()
    print(f"qwen3_5_moe {preset}, {BATCH}x{SEQ} tokens: fp32 max |logprob diff| {fp32.max().item():.2e}; "
          f"bf16 mean {bf16.mean().item():.2e}, max {bf16.max().item():.2e}; transformers bf16 vs its fp32: "
          f"mean {floor:.2e}")
    assert fp32.max().item() < FP32_LOGPROB_TOL
    assert bf16.mean().item() <= max(BF16_MEAN_LOGPROB_TOL, 2 * floor)


def _grad_norm(params) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))


def test_one_backward_gives_transformers_grad_norm(megatron_world):
    hf_model = _tiny_hf().train()
    gpt = _megatron(hf_model, torch.float32).train()
    tokens, positions = _tokens()
    ours, theirs = _logprobs(hf_model, gpt, tokens, positions)
    (-ours.mean()).backward()
    (-theirs.mean()).backward()
    missing = [n for n, p in gpt.named_parameters() if p.grad is None]
    assert not missing, f"Megatron params without a grad: {missing[:4]}"
    ours_norm, theirs_norm = _grad_norm(gpt.parameters()), _grad_norm(hf_model.parameters())
    a_log = [(gpt.get_parameter(f"decoder.layers.{i}.self_attention.A_log").grad.norm().item(),
              hf_model.model.layers[i].linear_attn.A_log.grad.norm().item()) for i in (0, 2)]
    print(f"\nqwen3_5_moe grad norm: megatron {ours_norm:.6e}, transformers {theirs_norm:.6e} "
          f"(rel {abs(ours_norm - theirs_norm) / theirs_norm:.2e}); A_log grad norms (megatron, HF) {a_log}")
    assert abs(ours_norm - theirs_norm) <= GRAD_NORM_RTOL * theirs_norm


# ---- MegatronTrainer on a qwen3.5-moe-tiny folder -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_random_model(str(tmp_path_factory.mktemp("qwen35") / "model"), "qwen3.5-moe-tiny", seed=0)


def _config(tmp_path, folder: str, *, stream: bool):
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = ["--hf-checkpoint", folder, "--model-dtype", "bf16", "--micro-batch-size", "2", "--lr", "1e-3",
            "--offload-train-disk-dir", str(tmp_path / "disk")]
    if stream:
        argv += ["--stream-optimizer-state-to-disk", "--offload-train-target", "disk"]
    config = validate_args(parse_args(argv))
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, train_backend="megatron"),
        optimizer=dataclasses.replace(config.optimizer, stream_optimizer_state_bucket_numel=20_000))


def _a_logs(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if k.endswith("linear_attn.A_log")}


def test_streamed_training_is_bit_identical_to_resident_and_a_log_trains_in_fp32(tmp_path, tiny_folder):
    resident = _trainer(_config(tmp_path / "resident", tiny_folder, stream=False))
    initial = _a_logs(resident.export_weights())
    ref_metrics = _run(resident, range(3))
    ref = resident.export_weights()
    resident.shutdown()

    streamed = _trainer(_config(tmp_path / "streamed", tiny_folder, stream=True))
    fp32 = native_fp32_param_names(streamed.engine.gpt, streamed.engine.hf_config)
    assert len(fp32) == 2 and all(streamed.engine.gpt.get_parameter(n).dtype == torch.float32 for n in fp32)
    resident_adams = [s.resident_adam for s in streamed.engine.streamed_stores() if s.resident_adam is not None]
    aliases = [a for adam in resident_adams for a in adam.aliases]
    assert sum(a.numel() for a in aliases) == sum(streamed.engine.gpt.get_parameter(n).numel() for n in fp32)
    assert all(a.dtype == torch.float32 for a in aliases)
    metrics = _run(streamed, range(3))
    weights = streamed.export_weights()
    streamed.shutdown()

    after = _a_logs(weights)
    print(f"\nqwen3_5_moe losses resident {[m['loss'] for m in ref_metrics]} streamed {[m['loss'] for m in metrics]}; "
          f"A_log max |change| after 3 steps "
          f"{max((after[k].float() - initial[k].float()).abs().max().item() for k in after):.3e}")
    assert [m["loss"] for m in metrics] == [m["loss"] for m in ref_metrics]
    assert _same_weights(ref, weights), "streamed weights differ from resident after 3 steps"
    assert all(v.dtype == torch.float32 for v in after.values()) and len(after) == 2
    assert all(not torch.equal(after[k], initial[k]) for k in after), "A_log did not train"


def test_embedded_engine_log_probs_agree_with_the_trainer(tmp_path, tiny_folder):
    """The embedded engine (transformers on CUDA, transformers' own cache for the Gated DeltaNet states) samples;
    the Megatron trainer scores the same tokens: per-token |diff| <= 0.05 in bf16, as for llama-1b."""
    from miles.rl.loss import collate_samples
    from miles.rollout.embedded import EmbeddedRolloutEngine

    config = _config(tmp_path, tiny_folder, stream=False)
    engine = EmbeddedRolloutEngine(config)
    assert not engine.static_cache
    prompts = [[5 + i for i in range(n)] for n in (7, 3, 12, 5)]
    samples = engine.generate(prompts, dict(max_new_tokens=24, temperature=1.0, stop_token_ids=[]))
    engine.close()
    trainer = _trainer(config)
    batch = {k: v.cuda() for k, v in collate_samples(samples, trainer.engine.tokenizer.pad_token_id,
                                                     [0.0] * len(samples)).items()}
    with torch.no_grad():
        ours = trainer.engine.logprobs(batch, 1.0)
    trainer.shutdown()
    mask = batch["loss_mask"].bool()
    diff = (ours - batch["rollout_logprobs"]).abs()[mask]  # the engine's log-probs on the same grid
    print(f"\nqwen3_5_moe engine vs trainer, bf16, {int(mask.sum())} tokens: mean |logprob diff| "
          f"{diff.mean().item():.3e}, max {diff.max().item():.3e}")
    assert diff.max().item() <= 0.05
