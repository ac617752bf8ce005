"""Runs of the product's megatron trainer at a parallel layout, one spawned process per rank, driven in-process
(no Ray): shared by the CPU suite (tests/unit/test_megatron_cpu_parallel.py, gloo, megatron-core patched for CPU
by tests/megatron_cpu) and the GPU one (tests/gpu/test_parallel_megatron_gpu.py).

A run is ``resident`` (optimizer state in memory), ``streamed`` (the store; saves after rollout SAVE_AFTER),
``resumed`` (loads that checkpoint and trains the rollouts after it), all bf16, or ``fp32`` (resident). Each rank
reports its losses, its export (every rank's: each feeds an engine), its replicated tensors and its routed experts'
module kind; :func:`check_layout` (bf16) and :func:`check_fp32` compare them with TP1's.

Each rank prints its stage as it starts it (flushed); a child that dies fails the run at once with the stack
it died in, and a run that stops fails after 2 x timeout naming each rank's last stage (tests/spawned.py).
"""

import dataclasses
import functools
import multiprocessing as mp
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spawned import collect, progress, start  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ROLLOUTS = 3
SAVE_AFTER = 1  # the streamed run saves after this rollout; the resumed run loads it and trains the rest
LOSS_TOL = 0.05  # bf16: TP changes the reduction order of every matmul
WEIGHT_TOL = 0.05


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


class Placement(NamedTuple):
    """Where the ranks run: ``device`` "cpu" (gloo, megatron-core from ``megatron_path``), or "cuda" with each
    rank's GPU (``gpus``) and collective backend ("gloo" with the ranks on one GPU: staged collectives)."""
    device: str
    backend: str
    gpus: tuple = ()
    megatron_path: Optional[str] = None  # the patched megatron-core's folder (CPU), put first on sys.path


def _config(root: str, layout: Layout, model: Optional[str], stream: bool, dtype: str):
    sys.path.insert(0, REPO)
    from miles.config import parse_args
    from miles.preflight import validate_args

    os.makedirs(root, exist_ok=True)
    argv = ["--hf-checkpoint", model] if model else ["--tiny-model"]
    argv += ["--model-dtype", dtype, "--micro-batch-size", "2", "--lr", "1e-3", "--deterministic-mode",
             "--offload-train-disk-dir", os.path.join(root, "disk"), "--num-cpus-per-rank", "1"]
    if stream:
        argv += ["--stream-optimizer-state-to-disk", "--offload-train-target", "disk"]
    config = validate_args(parse_args(argv))
    # the trainer is driven directly (no Ray, no validation of the layout: miles train asks for
    # --experimental-model-parallel until the GPU test passes on GPUs)
    return dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, num_train_ranks=layout.world),
        training=dataclasses.replace(config.training, train_backend="megatron", tensor_model_parallel_size=layout.tp,
                                     pipeline_model_parallel_size=layout.pp, expert_model_parallel_size=layout.ep,
                                     sequence_parallel=layout.sp,
                                     decoder_first_pipeline_num_layers=layout.first_stage_layers),
        optimizer=dataclasses.replace(config.optimizer, stream_optimizer_state_bucket_numel=20_000))


def rollout(step: int):
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


RUNS = ("resident", "streamed", "resumed")
# the weights alone resumed from the streamed run's checkpoint (--no-load-optim: fresh Adam state, the masters
# taken from the loaded weights), optimizer state resident or streamed: bit-identical
WEIGHTS_ONLY = ("weights-only-resident", "weights-only-streamed")
FP32 = "fp32"  # a resident run in fp32: TP/PP/EP change only the reduction order, so it matches TP1 tightly
# seen: 3e-8 (every layout and model); a wrong shard moves it by ~7e-4, which bf16's rounding hides (bf16 TP2 vs
# TP1: 4e-5 to 1.4e-4); a grad missing part of its TP sum, by 1.4e-5 after 3 steps (GLM-5's rope key, before the fix)
FP32_LOSS_TOL = 1e-6
# seen: <= 2e-5 (Adam amplifies reduction order in small grads); a grad missing part of its TP sum moves a weight by
# up to 2 x lr x 3 steps = 0.006 (Adam's steps are lr-sized whatever the grad): 0.0055 was GLM-5's kv_a_proj_with_mqa
FP32_WEIGHT_TOL = 1e-4


