"""Issue 40 on one GPU: the local spec's fused attention, chunked log-probs through GPTModel's output
processor, and the megatron trainer's step under --use-dynamic-batch-size.

Run on the GPU host: ``python -m pytest -q -s tests/gpu/test_train_speed_gpu.py`` (needs CUDA and
megatron-core). Tiny models; well under a minute.
"""

import dataclasses
import socket
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (megatron-core has no CPU path)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")
transformers = pytest.importorskip("transformers")

from megatron.core import parallel_state  # noqa: E402

from miles.backends.megatron_backend.convert import hf_to_megatron  # noqa: E402
from miles.backends.megatron_backend.logprobs import LogprobRequest, output_logprobs  # noqa: E402
from miles.backends.megatron_backend.model import build_gpt_model  # noqa: E402
from miles.backends.megatron_backend.sdpa_attention import SDPACoreAttention  # noqa: E402
from miles.backends.megatron_backend.trainer import MegatronTrainer  # noqa: E402
from miles.config import parse_args  # noqa: E402
from miles.preflight import validate_args  # noqa: E402
from miles.rl.loss import token_logprobs  # noqa: E402

FP32_LOGIT_TOL = 1e-4


def _rendezvous() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def megatron_world():
    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", init_method=f"tcp://{_rendezvous()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture(autouse=True)
def _no_megatron_state_left():
    yield
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def _tiny_llama():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _gpt(hf_model, fused_attention: bool):
    gpt, _, uses_te = build_gpt_model(hf_model.config, params_dtype=torch.float32, fused_attention=fused_attention)
    gpt.load_state_dict(hf_to_megatron(hf_model.state_dict(), hf_model.config, fused_norms=uses_te), strict=False)
    return gpt.cuda(), uses_te


def _tokens(rows=3, length=24, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, 128, (rows, length), device="cuda", generator=g)
    return tokens, torch.arange(length, device="cuda").expand(rows, length)


def test_sdpa_spec_gives_the_local_specs_logits_and_grads(megatron_world):
    hf_model = _tiny_llama()
    fused, uses_te = _gpt(hf_model, fused_attention=True)
    unfused, _ = _gpt(hf_model, fused_attention=False)
    if uses_te:
        pytest.skip("Transformer Engine is installed: the TE spec, not the local one, is built")
    cores = {type(m).__name__ for m in fused.modules()} & {"SDPACoreAttention", "DotProductAttention"}
    assert cores == {"SDPACoreAttention"}
    assert "DotProductAttention" in {type(m).__name__ for m in unfused.modules()}
    tokens, positions = _tokens()
    logits_fused, logits_unfused = fused(tokens, positions, None), unfused(tokens, positions, None)
    diff = (logits_fused - logits_unfused).abs().max().item()
    print(f"\nSDPA vs local DotProductAttention, fp32: max |logit diff| {diff:.2e}")
    assert diff < FP32_LOGIT_TOL
    logits_fused.square().mean().backward()
    logits_unfused.square().mean().backward()
    grads = dict(unfused.named_parameters())
    worst = max((p.grad - grads[n].grad).abs().max().item() / (grads[n].grad.abs().max().item() + 1e-12)
                for n, p in fused.named_parameters())
    print(f"max relative grad diff {worst:.2e}")
    assert worst < 1e-3


def test_sdpa_uses_a_fused_kernel_in_bf16(megatron_world):
    """The flash / memory-efficient kernels take the bf16 [b, heads, s, d] layout sdpa_context passes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from miles.backends.megatron_backend.sdpa_attention import sdpa_context

    q = torch.randn(256, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(256, 2, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = sdpa_context(q, k, v, scale=0.125, causal=True)  # raises if no fused kernel takes it
    assert out.shape == (256, 2, 8 * 64)


def test_output_processor_log_probs_equal_the_logits(megatron_world):
    gpt, _ = _gpt(_tiny_llama(), fused_attention=True)
    tokens, positions = _tokens(rows=4, length=20, seed=3)
    whole = token_logprobs(gpt(tokens, positions, None)[:, :-1], tokens[:, 1:], 0.8)
    whole.sum().backward()
    expected = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad(set_to_none=True)
    chunked = gpt(tokens, positions, None, output_processor=output_logprobs,
                  output_processor_context=LogprobRequest(tokens[:, 1:], 0.8, chunk_tokens=7))
    assert chunked.shape == (4, 19)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    chunked.sum().backward()
    for name, p in gpt.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-5)


def _trainer(tmp_path, *flags) -> MegatronTrainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = validate_args(parse_args(["--tiny-model", "--model-dtype", "bf16", "--lr", "1e-3",
                                       "--offload-train-disk-dir", str(tmp_path / "disk"), *flags]))
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, train_backend="megatron"))
    trainer = MegatronTrainer(config, rank=0, world_size=1, rank_dir=config.paths.rank_dir(0, 0))
    trainer.init(_rendezvous())
    return trainer


def _rollout(step: int):
    g = torch.Generator().manual_seed(step)
    samples = []
    for i, size in enumerate((7, 0, 5, 2, 6, 1, 4, 3)):  # rows of 21, 8, 19, 11, 20, 11, 15, 14 tokens
        prompt = torch.randint(4, 100, (3 + 2 * size,), generator=g).tolist()
        response = torch.randint(4, 100, (4 + i % 3,), generator=g).tolist()
        samples.append(SimpleNamespace(prompt_ids=prompt, response_ids=response,
                                       response_logprobs=(-torch.rand(len(response), generator=g) * 4).tolist()))
    return samples, [1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 2.0, -2.0]


def test_dynamic_batches_train_like_fixed_micro_batches(tmp_path):
    fixed = _trainer(tmp_path / "fixed", "--micro-batch-size", "2")
    fixed_metrics = [fixed.train(step, *_rollout(step)) for step in range(3)]
    fixed.shutdown()
    dynamic = _trainer(tmp_path / "dynamic", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "48")
    dynamic_metrics = [dynamic.train(step, *_rollout(step)) for step in range(3)]
    dynamic.shutdown()
    losses = [(a["loss"], b["loss"]) for a, b in zip(fixed_metrics, dynamic_metrics)]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in losses)
    print(f"\nlosses fixed/dynamic {losses}; max relative difference {worst:.2e}; micro-batches "
          f"{fixed_metrics[0]['micro_batches']} -> {dynamic_metrics[0]['micro_batches']}, padded tokens "
          f"{fixed_metrics[0]['padded_tokens']} -> {dynamic_metrics[0]['padded_tokens']}")
    assert worst < 1e-2  # bf16 weights: summation order moves the third step's loss by ~1e-3
    # pairs in the rollout's order pad to 150 tokens; by length within 48 tokens, 130 in 4 micro-batches
    assert (fixed_metrics[0]["padded_tokens"], dynamic_metrics[0]["padded_tokens"]) == (150, 130)
    assert dynamic_metrics[0]["micro_batches"] == 4
    assert all(m["step_skipped"] is None for m in dynamic_metrics)
