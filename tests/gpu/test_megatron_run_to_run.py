"""The megatron build's bf16 forward and backward, run twice on the same batch in one process, at the shapes
`scripts/validate_megatron.sh arch` trains (glm5-2b: top-4 of 24 experts; qwen3.5-moe-1b: top-8 of 16):
bit-identical under --deterministic-mode (torch's deterministic algorithms), printed without it.

Streamed-vs-resident and resume checks compare separate runs bit for bit. Megatron's MoE layer sums each token's
expert outputs with scatter_add, atomics whose order changes the sum's last bits once a token has more than
2 experts; with random routers a last-bit difference also flips later expert choices and grows. Under torch's
deterministic algorithms megatron takes index_add instead.

    python -m pytest -q -s tests/gpu/test_megatron_run_to_run.py
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before this process's first matmul, as the flag does

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")
transformers = pytest.importorskip("transformers")

from test_megatron_backend import _no_megatron_state_left, megatron_world  # noqa: E402, F401

from miles.backends.megatron_backend.convert import hf_to_megatron  # noqa: E402
from miles.backends.megatron_backend.model import build_gpt_model, native_fp32_param_names  # noqa: E402
from miles.backends.megatron_backend.router_bias import keep_routers_fp32, routers_to_fp32  # noqa: E402
from miles.models import random_model_config  # noqa: E402
from miles.rl.loss import token_logprobs  # noqa: E402

VOCAB, BATCH, SEQ = 256, 8, 128


def _gpt(preset: str):
    """The model as MegatronTrainer._build wraps it for bf16 training: routers fp32, the weights loaded,
    Float16Module's cast (routers kept fp32), native-fp32 params fp32 again."""
    from megatron.core.transformer.module import Float16Module

    config = random_model_config(preset, VOCAB, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    gpt, tconfig, _ = build_gpt_model(hf.config, params_dtype=torch.bfloat16)
    gpt.cuda()
    routers_to_fp32(gpt)
    gpt.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config), strict=False)
    module = keep_routers_fp32(gpt, lambda: Float16Module(tconfig, gpt))
    for name in native_fp32_param_names(gpt, hf.config):
        param = gpt.get_parameter(name)
        param.data = param.data.float()
    return module


@pytest.mark.parametrize("preset", ["glm5-2b", "qwen3.5-moe-1b"])
def test_forward_and_backward_are_bit_identical_run_to_run(megatron_world, preset):
    gpt = _gpt(preset)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    positions = torch.arange(SEQ, device="cuda").expand(BATCH, SEQ)

    def logprobs():
        return token_logprobs(gpt(tokens, positions, None)[:, :-1], tokens[:, 1:])

    def grads():
        gpt.zero_grad(set_to_none=True)
        (-logprobs().mean()).backward()
        return [p.grad.clone() for p in gpt.parameters() if p.grad is not None]

    same = {}
    try:
        for mode in ("default", "deterministic"):
            torch.use_deterministic_algorithms(mode == "deterministic", warn_only=True)
            with torch.no_grad():
                first, second = logprobs(), logprobs()
            grads_first, grads_second = grads(), grads()
            same[mode] = (torch.equal(first, second),
                          all(torch.equal(a, b) for a, b in zip(grads_first, grads_second, strict=True)))
            print(f"\n{preset} {mode}: forward twice equal {same[mode][0]} (max |diff| "
                  f"{(first - second).abs().max().item():.3e}); grads twice equal {same[mode][1]}", flush=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert same["deterministic"] == (True, True), same
