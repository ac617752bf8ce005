"""Grouped experts (pieces/grouped_experts_layers.py) on megatron-core, in fp32 on CPU, against megatron's
SequentialMLP on the same weights:

- the experts module alone (``TEGroupedMLP`` over ``torch._grouped_mm`` linears vs ``SequentialMLP``), tokens
  split unevenly over the experts, two of them given none: outputs, input grads and weight grads ``torch.equal``
  in fp32 (each expert's rows meet the same GEMM in the same order: ``_grouped_mm`` on CPU is one GEMM per group)
  and in bf16 within 1 bf16 ulp;
- a whole model of each block spec that builds MoE layers (GPT: Qwen3-MoE; Qwen3.5-MoE's own spec; GLM-5's DSA
  spec): logits and every grad ``torch.equal`` to the SequentialMLP build's, the HF export exact; and Qwen3-MoE
  against transformers as test_megatron_cpu_forward checks the SequentialMLP build.

megatron-core is patched for CPU by tests/megatron_cpu; it runs in one spawned process (one world of 1 rank over
gloo), so this pytest process never imports it.
"""

import multiprocessing as mp
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, progress, start  # noqa: E402

TOKENS_PER_EXPERT = [37, 0, 5, 22, 1, 0, 9, 14]  # qwen3-moe-tiny's 8 experts
MODELS = {"qwen3-moe": "qwen3-moe-tiny", "qwen3.5-moe": "qwen3.5-moe-tiny", "glm5": "glm5-tiny"}
TIMEOUT = 400


