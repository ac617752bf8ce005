"""The product's megatron trainer at TP2, PP2, TP2 x PP2 + SP, EP2 x TP2 + SP (MoE) and GLM-5's and Qwen3.5-MoE's
architectures at TP2 + SP / PP2, on CPU over gloo, against TP = PP = EP = 1 at the same data-parallel size.

megatron-core 0.19.2's own code runs, patched for CPU by the test harness (tests/megatron_cpu: the one list of
its changes is tests/megatron_cpu/patches.py); the trainer is ``MegatronTrainer`` as ``miles train`` builds it.
One spawned process per rank trains 3 rollouts four times in a row: in bf16 with the optimizer state resident,
streamed (saving after rollout 1) and resumed from that checkpoint, then resident in fp32. The checks are
tests/megatron_parallel.py's: in fp32 the losses and every exported weight match TP1's up to reduction order
(``check_fp32``: a wrong shard shows there, while bf16's rounding hides it in the loss); in bf16 (``check_layout``,
the GPU suite's) losses and weights within bf16 tolerance of TP1, every rank's export the same, replicated tensors
bit-identical over TP, streamed == resident bit for bit, the resume exact. At TP2 the checkpoint's weights are also
resumed alone (``--no-load-optim``), optimizer state resident and streamed: bit-identical.

TP1 baselines are computed once per model (module-scoped) and shared by the layouts of that model.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_parallel import (FP32, RUNS, WEIGHTS_ONLY, Layout, Placement, check_fp32, check_layout,  # noqa: E402
                               check_weights_only, run)

TIMEOUT = 300  # per run: 2 x TIMEOUT in all, then the run fails naming each rank's last stage


@pytest.fixture(scope="module")
def cpu_runs(megatron_cpu, tmp_path_factory):
    """``runs(layout, preset)`` -> that layout's runs (RUNS, by rank) and the TP1 baseline of ``preset`` at the
    layout's data-parallel size (computed once per model and DP size)."""
    from miles.models import write_random_model

    placement = Placement("cpu", "gloo", megatron_path=megatron_cpu)
    root = tmp_path_factory.mktemp("megatron-cpu")
    models, baselines = {}, {}

    def runs(layout: Layout, preset, extra: tuple = ()):
        if preset and preset not in models:
            models[preset] = write_random_model(str(root / preset), preset)
        model = models.get(preset)
        key = (preset, layout.baseline())
        if key not in baselines:
            tp1 = run(layout.baseline(), model=model, placement=placement, root=str(root / f"tp1-{len(baselines)}"),
                      timeout=TIMEOUT, runs=("resident", FP32))
            baselines[key] = {name: by_rank[0] for name, by_rank in tp1.items()}
        return baselines[key], run(layout, model=model, placement=placement, root=str(root / str(len(baselines))),
                                   timeout=TIMEOUT, runs=(*RUNS, *extra, FP32))

    return runs


@pytest.mark.parametrize("layout,preset", [
    (Layout(2), None), (Layout(1, pp=2), None), (Layout(2, pp=2, sp=True), None),
    (Layout(2, ep=2, dp=2, sp=True), "qwen3-moe-tiny"),
    # GLM-5 (MLA, the sparse attention's indexer, MoE; PP2's second stage starts on layer 1: layer 2 shares
    # layer 1's top-k) and Qwen3.5-MoE (Gated DeltaNet: megatron-core's torch kernels on CPU)
    (Layout(2, sp=True), "glm5-tiny"), (Layout(1, pp=2, first_stage_layers=1), "glm5-tiny"),
    (Layout(2, sp=True), "qwen3.5-moe-tiny")],
    ids=["tp2", "pp2", "tp2pp2sp", "ep2tp2sp-moe", "tp2sp-glm5", "pp2-glm5", "tp2sp-qwen35"])
def test_megatron_on_cpu_trains_as_tp1_streams_bit_identically_and_resumes_exactly(cpu_runs, layout, preset):
    weights_only = layout == Layout(2) and preset is None  # once: the store's binding, not the layout, is checked
    tp1, runs = cpu_runs(layout, preset, WEIGHTS_ONLY if weights_only else ())
    label = f"{preset or 'tiny llama'} cpu"
    if weights_only:
        check_weights_only(*(runs[name] for name in WEIGHTS_ONLY))
    check_fp32(layout, tp1[FP32], runs[FP32], label)
    check_layout(layout, tp1["resident"], runs["resident"], runs["streamed"], runs["resumed"], label)
