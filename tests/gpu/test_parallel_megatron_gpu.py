"""The megatron trainer at TP=2 or PP=2 against TP=PP=1: two processes, driven in-process (no Ray), tiny Llama.

Run on the GPU host: ``python -m pytest -q -s tests/gpu/test_parallel_megatron_gpu.py`` (needs CUDA and
megatron-core). Two cases:

- ``one_gpu``: both TP ranks on GPU 0, their world joined with gloo (NCCL refuses two ranks on one device;
  gloo carries CUDA tensors for all-reduce and broadcast only). Megatron's TP without sequence parallelism
  communicates by all-reduce, but megatron's distributed optimizer gathers the updated params at every step
  with a coalesced all-gather over the data-parallel group, even of size 1; on an H200 (torch 2.11) gloo
  segfaults there with CUDA tensors, already in the TP=1 baseline (stack: ``_coalescing_manager`` <-
  ``start_param_sync`` <- ``DistributedOptimizer.step_with_ready_grads``). So TP on one GPU cannot run with
  this trainer: the case is a strict xfail, failing the day gloo carries it (then make it a plain case).
  Each rank prints its stage as it starts it (flushed); a child that dies fails the run at once with the stack
  it died in, and a run that stops fails after 2 x TIMEOUT naming each rank's last stage (tests/spawned.py).
- ``two_gpus`` (needs 2 GPUs; NCCL): the same checks, for TP=2 and for PP=2 (Megatron's 1F1B schedule
  sends activations between the stages point to point, which gloo cannot do with CUDA tensors: PP has no
  one-GPU case).

Checks: 3 rollouts' losses within bf16 tolerance of TP=1 on the same samples (max |diff| printed); at TP=2 the
streamed optimizer state gives bit-identical losses and weights to resident Adam; the weights gathered for the
handoff (export_weights: TP gather part by part) are the HF tensors, within bf16 tolerance of TP=1's.
"""

import dataclasses
import functools
import multiprocessing as mp
import os
import socket
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, progress, start  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (megatron-core has no CPU path)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (Python >= 3.12; the device bundle has it)")

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
ROLLOUTS = 3
LOSS_TOL = 0.05  # bf16: TP changes the reduction order of every matmul
WEIGHT_TOL = 0.05
# per run (TP1, then the parallel layout resident, then streamed): 2 x TIMEOUT in all, then the run fails naming
# each rank's last stage with its stacks; a tiny llama's 3 rollouts take ~15 s on a CPU (megatron's import most)
TIMEOUT = 150


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: str, tp: int, pp: int, stream: bool):
    sys.path.insert(0, REPO)
    from miles.config import parse_args, validate_args

    os.makedirs(root, exist_ok=True)
    argv = ["--tiny-model", "--model-dtype", "bf16", "--micro-batch-size", "2", "--lr", "1e-3",
            "--offload-train-disk-dir", os.path.join(root, "disk")]
    if stream:
        argv += ["--stream-optimizer-state-to-disk", "--offload-train-target", "disk"]
    config = validate_args(parse_args(argv))
    # the trainer is driven directly (no Ray, no validation of the layout: miles train asks for
    # --experimental-model-parallel until this test passes on GPUs)
    return dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, num_train_ranks=tp * pp),
        training=dataclasses.replace(config.training, train_backend="megatron", tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp),
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


def _rank(rank: int, sizes: tuple[int, int], port: int, backend: str, gpu: int, root: str, stream: bool,
          results) -> dict:
    """One rank: join the world, build the trainer, train ROLLOUTS rollouts, export the weights; each stage
    printed (flushed) and reported to the parent as it starts."""
    tp, pp = sizes
    world = tp * pp
    stage = functools.partial(progress, results, f"tp{tp} pp{pp} {'streamed' if stream else 'resident'} rank {rank}")
    stage("import")
    sys.path.insert(0, REPO)
    from miles.backends.megatron_backend.trainer import MegatronTrainer

    stage(f"join the {backend} world on cuda:{gpu}")
    torch.cuda.set_device(gpu)
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = _config(os.path.join(root, f"{'streamed' if stream else 'resident'}-tp{tp}-pp{pp}"), tp, pp, stream)
    trainer = MegatronTrainer(config, rank=rank, world_size=world, rank_dir=config.paths.rank_dir(0, rank))
    stage("init (model parallel groups, build, load, DDP, optimizer)")
    trainer.init(f"127.0.0.1:{port}")
    losses = []
    for step in range(ROLLOUTS):
        stage(f"train rollout {step}")
        losses.append(trainer.train(step, *_rollout(step))["loss"])
    stage("export (a collective: every TP and PP rank takes part)")
    exported = trainer.export_weights()
    weights = {k: v.float().tolist() for k, v in exported.items()} if rank == 0 else None
    stage("shutdown")
    trainer.shutdown()
    stage("done")
    return {"rank": rank, "losses": losses, "weights": weights}


def _run(sizes: tuple[int, int], backend: str, gpus: list[int], root: str, stream: bool) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = start(ctx, results, *[(_rank, (r, sizes, port, backend, gpus[r], root, stream, results))
                                  for r in range(sizes[0] * sizes[1])])
    return {g["rank"]: g for g in collect(procs, results, TIMEOUT)}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


GLOO_CUDA_ALLGATHER = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="gloo segfaults in the distributed optimizer's coalesced all-gather of CUDA tensors (seen on H200, torch 2.11)")


@pytest.mark.parametrize("sizes,placement", [pytest.param((2, 1), "one_gpu", marks=GLOO_CUDA_ALLGATHER),
                                             ((2, 1), "two_gpus"), ((1, 2), "two_gpus")],
                         ids=["tp2-one_gpu", "tp2-two_gpus", "pp2-two_gpus"])
def test_tp2_or_pp2_trains_as_tp1_and_streams_bit_identically(tmp_path, sizes, placement):
    if placement == "two_gpus" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (this host has one; TP on one GPU cannot run: see the one_gpu case)")
    backend, gpus = ("gloo", [0, 0]) if placement == "one_gpu" else ("nccl", [0, 1])
    tp1 = _run((1, 1), backend, [0], str(tmp_path), stream=False)[0]
    resident = _run(sizes, backend, gpus, str(tmp_path), stream=False)
    streamed = _run(sizes, backend, gpus, str(tmp_path), stream=True)
    loss_diff = max(abs(a - b) for a, b in zip(tp1["losses"], resident[0]["losses"]))
    weight_diff = _max_diff(tp1["weights"], resident[0]["weights"])
    print(f"\nTP{sizes[0]} PP{sizes[1]} {placement} ({backend}): losses TP1 {tp1['losses']} parallel "
          f"{resident[0]['losses']} streamed {streamed[0]['losses']}; max |loss diff| vs TP1 {loss_diff:.3g}; "
          f"max |weight diff| after {ROLLOUTS} rollouts {weight_diff:.3g}")
    assert resident[0]["losses"] == resident[1]["losses"], "the ranks of one replica report one loss"
    assert loss_diff < LOSS_TOL
    assert weight_diff < WEIGHT_TOL
    assert streamed[0]["losses"] == resident[0]["losses"], "streamed state is bit-identical to resident Adam"
    assert _max_diff(streamed[0]["weights"], resident[0]["weights"]) == 0.0
