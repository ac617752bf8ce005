"""DeepSeek-V3 (transformers ``deepseek_v3``; Kimi-K2 is this model type) built by the Megatron backend against
transformers' own model, in fp32, on CPU: the comparison of test_megatron_cpu_forward.py (the same random
weights, every 1-D weight and the routers' fp32 expert bias perturbed; names and shapes; the HF export
``torch.equal`` to what was loaded; per-token log-probs and one backward's grad norm) over the variants the family
builds: rope pairs interleaved or halves, the low-rank query or a plain q projection, group-limited routing or
not, the default rotary embedding or YaRN (DeepSeek-V3's and Kimi-K2's settings), tied embeddings.

Only the reduction order differs, so the log-probs agree to 1e-5 (seen: <= 1e-6) and the grad norms to 1e-5
relative (seen: 1e-9); a rope rotated in the wrong pairs, a softmax scale without YaRN's mscale or a misread
router moves the log-probs by 1e-2 or more.

Then the product's trainer at TP2 + SP, PP2 and EP2 against TP = PP = EP = 1, fp32, 3 rollouts
(tests/megatron_parallel.py's ``check_fp32``). Seen at TP2 + SP: 3e-8 in the losses and 7e-6 in the weights;
without the rope key's TP grad hook (pieces/mla_layers.py) 2e-5 and 0.0058 (``kv_a_proj_with_mqa``). PP2: 3e-8
and 0; EP2: 0 and 2e-6.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_parallel import FP32, Layout, Placement, check_fp32, run  # noqa: E402

PRESET = "deepseek-v3-tiny"  # 4 layers (1 dense), 8 routed experts in 2 groups (1 kept, top-2), 1 shared expert
LOGPROB_TOL = 1e-5
GRAD_NORM_RTOL = 1e-5
# YaRN at the comparison's 256 positions: factor 4 over 64 original positions, DeepSeek-V3's mscale and betas
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
CASES = {
    "pairs, q_lora, 2 groups": {},
    "one group (Kimi-K2's routing)": dict(n_group=1, topk_group=1),
    "rope halves": dict(rope_interleave=False),
    "no q_lora": dict(q_lora_rank=None),
    "yarn (DeepSeek-V3's)": dict(rope_parameters=YARN),
    # cos/sin scaled by mscale(f, 0.8) / mscale(f, 1.2), the softmax by mscale(f, 1.2)^2
    "yarn, distinct mscales": dict(rope_parameters={**YARN, "mscale": 0.8, "mscale_all_dim": 1.2}),
    # Kimi-K2's betas, one group; halves, no q_lora and tied embeddings on top
    "yarn (Kimi-K2's), halves, no q_lora, tied": dict(
        rope_parameters={**YARN, "beta_fast": 1.0, "beta_slow": 1.0}, n_group=1, topk_group=1,
        rope_interleave=False, q_lora_rank=None, tie_word_embeddings=True),
}
TIMEOUT = 300


@pytest.fixture(scope="module")
def compared(megatron_cpu):
    from test_megatron_cpu_forward import compare_with_transformers  # the one comparison with transformers

    return compare_with_transformers(megatron_cpu, {case: (PRESET, overrides) for case, overrides in CASES.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_v3_forward_and_grads_match_transformers_in_fp32_on_cpu(compared, case):
    got = compared[case]
    ours_norm, theirs_norm = got["grad_norms"]
    print(f"\n{case}, fp32 on CPU: max |logprob diff| {got['max_logprob_diff']:.2e}; grad norm megatron "
          f"{ours_norm:.9f} transformers {theirs_norm:.9f}")
    assert not got["wrong_shapes"], f"(name, built shape, converted shape): {got['wrong_shapes']}"
    assert got["export_equal"], "the HF export of the loaded Megatron weights differs from what was loaded"
    assert got["max_logprob_diff"] <= LOGPROB_TOL
    assert abs(ours_norm - theirs_norm) <= GRAD_NORM_RTOL * theirs_norm



@pytest.fixture(scope="module")
def trained(megatron_cpu, tmp_path_factory):
    """``trained(layout)``: the fp32 run of the preset at ``layout`` (by rank) and its baseline's rank 0 (TP = PP =
    EP = 1 at the same data-parallel size, run once per size)."""
    from miles.models import write_random_model

    root = tmp_path_factory.mktemp("deepseek-v3-parallel")
    model = write_random_model(str(root / PRESET), PRESET)
    placement = Placement("cpu", "gloo", megatron_path=megatron_cpu)
    baselines = {}

    def trained(layout: Layout):
        base = layout.baseline()
        if base not in baselines:
            baselines[base] = run(base, model=model, placement=placement, root=str(root / f"base-{base.dp}"),
                                  timeout=TIMEOUT, runs=(FP32,))[FP32][0]
        got = run(layout, model=model, placement=placement, root=str(root / str(layout).replace(" ", "-")),
                  timeout=TIMEOUT, runs=(FP32,))[FP32]
        return baselines[base], got

    return trained


@pytest.mark.parametrize("layout", [Layout(2, sp=True), Layout(1, pp=2), Layout(1, ep=2, dp=2)],
                         ids=["tp2sp", "pp2", "ep2dp2"])
def test_deepseek_v3_trains_in_parallel_as_without_in_fp32(trained, layout):
    baseline, got = trained(layout)
    check_fp32(layout, baseline, got, f"{PRESET} cpu")
