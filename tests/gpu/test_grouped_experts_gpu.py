"""Grouped experts (pieces/grouped_experts_layers.py) on one GPU, against megatron's SequentialMLP on the same
weights: the experts module in fp32 and bf16 (bf16: CUTLASS's grouped GEMM, sm90, against cuBLAS's per-expert
GEMMs), and a tiny Qwen3-MoE's log-probs, grouped vs SequentialMLP and vs transformers.

Run on the GPU host: ``python -m pytest -q -s tests/gpu/test_grouped_experts_gpu.py`` (needs CUDA and
megatron-core). The CPU suite's version: tests/unit/test_megatron_cpu_grouped_experts.py.
"""

import os
import socket
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (megatron-core has no CPU path)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
from test_megatron_cpu_grouped_experts import compare_experts  # noqa: E402

BF16_LOGPROB_TOL = 0.05  # tests/gpu/test_megatron_backend.py's bf16 tolerance against transformers


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state, tensor_parallel

    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the expert RNG tracker the experts initialize under
    yield
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_experts_module_matches_sequential_mlp(megatron_world, dtype):
    got = compare_experts(dtype, device="cuda")
    print(f"\nexperts {dtype} on {torch.cuda.get_device_name()}: max diffs {got['max_diff']} (largest values "
          f"{got['max_abs']}); torch.equal {got['equal']}")
    assert got["module"] == "TEGroupedMLP" and got["linear"] == "ColumnParallelGroupedLinear"
    # relative to the largest value: bf16, 1 ulp (2^-7; both accumulate in fp32 and round once); fp32, 1e-6 (torch's
    # per-group GEMMs against megatron's per-expert ones: the same sums, maybe other cuBLAS kernels)
    relative = 2 ** -7 if dtype == "bfloat16" else 1e-6
    for k, diff in got["max_diff"].items():
        assert diff <= got["max_abs"][k] * relative, (k, diff)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", BF16_LOGPROB_TOL)])
def test_a_grouped_experts_qwen3_moe_matches_sequential_mlp_and_transformers(megatron_world, dtype, tol):
    from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf
    from miles.backends.megatron_backend.model import build_gpt_model
    from miles.models import RANDOM_MODEL_PRESETS
    from miles.rl.loss import token_logprobs

    spec = dict(RANDOM_MODEL_PRESETS["qwen3-moe-tiny"])
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **{**spec, "vocab_size": 256})
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(
        "cuda", getattr(torch, dtype)).eval()
    hf_state = hf_model.state_dict()
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    positions = torch.arange(64, device="cuda").expand(4, 64)
    logprobs = {}
    for grouped in (False, True):
        gpt, _, uses_te = build_gpt_model(hf_model.config, params_dtype=getattr(torch, dtype), use_te=False,
                                          grouped_experts=grouped)
        # megatron's torch norms (no apex) are built on the CPU in fp32: the whole model in the HF model's place and
        # dtype, as the trainer moves it
        gpt = gpt.to("cuda", getattr(torch, dtype))
        experts = {type(m).__name__ for name, m in gpt.named_modules() if name.endswith(".experts")}
        assert experts == {"TEGroupedMLP" if grouped else "SequentialMLP"}, experts
        gpt.load_state_dict(hf_to_megatron(hf_state, hf_model.config, grouped_experts=grouped), strict=False)
        back = megatron_to_hf(gpt.state_dict(), hf_model.config, hf_moe_layout=hf_moe_layout(hf_state))
        assert all(torch.equal(back[k], v) for k, v in hf_state.items()), "the HF export differs from the load"
        with torch.no_grad():
            logprobs[grouped] = token_logprobs(gpt.eval()(tokens, positions, None)[:, :-1].float(), tokens[:, 1:])
    with torch.no_grad():
        theirs = token_logprobs(hf_model(input_ids=tokens, position_ids=positions).logits[:, :-1].float(),
                                tokens[:, 1:])
    vs_sequential = (logprobs[True] - logprobs[False]).abs().max().item()
    vs_transformers = (logprobs[True] - theirs).abs().max().item()
    print(f"\nqwen3-moe-tiny {dtype}: grouped vs SequentialMLP max |logprob diff| {vs_sequential:.3g}, vs "
          f"transformers {vs_transformers:.3g}")
    assert vs_sequential < tol and vs_transformers < tol
