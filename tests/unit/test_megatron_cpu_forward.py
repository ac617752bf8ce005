"""The Megatron build of each family against transformers' own model, in fp32, on CPU: tiny Llama, Qwen3-MoE,
GLM-5 (MLA + the sparse attention's indexer, dense and sparse top-k) and Qwen3.5-MoE (Gated DeltaNet: megatron's
torch kernels, transformers' torch reference).

The same random weights (every 1-D weight perturbed off its init value, so a misplaced or ignored norm shows)
loaded into megatron-core's GPTModel through ``hf_to_megatron``; checks: the built and converted state dicts
have the same names and shapes, the HF export of the Megatron weights is ``torch.equal`` to what was loaded,
per-token log-probs agree to < 1e-3 (only the reduction order differs) and one backward's grad norm to 1%.

megatron-core is patched for CPU by tests/megatron_cpu; it runs in one spawned process (one world of 1 rank over
gloo), so this pytest process never imports it.
"""

import math
import multiprocessing as mp
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, progress, start  # noqa: E402

FP32_LOGPROB_TOL = 1e-3
GRAD_NORM_RTOL = 0.01
VOCAB, BATCH, SEQ = 256, 4, 64
# (preset, overrides of its config): GLM-5 at a top-k above the sequence (every key kept) and below it (sparse)
CASES = {"llama": ("llama-tiny", {}), "qwen3-moe": ("qwen3-moe-tiny", {}),
         "glm5-dense-topk": ("glm5-tiny", {"index_topk": 128}), "glm5-sparse-topk": ("glm5-tiny", {"index_topk": 16}),
         "qwen3.5-moe": ("qwen3.5-moe-tiny", {})}
TIMEOUT = 300


def _hf_model(preset: str, overrides: dict):
    import torch
    import transformers

    from miles.models import RANDOM_MODEL_PRESETS

    spec = dict(RANDOM_MODEL_PRESETS[preset])
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **{**spec, "vocab_size": VOCAB,
                                                                          "max_position_embeddings": 256, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(7)
    # norms start at 1 (or 0, zero-centred), biases at 0: make every 1-D weight (and GLM-5's routers' expert bias,
    # a buffer) distinct; not rope's inverse frequencies, which both sides compute from the config
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))]
    with torch.no_grad():
        for t in tensors:
            if t.dim() == 1:
                t.add_(0.1 * torch.randn(t.shape, generator=g).to(t))
    return model.eval()


def _grad_norm(params) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


def _compare(preset: str, overrides: dict, grouped_experts: bool = False) -> dict:
    import torch

    from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf
    from miles.backends.megatron_backend.model import build_gpt_model
    from miles.rl.loss import token_logprobs

    hf_model = _hf_model(preset, overrides)
    gpt, _, uses_te = build_gpt_model(hf_model.config, params_dtype=torch.float32, grouped_experts=grouped_experts)
    hf_state = hf_model.state_dict()
    mcore = hf_to_megatron(hf_state, hf_model.config, fused_norms=uses_te, grouped_experts=grouped_experts)
    built = {k: tuple(v.shape) for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    converted = {k: tuple(v.shape) for k, v in mcore.items()}
    wrong = sorted(k for k in set(built) | set(converted) if built.get(k) != converted.get(k))
    gpt.load_state_dict(mcore, strict=False)
    back = megatron_to_hf(gpt.state_dict(), hf_model.config, fused_norms=uses_te,
                          hf_moe_layout=hf_moe_layout(hf_state))
    export_equal = set(back) == set(hf_state) and all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    gpt.eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    ours = token_logprobs(gpt(tokens, positions, None)[:, :-1], tokens[:, 1:])
    theirs = token_logprobs(hf_model(input_ids=tokens, position_ids=positions).logits[:, :-1], tokens[:, 1:])
    (-ours.mean()).backward()
    (-theirs.mean()).backward()
    return {"wrong_shapes": [(k, built.get(k), converted.get(k)) for k in wrong[:6]], "export_equal": export_equal,
            "max_logprob_diff": (ours - theirs).detach().abs().max().item(),
            "grad_norms": (_grad_norm(gpt.parameters()), _grad_norm(hf_model.parameters()))}


def _child(repo: str, megatron_path: str, port: int, results, cases: dict) -> dict:
    sys.path[:0] = [megatron_path, repo, os.path.dirname(os.path.abspath(__file__))]
    import torch
    from megatron.core import parallel_state

    progress(results, "forward", "join a gloo world of 1")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for case, (preset, overrides) in cases.items():
        progress(results, "forward", case)
        out[case] = _compare(preset, overrides)
    return out


def compare_with_transformers(megatron_path: str, cases: dict) -> dict:
    """Each case ``name: (preset, config overrides)`` built by megatron-core and by transformers in one spawned
    process (one world of 1 rank over gloo): ``name -> _compare``'s result."""
    from miles.weights import free_port

    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = start(ctx, results, (_child, (repo, megatron_path, free_port(), results, cases)))
    return collect(procs, results, TIMEOUT)[0]


@pytest.fixture(scope="module")
def compared(megatron_cpu):
    return compare_with_transformers(megatron_cpu, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_forward_and_grads_match_transformers_in_fp32_on_cpu(compared, case):
    got = compared[case]
    ours_norm, theirs_norm = got["grad_norms"]
    print(f"\n{case}, fp32 on CPU: max |logprob diff| {got['max_logprob_diff']:.2e}; grad norm megatron "
          f"{ours_norm:.6f} transformers {theirs_norm:.6f}")
    assert not got["wrong_shapes"], f"(name, built shape, converted shape): {got['wrong_shapes']}"
    assert got["export_equal"], "the HF export of the loaded Megatron weights differs from what was loaded"
    assert got["max_logprob_diff"] < FP32_LOGPROB_TOL
    assert abs(ours_norm - theirs_norm) <= GRAD_NORM_RTOL * theirs_norm
