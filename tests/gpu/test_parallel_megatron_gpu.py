"""The megatron trainer at TP2, PP2, TP2 x PP2, TP2 + SP (tiny Llama), EP2 x TP2 + SP (tiny Qwen3-MoE, DP2), and
GLM-5's and Qwen3.5-MoE's architectures at TP2 + SP / PP2 against TP = PP = EP = 1 at the same data-parallel size:
one process per rank, driven in-process (no Ray).

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

import dataclasses
import functools
import multiprocessing as mp
import os
import sys
from types import SimpleNamespace
from typing import NamedTuple, Optional

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, progress, start  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (megatron-core has no CPU path)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
ROLLOUTS = 3
SAVE_AFTER = 1  # the streamed run saves after this rollout; the resumed run loads it and trains the rest
LOSS_TOL = 0.05  # bf16: TP changes the reduction order of every matmul
WEIGHT_TOL = 0.05
# per run (TP1, then the parallel layout resident, then streamed): 2 x TIMEOUT in all, then the run fails naming
# each rank's last stage with its stacks; a tiny llama's 3 rollouts take ~15 s on a CPU (megatron's import most)
TIMEOUT = 150


class Layout(NamedTuple):
    tp: int
    pp: int = 1
    ep: int = 1
    dp: int = 1
    sp: bool = False  # --sequence-parallel (Megatron's MoE layers need it under TP)
    first_stage_layers: Optional[int] = None  # --decoder-first-pipeline-num-layers (uneven stages)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def baseline(self) -> "Layout":
        """TP = PP = EP = 1 at the same data-parallel size (each rank trains the same samples)."""
        return Layout(1, dp=self.dp)

    def __str__(self) -> str:
        return (f"tp{self.tp} pp{self.pp} ep{self.ep} dp{self.dp}" + (" sp" if self.sp else "")
                + (f" first{self.first_stage_layers}" if self.first_stage_layers else ""))


def _config(root: str, layout: Layout, model: Optional[str], stream: bool):
    sys.path.insert(0, REPO)
    from miles.config import parse_args, validate_args

    os.makedirs(root, exist_ok=True)
    argv = ["--hf-checkpoint", model] if model else ["--tiny-model"]
    argv += ["--model-dtype", "bf16", "--micro-batch-size", "2", "--lr", "1e-3", "--deterministic-mode",
             "--offload-train-disk-dir", os.path.join(root, "disk")]
    if stream:
        argv += ["--stream-optimizer-state-to-disk", "--offload-train-target", "disk"]
    config = validate_args(parse_args(argv))
    # the trainer is driven directly (no Ray, no validation of the layout: miles train asks for
    # --experimental-model-parallel until this test passes on GPUs)
    return dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, num_train_ranks=layout.world),
        training=dataclasses.replace(config.training, train_backend="megatron", tensor_model_parallel_size=layout.tp,
                                     pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
                                     sequence_parallel=layout.sp,
                                     decoder_first_pipeline_num_layers=layout.first_stage_layers),
        optimizer=dataclasses.replace(config.optimizer, stream_optimizer_state_bucket_numel=20_000))


def _rollout(step: int):
    g = torch.Generator().manual_seed(step)
    samples = []
    for i in range(4):
        prompt = torch.randint(4, 60, (5 + i,), generator=g).tolist()
        response = torch.randint(4, 60, (6,), generator=g).tolist()
        samples.append(SimpleNamespace(prompt_ids=prompt, response_ids=response,
                                       response_logprobs=(-torch.rand(6, generator=g) * 4).tolist()))
    return samples, [1.0, -1.0, 0.5, -0.5]


def _save(trainer, config, rank: int, save_root: str, completed: int) -> str:
    """Every rank writes its part, then rank 0 the meta with the layout (as ``miles train --save`` does)."""
    from miles import checkpoint

    base = checkpoint.prepare(save_root, completed) if rank == 0 else checkpoint.checkpoint_path(save_root, completed)
    torch.distributed.barrier()
    trainer.save(base)
    torch.distributed.barrier()
    if rank == 0:
        checkpoint.write_meta(base, next_rollout_id=completed, data_state={}, world_size=config.cluster.num_train_ranks,
                              extra={"streamed_optimizer_state": config.optimizer.stream_optimizer_state_to_disk,
                                     checkpoint.LAYOUT_META: checkpoint.layout_meta(config.parallel_layout)})
    torch.distributed.barrier()
    return base


def _rank(rank: int, layout: Layout, model: Optional[str], port: int, backend: str, gpu: int, root: str, run: str,
          results) -> dict:
    """One rank of ``run`` (resident, streamed: saves after rollout SAVE_AFTER, resumed: loads that checkpoint and
    trains the rollouts after it): join the world, build the trainer, train, export the weights; each stage
    printed (flushed) and reported to the parent as it starts."""
    world, tag = layout.world, str(layout).replace(" ", "-")
    stage = functools.partial(progress, results, f"{layout} {run} rank {rank}")
    stage("import")
    sys.path.insert(0, REPO)
    if backend == "gloo":  # before megatron is imported: it binds some collectives at import
        sys.path.insert(0, os.path.join(REPO, "tests"))
        import staged_collectives

        staged_collectives.install()
    from miles.backends.megatron_backend.trainer import MegatronTrainer

    stage(f"join the {backend} world on cuda:{gpu}")
    torch.cuda.set_device(gpu)
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = _config(os.path.join(root, f"{run}-{tag}"), layout, model, stream=run != "resident")
    trainer = MegatronTrainer(config, rank=rank, world_size=world, rank_dir=config.paths.rank_dir(0, rank))
    stage("init (model parallel groups, build, load, DDP, optimizer)")
    trainer.init(f"127.0.0.1:{port}")
    save_root = os.path.join(root, f"checkpoints-{tag}")
    first, checkpoint_base = 0, None
    if run == "resumed":
        stage("load the checkpoint (weights and streamed optimizer state)")
        from miles import checkpoint

        trainer.load(checkpoint.checkpoint_path(save_root, SAVE_AFTER + 1), load_optimizer=True)
        first = SAVE_AFTER + 1
    losses = {}
    for step in range(first, ROLLOUTS):
        stage(f"train rollout {step}")
        losses[step] = trainer.train(step, *_rollout(step))["loss"]
        if run == "streamed" and step == SAVE_AFTER:
            stage(f"save after rollout {step}")
            checkpoint_base = _save(trainer, config, rank, save_root, step + 1)
    from miles.backends.megatron_backend.tp_shards import split_kind

    replicated = {k: v.float().tolist() for k, v in trainer.gpt.state_dict().items()  # norms, routers, indexers
                  if not k.endswith("_extra_state") and split_kind(k) == "replicated"}
    stage("export (a collective: every TP and PP rank takes part)")
    exported = trainer.export_weights()
    weights = {k: v.float().tolist() for k, v in exported.items()}  # every rank's: each feeds an engine
    stage("shutdown")
    trainer.shutdown()
    stage("done")
    return {"rank": rank, "losses": losses, "weights": weights, "replicated": replicated,
            "checkpoint": checkpoint_base}


def _run(layout: Layout, model: Optional[str], backend: str, placement: str, root: str, run: str) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sys.path.insert(0, REPO)
    from miles.weights import free_port

    port = free_port()
    gpus = [0] * layout.world if placement == "one_gpu" else list(range(layout.world))
    procs = start(ctx, results, *[(_rank, (r, layout, model, port, backend, gpus[r], root, run, results))
                                  for r in range(layout.world)])
    return {g["rank"]: g for g in collect(procs, results, TIMEOUT)}


def _diffs(a: dict, b: dict) -> list[tuple[float, str]]:
    """max |a - b| of each tensor, largest first."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return sorted(((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item(), k) for k in a)[::-1]


