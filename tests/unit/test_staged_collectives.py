"""tests/staged_collectives.py (the GPU tests' way to run several ranks on one GPU): every replaced call, staged
through a host copy, gives what the collective means, on two gloo ranks (CPU tensors staged as device tensors
would be); a module that bound a collective before install() is rebound."""

import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, start  # noqa: E402


def _rank(rank: int, port: int) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import types

    import torch.distributed as dist

    early = sys.modules["bound_before_install"] = types.ModuleType("bound_before_install")
    early.gather, early.coalescing = dist.all_gather_into_tensor, dist.distributed_c10d._coalescing_manager
    import staged_collectives

    staged_collectives.install(stage_cpu_tensors=True)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    other = 1 - rank
    got = {}
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    got["all_reduce"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).wait()
    got["all_reduce_avg"] = t.tolist()
    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=1)
    got["broadcast"] = t.tolist()
    parts = [torch.empty(2) for _ in range(2)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    got["all_gather"] = [p.tolist() for p in parts]
    out = torch.empty(2, 3)
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as handle:
        dist.all_gather_into_tensor(out, torch.full((1, 3), float(rank + 10)), async_op=True)
    handle.wait()
    got["all_gather_into_tensor"] = out.tolist()
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(4.0) * (rank + 1))
    got["reduce_scatter_tensor"] = out.tolist()
    out = torch.empty(2)
    dist.all_to_all_single(out, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    got["all_to_all_single"] = out.tolist()
    received = torch.empty(4, requires_grad=True)  # as megatron receives activations
    ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank + 5)), other),
           dist.P2POp(dist.irecv, received, other)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got["batch_isend_irecv"] = received.detach().tolist()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    got["all_gather_object"] = objects
    got["staged_calls"] = staged_collectives.staged_calls["count"]
    got["rebound"] = (early.gather is staged_collectives.all_gather_into_tensor
                      and early.coalescing is staged_collectives._coalescing_manager)
    dist.destroy_process_group()
    return {"rank": rank, **got}


def test_each_staged_call_gives_what_the_collective_means():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    from miles.weights import free_port

    port = free_port()
    procs = start(ctx, results, *[(_rank, (r, port)) for r in range(2)])
    by_rank = {g["rank"]: g for g in collect(procs, results, 120)}
    for rank, got in by_rank.items():
        assert got["all_reduce"] == [3.0] * 3
        assert got["all_reduce_avg"] == [1.5] * 2
        assert got["broadcast"] == [1.0] * 2
        assert got["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["all_gather_into_tensor"] == [[10.0] * 3, [11.0] * 3]
        assert got["reduce_scatter_tensor"] == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])
        assert got["all_to_all_single"] == ([0.0, 10.0] if rank == 0 else [1.0, 11.0])
        assert got["batch_isend_irecv"] == [float(1 - rank + 5)] * 4
        assert got["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert got["staged_calls"] >= 9, got["staged_calls"]
        assert got["rebound"], "a module that bound a collective by name before install() calls the staged one"
