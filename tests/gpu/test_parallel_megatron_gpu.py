"""The megatron trainer at TP2, PP2, TP2 x PP2, TP2 + SP (tiny Llama), EP2 x TP2 + SP (tiny Qwen3-MoE, DP2), and
GLM-5's and Qwen3.5-MoE's architectures at TP2 + SP / PP2 against TP = PP = EP = 1 at the same data-parallel size:
one process per rank and run (resident, streamed, resumed), driven in-process (no Ray) by tests/megatron_parallel.py,
which the CPU suite (tests/unit/test_megatron_cpu_parallel.py) shares.

Run on the GPU host: ``python -m pytest -q -s tests/gpu/test_parallel_megatron_gpu.py`` (needs CUDA and
megatron-core). Two placements:

- ``one_gpu``: every rank on GPU 0, their world joined with gloo, each collective and point-to-point send of a
  CUDA tensor staged through host memory (tests/staged_collectives.py: NCCL refuses two ranks on one device,
  and gloo alone carries CUDA tensors for all-reduce and broadcast only; its coalesced all-gather of them, which
  megatron's distributed optimizer runs at every step, segfaults on torch 2.11). TP2, PP2 (Megatron's 1F1B
  schedule: activations sent stage to stage), TP2 x PP2, TP2 with sequence parallelism, and EP2 x TP2 (4 ranks;
  the experts' token exchange; sequence parallel, which Megatron's MoE layers need under TP).
- ``two_gpus`` (needs 2 GPUs; NCCL): TP2 and PP2, the transport of a real run.

Each rank prints its stage as it starts it (flushed); a child that dies fails the run at once with the stack
it died in, and a run that stops fails after 2 x TIMEOUT naming each rank's last stage (tests/spawned.py).

Checks: 3 rollouts' losses within bf16 tolerance of TP=1 on the same samples (max |diff| printed); at the layout
the streamed optimizer state gives bit-identical losses and weights to resident Adam, and a checkpoint saved after
rollout SAVE_AFTER and resumed on the same layout trains the rest bit for bit; the weights gathered for the
handoff (export_weights: TP gather part by part) are the HF tensors, within bf16 tolerance of TP=1's, the same on
every rank; every replicated tensor (norms, routers, indexers) is bit-identical on the ranks of a TP group.

Runs are compared bit for bit across processes, so each rank runs torch's deterministic algorithms
(``--deterministic-mode``, which fixes cuBLAS's workspace too): without them GLM-5's fp32 router weight grad
differs from one process to the next at fp32 rounding (~1e-11 on the H200, while every other grad, the weights
and the optimizer state before the step are equal), which the resume comparison would blame on the checkpoint.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_parallel import RUNS, Layout, Placement, check_layout, run  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the CPU suite runs these layouts on CPU: tests/unit/test_megatron_cpu_parallel.py)",
                allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# per run (TP1, then the layout resident, streamed, resumed): 2 x TIMEOUT in all, then the run fails naming each
# rank's last stage with its stacks; a tiny llama's 3 rollouts take ~15 s on a CPU (megatron's import most)
TIMEOUT = 150


@pytest.mark.parametrize("layout,preset,placement", [
    (Layout(2), None, "one_gpu"), (Layout(1, pp=2), None, "one_gpu"), (Layout(2, pp=2), None, "one_gpu"),
    (Layout(2, sp=True), None, "one_gpu"), (Layout(2, ep=2, dp=2, sp=True), "qwen3-moe-tiny", "one_gpu"),
    # GLM-5's architecture (MLA, the sparse attention's indexer, MoE; 3 layers: uneven stages at PP2, the second
    # starting on layer 1: layer 2 shares layer 1's top-k) and
    # Qwen3.5-MoE's (Gated DeltaNet + gated attention)
    (Layout(2, sp=True), "glm5-tiny", "one_gpu"), (Layout(1, pp=2, first_stage_layers=1), "glm5-tiny", "one_gpu"),
    (Layout(2, sp=True), "qwen3.5-moe-tiny", "one_gpu"),
    (Layout(2), None, "two_gpus"), (Layout(1, pp=2), None, "two_gpus")],
    ids=["tp2-one_gpu", "pp2-one_gpu", "tp2pp2-one_gpu", "tp2sp-one_gpu", "ep2tp2sp-moe-one_gpu",
         "tp2sp-glm5-one_gpu", "pp2-glm5-one_gpu", "tp2sp-qwen35-one_gpu", "tp2-two_gpus", "pp2-two_gpus"])
def test_tp2_or_pp2_trains_as_tp1_and_streams_bit_identically(tmp_path, layout, preset, placement):
    if placement == "two_gpus" and torch.cuda.device_count() < layout.world:
        pytest.skip(f"needs {layout.world} GPUs (this host has fewer: the one_gpu cases run the same layouts on one)")
    model = None
    if preset:
        sys.path.insert(0, REPO)
        from miles.models import write_random_model

        model = write_random_model(str(tmp_path / preset), preset)
    one_gpu = placement == "one_gpu"
    where = lambda world: Placement("cuda", "gloo" if one_gpu else "nccl",  # noqa: E731
                                    gpus=tuple([0] * world if one_gpu else range(world)))
    tp1 = run(layout.baseline(), model=model, placement=where(layout.baseline().world), root=str(tmp_path / "tp1"),
              timeout=TIMEOUT, runs=("resident",))["resident"][0]
    # one process per rank and run, as validated on the H200 (the CPU suite trains the three in one process)
    runs = {name: run(layout, model=model, placement=where(layout.world), root=str(tmp_path), timeout=TIMEOUT,
                      runs=(name,))[name] for name in RUNS}
    check_layout(layout, tp1, runs["resident"], runs["streamed"], runs["resumed"],
                 f"{preset or 'tiny llama'} {placement}")