def _max_diff(a: dict, b: dict) -> float:
    return _diffs(a, b)[0][0]


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
    backend = "gloo" if placement == "one_gpu" else "nccl"
    run = functools.partial(_run, model=model, backend=backend, placement=placement, root=str(tmp_path))
    tp1 = run(layout.baseline(), run="resident")[0]
    resident = run(layout, run="resident")
    streamed = run(layout, run="streamed")
    resumed = run(layout, run="resumed")
    loss_diff = max(abs(tp1["losses"][i] - resident[0]["losses"][i]) for i in range(ROLLOUTS))
    diffs = _diffs(tp1["weights"], resident[0]["weights"])
    weight_diff = diffs[0][0]
    print(f"\n{layout} {preset or 'tiny llama'} {placement} ({backend}): losses TP1 {list(tp1['losses'].values())} "
          f"parallel {list(resident[0]['losses'].values())} streamed {list(streamed[0]['losses'].values())} "
          f"resumed after rollout {SAVE_AFTER} {list(resumed[0]['losses'].values())}; max |loss diff| vs TP1 "
          f"{loss_diff:.3g}; max |weight diff| after {ROLLOUTS} rollouts {weight_diff:.3g} (largest: "
          f"{', '.join(f'{name} {d:.3g}' for d, name in diffs[:4])}); resumed vs uninterrupted, largest weight "
          f"diffs: {', '.join(f'{name} {d:.3g}' for d, name in _diffs(streamed[0]['weights'], resumed[0]['weights'])[:3])}")
    for r in resident:
        assert _max_diff(resident[r]["weights"], resident[0]["weights"]) == 0.0, f"rank {r} exports other weights"
        # a replicated tensor whose grads miss their sum over TP drifts apart on the TP ranks, unseen in the
        # export (it takes TP rank 0's) and barely in the losses
        mine, tp_rank0 = resident[r]["replicated"], resident[r - r % layout.tp]["replicated"]
        assert _max_diff(mine, tp_rank0) == 0.0, f"rank {r}'s replicated tensors: {_diffs(mine, tp_rank0)[:3]}"
    assert all(resident[r]["losses"] == resident[0]["losses"] for r in resident), "one replica reports one loss"
    assert loss_diff < LOSS_TOL
    assert weight_diff < WEIGHT_TOL
    assert streamed[0]["losses"] == resident[0]["losses"], "streamed state is bit-identical to resident Adam"
    assert _max_diff(streamed[0]["weights"], resident[0]["weights"]) == 0.0
    assert streamed[0]["checkpoint"], "the streamed run saved"
    assert all(resumed[0]["losses"][i] == streamed[0]["losses"][i] for i in resumed[0]["losses"]), \
        "a resume on the same layout continues bit for bit"
    assert _max_diff(resumed[0]["weights"], streamed[0]["weights"]) == 0.0