def _experts(grouped: bool, hf_config, dtype, device: str):
    """The experts module of the model's MoE layers, as the block spec builds it (weights initialized) on
    ``device`` ("cpu", or "cuda": the current GPU)."""
    from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from miles.backends.megatron_backend.families import family
    from miles.backends.megatron_backend.families.gpt.layers import block_spec
    from miles.backends.megatron_backend.model import transformer_config_from_hf
    from miles.backends.megatron_backend.pieces.grouped_experts_layers import with_grouped_experts

    config = TransformerConfig(**{**transformer_config_from_hf(hf_config, params_dtype=dtype,
                                                               perform_initialization=True, grouped_experts=grouped),
                                  "use_cpu_initialization": device == "cpu"})
    spec = with_grouped_experts(block_spec(config, family.BlockOptions(use_te=False))[0], config)
    experts = spec.layer_specs[0].submodules.mlp.keywords["submodules"].experts
    return experts(config.num_moe_experts, config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _experts_run(experts, tokens, probs, grad):
    import torch

    tokens = tokens.clone().requires_grad_()
    out, bias = experts(tokens, torch.tensor(TOKENS_PER_EXPERT), probs)
    out.backward(grad)
    return out.detach(), tokens.grad, bias


def compare_experts(dtype_name: str, device: str = "cpu") -> dict:
    """The grouped experts module against SequentialMLP on the same weights and tokens (also run on the GPU:
    tests/gpu/test_grouped_experts_gpu.py)."""
    import torch
    import transformers

    from miles.models import RANDOM_MODEL_PRESETS

    dtype = getattr(torch, dtype_name)
    spec = dict(RANDOM_MODEL_PRESETS["qwen3-moe-tiny"])
    hf_config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    sequential, grouped = _experts(False, hf_config, dtype, device), _experts(True, hf_config, dtype, device)
    with torch.no_grad():
        for fc in ("linear_fc1", "linear_fc2"):
            getattr(grouped, fc).weight.copy_(torch.stack([getattr(e, fc).weight for e in sequential.local_experts]))
    g = torch.Generator().manual_seed(3)
    count = sum(TOKENS_PER_EXPERT)
    tokens = torch.randn(count, hf_config.hidden_size, generator=g).to(device, dtype)
    probs = torch.rand(count, generator=g).to(device, dtype)
    grad = torch.randn(count, hf_config.hidden_size, generator=g).to(device, dtype)
    ours, theirs = _experts_run(grouped, tokens, probs, grad), _experts_run(sequential, tokens, probs, grad)
    weight_grads = {fc: (getattr(grouped, fc).weight.grad,
                         torch.stack([getattr(e, fc).weight.grad for e in sequential.local_experts]))
                    for fc in ("linear_fc1", "linear_fc2")}
    pairs = {"output": (ours[0], theirs[0]), "input grad": (ours[1], theirs[1]), **weight_grads}
    return {"module": type(grouped).__name__, "linear": type(grouped.linear_fc1).__name__, "bias": ours[2],
            "shapes": {fc: tuple(getattr(grouped, fc).weight.shape) for fc in ("linear_fc1", "linear_fc2")},
            "equal": {k: torch.equal(a, b) for k, (a, b) in pairs.items()},
            "max_diff": {k: (a.float() - b.float()).abs().max().item() for k, (a, b) in pairs.items()},
            "max_abs": {k: b.float().abs().max().item() for k, (_, b) in pairs.items()}}


def _stacked_grads(gpt) -> dict:
    """Every parameter's grad, SequentialMLP's per-expert ones stacked as the grouped tensors hold them."""
    import torch

    grads, experts = {}, {}
    for name, p in gpt.named_parameters():
        if p.grad is None:
            continue
        if ".local_experts." in name:
            prefix, rest = name.split(".local_experts.")
            expert, projection = rest.split(".", 1)
            experts.setdefault(f"{prefix}.{projection}", {})[int(expert)] = p.grad
        else:
            grads[name] = p.grad
    grads.update({name: torch.stack([by[e] for e in range(len(by))]) for name, by in experts.items()})
    return grads


def _compare_models(preset: str) -> dict:
    import torch

    from miles.backends.megatron_backend.convert import hf_moe_layout, hf_to_megatron, megatron_to_hf
    from miles.backends.megatron_backend.model import build_gpt_model
    from test_megatron_cpu_forward import BATCH, SEQ, VOCAB, _hf_model

    hf_model = _hf_model(preset, {})
    hf_state = hf_model.state_dict()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    runs = {}
    for grouped in (False, True):
        gpt, _, uses_te = build_gpt_model(hf_model.config, params_dtype=torch.float32, grouped_experts=grouped)
        gpt.load_state_dict(hf_to_megatron(hf_state, hf_model.config, fused_norms=uses_te, grouped_experts=grouped),
                            strict=False)
        back = megatron_to_hf(gpt.state_dict(), hf_model.config, fused_norms=uses_te,
                              hf_moe_layout=hf_moe_layout(hf_state))
        gpt.eval()
        logits = gpt(tokens, positions, None)
        logits.pow(2).mean().backward()
        experts = sorted({type(m).__name__ for n, m in gpt.named_modules() if n.endswith(".experts")})
        runs[grouped] = dict(logits=logits.detach(), grads=_stacked_grads(gpt), experts=experts,
                             export_equal=set(back) == set(hf_state) and all(torch.equal(back[k], v)
                                                                             for k, v in hf_state.items()))
    ours, theirs = runs[True], runs[False]
    return {"experts": (ours["experts"], theirs["experts"]), "export_equal": ours["export_equal"],
            "logits_equal": torch.equal(ours["logits"], theirs["logits"]),
            "max_logit_diff": (ours["logits"] - theirs["logits"]).abs().max().item(),
            "grad_names_equal": set(ours["grads"]) == set(theirs["grads"]),
            "grads_unequal": sorted(k for k, grad in ours["grads"].items()
                                    if k not in theirs["grads"] or not torch.equal(grad, theirs["grads"][k]))}


def _child(repo: str, unit_tests: str, megatron_path: str, port: int, results) -> dict:
    sys.path[:0] = [megatron_path, repo, unit_tests]
    import torch
    from megatron.core import parallel_state

    # both builds' grads compared with torch.equal: the embedding's backward (an index accumulate under Qwen3.5's
    # deterministic_mode) sums a token's rows in thread order unless torch is asked for its deterministic kernels
    torch.use_deterministic_algorithms(True)
    progress(results, "grouped", "join a gloo world of 1")
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    from test_megatron_cpu_forward import _compare

    out = {}
    for dtype in ("float32", "bfloat16"):
        progress(results, "grouped", f"experts module {dtype}")
        out[f"experts-{dtype}"] = compare_experts(dtype)
    for case, preset in MODELS.items():
        progress(results, "grouped", f"model {case}")
        out[f"model-{case}"] = _compare_models(preset)
    progress(results, "grouped", "qwen3-moe against transformers")
    out["transformers"] = _compare("qwen3-moe-tiny", {}, grouped_experts=True)
    return out


@pytest.fixture(scope="module")
def compared(megatron_cpu):
    from miles.weights import free_port

    here = os.path.dirname(os.path.abspath(__file__))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = start(ctx, results, (_child, (os.path.join(here, "..", ".."), here, megatron_cpu, free_port(), results)))
    return collect(procs, results, TIMEOUT)[0]


def test_grouped_experts_module_equals_sequential_mlp_in_fp32(compared):
    got = compared["experts-float32"]
    print(f"\nexperts fp32: max diffs {got['max_diff']}")
    assert (got["module"], got["linear"]) == ("TEGroupedMLP", "ColumnParallelGroupedLinear")
    assert got["shapes"] == {"linear_fc1": (8, 64, 64), "linear_fc2": (8, 64, 32)}  # [E, 2 x 32, 64], [E, 64, 32]
    assert got["bias"] is None
    assert all(got["equal"].values()), got["max_diff"]


def test_grouped_experts_module_matches_sequential_mlp_in_bf16(compared):
    got = compared["experts-bfloat16"]
    print(f"\nexperts bf16: max diffs {got['max_diff']} (largest values {got['max_abs']})")
    for k, diff in got["max_diff"].items():  # 1 bf16 ulp of the largest value: 2^-7 relative
        assert diff <= got["max_abs"][k] * 2 ** -7, (k, diff)


@pytest.mark.parametrize("case", list(MODELS))
def test_a_grouped_experts_model_equals_the_sequential_mlp_build(compared, case):
    got = compared[f"model-{case}"]
    print(f"\n{case} fp32: grouped vs SequentialMLP max |logit diff| {got['max_logit_diff']:.3g}")
    assert got["experts"] == (["TEGroupedMLP"], ["SequentialMLP"])
    assert got["export_equal"], "the HF export of the loaded grouped weights differs from what was loaded"
    assert got["logits_equal"], got["max_logit_diff"]
    assert got["grad_names_equal"] and not got["grads_unequal"], got["grads_unequal"][:4]


def test_a_grouped_experts_model_matches_transformers(compared):
    from test_megatron_cpu_forward import FP32_LOGPROB_TOL, GRAD_NORM_RTOL

    got = compared["transformers"]
    ours, theirs = got["grad_norms"]
    print(f"\nqwen3-moe grouped, fp32: max |logprob diff| vs transformers {got['max_logprob_diff']:.2e}; grad norm "
          f"megatron {ours:.6f} transformers {theirs:.6f}")
    assert not got["wrong_shapes"], got["wrong_shapes"]
    assert got["export_equal"]
    assert got["max_logprob_diff"] < FP32_LOGPROB_TOL
    assert abs(ours - theirs) <= GRAD_NORM_RTOL * theirs



def _grouped_rank(etp: int, *args) -> dict:
    """A rank of tests/megatron_parallel.py's run whose RunConfig asks for grouped experts (``moe_grouped_gemm``,
    what --moe-grouped-gemm sets), split over expert-tensor-parallel size ``etp``: both set on the config as the run
    sets the backend and the layout (its flags are validated on the torch backend, which refuses the flag)."""
    import dataclasses

    import megatron_parallel

    layout_config = megatron_parallel._config

    def grouped_config(*config_args, **config_kwargs):
        config = layout_config(*config_args, **config_kwargs)
        return dataclasses.replace(config, training=dataclasses.replace(
            config.training, expert_tensor_parallel_size=etp, moe_grouped_gemm=True))

    megatron_parallel._config = grouped_config
    return megatron_parallel._rank(*args)


@pytest.fixture(scope="module", params=[(dict(tp=1, ep=2, dp=2), 1), (dict(tp=2, sp=True), 2)],
                ids=["ep2", "tp2-etp2-sp"])
def trained(request, megatron_cpu, tmp_path_factory):
    """fp32, 3 rollouts of qwen3-moe-tiny: TP1's run (SequentialMLP) and the layout's with grouped experts (EP2 x DP2:
    each rank holds half of each layer's experts on the grouped axis, the export joins them; TP2 x ETP2 + SP: each
    rank half of each expert)."""
    import functools

    import megatron_parallel
    from megatron_parallel import FP32, Layout, Placement, run

    from miles.models import write_random_model

    layout_args, etp = request.param
    root = tmp_path_factory.mktemp("grouped-trainer")
    model = write_random_model(str(root / "qwen3-moe-tiny"), "qwen3-moe-tiny")
    placement = Placement("cpu", "gloo", megatron_path=megatron_cpu)
    layout = Layout(**layout_args)
    tp1 = run(layout.baseline(), model=model, placement=placement, root=str(root / "tp1"), timeout=TIMEOUT,
              runs=(FP32,))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(megatron_parallel, "_rank", functools.partial(_grouped_rank, etp))
        grouped = run(layout, model=model, placement=placement, root=str(root / "grouped"), timeout=TIMEOUT,
                      runs=(FP32,))
    return layout, etp, tp1[FP32], grouped[FP32]


def test_the_grouped_experts_flag_reaches_the_trainers_build(trained):
    """The trainer builds (and converts into) grouped experts when its RunConfig asks, on every rank; else
    SequentialMLP."""
    layout, _, tp1, grouped = trained
    assert {r: got["experts"] for r, got in tp1.items()} == {r: ["SequentialMLP"] for r in range(layout.dp)}
    assert {r: got["experts"] for r, got in grouped.items()} == {r: ["TEGroupedMLP"] for r in range(layout.world)}


def test_the_trainer_with_grouped_experts_trains_as_sequential_mlp_at_tp1(trained):
    """The losses and every exported weight of the grouped run match TP1's SequentialMLP run up to reduction order
    (tests/megatron_parallel.check_fp32)."""
    from megatron_parallel import check_fp32

    layout, etp, tp1, grouped = trained
    check_fp32(layout, tp1[0], grouped, f"qwen3-moe grouped experts (ETP{etp}) vs SequentialMLP cpu")