def _train(rank: int, layout: Layout, model: Optional[str], rendezvous: str, placement: Placement, root: str,
           run: str, stage) -> dict:
    """One trainer of ``run`` on this rank: join the world, build, train (resumed: load first), export, leave."""
    from miles.backends.megatron_backend.trainer import MegatronTrainer

    world, tag = layout.world, str(layout).replace(" ", "-")
    dtype = "fp32" if run == FP32 else "bf16"
    stage(f"{run}: join the {placement.backend} world on {placement.device}")
    if placement.device == "cuda":
        torch.cuda.set_device(placement.gpus[rank])
    # a file rendezvous, not a port chosen minutes before this run starts (another process may have taken it);
    # the trainer then finds the world joined (its own tcp join runs in miles train: tests/e2e)
    torch.distributed.init_process_group(placement.backend, init_method=f"file://{rendezvous}", rank=rank,
                                         world_size=world)
    config = _config(os.path.join(root, f"{run}-{tag}"), layout, model,
                     stream=run in ("streamed", "resumed", "weights-only-streamed"), dtype=dtype)
    trainer = MegatronTrainer(config, rank=rank, world_size=world, rank_dir=config.paths.rank_dir(0, rank))
    stage(f"{run}: init (model parallel groups, build, load, DDP, optimizer)")
    trainer.init("joined: file rendezvous")
    save_root = os.path.join(root, f"checkpoints-{tag}")
    first, checkpoint_base = 0, None
    if run == "resumed" or run in WEIGHTS_ONLY:
        stage(f"{run}: load the checkpoint")
        from miles import checkpoint

        trainer.load(checkpoint.checkpoint_path(save_root, SAVE_AFTER + 1), load_optimizer=run == "resumed")
        first = SAVE_AFTER + 1
    losses = {}
    for step in range(first, ROLLOUTS):
        stage(f"{run}: train rollout {step}")
        losses[step] = trainer.train(step, *rollout(step))["loss"]
        if run == "streamed" and step == SAVE_AFTER:
            stage(f"{run}: save after rollout {step}")
            checkpoint_base = _save(trainer, config, rank, save_root, step + 1)
    from miles.backends.megatron_backend.families import describe
    from miles.backends.megatron_backend.tp_shards import split_kind

    rules = describe(trainer.engine.hf_config).tp_rules
    replicated = {k: v.float().tolist() for k, v in trainer.engine.gpt.state_dict().items()  # norms, routers, indexers
                  if not k.endswith("_extra_state") and split_kind(k, rules) == "replicated"}
    # the routed experts' modules as the trainer built them: SequentialMLP, or TEGroupedMLP (--moe-grouped-gemm)
    experts = sorted({type(m).__name__ for name, m in trainer.engine.gpt.named_modules() if name.endswith(".experts")})
    stage(f"{run}: export (a collective: every TP and PP rank takes part)")
    exported = trainer.export_weights()
    weights = {k: v.float().tolist() for k, v in exported.items()}  # every rank's: each feeds an engine
    stage(f"{run}: shutdown")
    trainer.shutdown()
    return {"losses": losses, "weights": weights, "replicated": replicated, "experts": experts,
            "checkpoint": checkpoint_base}


def _rank(rank: int, layout: Layout, model: Optional[str], rendezvous: dict, placement: Placement, root: str,
          results) -> dict:
    """One rank: the runs of ``rendezvous`` in order, one trainer each (a fresh world joined through its file),
    each stage printed (flushed) and reported to the parent as it starts."""
    stage = functools.partial(progress, results, f"{layout} rank {rank}")
    stage("import")
    sys.path.insert(0, REPO)
    if placement.megatron_path:
        sys.path.insert(0, placement.megatron_path)
    if placement.device == "cuda" and placement.backend == "gloo":  # before megatron binds collectives at import
        sys.path.insert(0, os.path.join(REPO, "tests"))
        import staged_collectives

        staged_collectives.install()
    runs = {run: _train(rank, layout, model, path, placement, root, run, stage) for run, path in rendezvous.items()}
    stage("done")
    return {"rank": rank, **runs}


def run(layout: Layout, *, model: Optional[str], placement: Placement, root: str, timeout: float,
        runs: tuple = RUNS) -> dict:
    """``{run: {rank: result}}`` of ``runs`` at ``layout``, all in one spawned process per rank (one megatron
    import each), in order: ``resident``, ``streamed`` (saves after rollout SAVE_AFTER), ``resumed`` (loads that
    checkpoint and trains the rollouts after it), WEIGHTS_ONLY (that checkpoint's weights alone), all bf16, and
    ``fp32`` (resident)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.makedirs(root, exist_ok=True)
    where = tempfile.mkdtemp(prefix=".rendezvous-", dir=root)
    rendezvous = {name: os.path.join(where, name) for name in runs}
    procs = start(ctx, results, *[(_rank, (r, layout, model, rendezvous, placement, root, results))
                                  for r in range(layout.world)])
    got = collect(procs, results, timeout)
    return {name: {g["rank"]: g[name] for g in got} for name in runs}


def diffs(a: dict, b: dict) -> list[tuple[float, str]]:
    """max |a - b| of each tensor, largest first."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return sorted(((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item(), k) for k in a)[::-1]


def max_diff(a: dict, b: dict) -> float:
    return diffs(a, b)[0][0]


def check_weights_only(resident: dict, streamed: dict) -> None:
    """The weights resumed alone train the same with the optimizer state streamed as resident: the store's masters
    are refreshed from the loaded weights."""
    assert streamed[0]["losses"] == resident[0]["losses"], (streamed[0]["losses"], resident[0]["losses"])
    assert max_diff(streamed[0]["weights"], resident[0]["weights"]) == 0.0, \
        diffs(streamed[0]["weights"], resident[0]["weights"])[:3]


def check_fp32(layout: Layout, tp1: dict, fp32: dict, label: str) -> None:
    """In fp32 the layout trains as TP1 up to reduction order: losses and every exported weight."""
    loss_diff = max(abs(tp1["losses"][i] - fp32[0]["losses"][i]) for i in range(ROLLOUTS))
    weight_diffs = diffs(tp1["weights"], fp32[0]["weights"])
    print(f"\n{layout} {label} fp32: max |loss diff| vs TP1 {loss_diff:.3g}; max |weight diff| "
          f"{weight_diffs[0][0]:.3g} ({', '.join(f'{name} {d:.3g}' for d, name in weight_diffs[:3])})")
    for r in fp32:
        assert max_diff(fp32[r]["weights"], fp32[0]["weights"]) == 0.0, f"fp32: rank {r} exports other weights"
    assert loss_diff < FP32_LOSS_TOL, f"fp32: max |loss diff| vs TP1 {loss_diff}"
    assert weight_diffs[0][0] < FP32_WEIGHT_TOL, f"fp32: max |weight diff| vs TP1 {weight_diffs[:3]}"


def check_layout(layout: Layout, tp1: dict, resident: dict, streamed: dict, resumed: dict, label: str) -> None:
    """In bf16: the layout trains as TP1 within bf16 tolerance, every rank exports the same weights and holds the
    same replicated tensors as its TP group's rank 0, the streamed state is bit-identical to resident Adam, and a
    resume on the same layout continues bit for bit."""
    loss_diff = max(abs(tp1["losses"][i] - resident[0]["losses"][i]) for i in range(ROLLOUTS))
    weight_diffs = diffs(tp1["weights"], resident[0]["weights"])
    weight_diff = weight_diffs[0][0]
    resume_diffs = diffs(streamed[0]["weights"], resumed[0]["weights"])
    print(f"\n{layout} {label}: losses TP1 {list(tp1['losses'].values())} "
          f"parallel {list(resident[0]['losses'].values())} streamed {list(streamed[0]['losses'].values())} "
          f"resumed after rollout {SAVE_AFTER} {list(resumed[0]['losses'].values())}; max |loss diff| vs TP1 "
          f"{loss_diff:.3g}; max |weight diff| after {ROLLOUTS} rollouts {weight_diff:.3g} (largest: "
          f"{', '.join(f'{name} {d:.3g}' for d, name in weight_diffs[:4])}); resumed vs uninterrupted, largest "
          f"weight diffs: {', '.join(f'{name} {d:.3g}' for d, name in resume_diffs[:3])}")
    for r in resident:
        assert max_diff(resident[r]["weights"], resident[0]["weights"]) == 0.0, f"rank {r} exports other weights"
        # a replicated tensor whose grads miss their sum over TP drifts apart on the TP ranks, unseen in the
        # export (it takes TP rank 0's) and barely in the losses
        mine, tp_rank0 = resident[r]["replicated"], resident[r - r % layout.tp]["replicated"]
        assert max_diff(mine, tp_rank0) == 0.0, f"rank {r}'s replicated tensors: {diffs(mine, tp_rank0)[:3]}"
    assert all(resident[r]["losses"] == resident[0]["losses"] for r in resident), "one replica reports one loss"
    assert loss_diff < LOSS_TOL, f"max |loss diff| vs TP1 {loss_diff}"
    assert weight_diff < WEIGHT_TOL, f"max |weight diff| vs TP1 {weight_diffs[:3]}"
    assert streamed[0]["losses"] == resident[0]["losses"], "streamed state is bit-identical to resident Adam"
    assert max_diff(streamed[0]["weights"], resident[0]["weights"]) == 0.0
    assert streamed[0]["checkpoint"], "the streamed run saved"
    assert all(resumed[0]["losses"][i] == streamed[0]["losses"][i] for i in resumed[0]["losses"]), \
        "a resume on the same layout continues bit for bit"
    assert max_diff(resumed[0]["weights"], streamed[0]["weights"]) == 0.0
