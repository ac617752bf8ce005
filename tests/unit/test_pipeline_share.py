"""model_parallel.broadcast_share over a gloo group of 2 processes (two pipeline stages): the owner stage's part
reaches the other stage with its names, shapes, dtypes and values; the owner keeps its own tensors."""

import multiprocessing as mp
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, start  # noqa: E402

pytest.importorskip("transformers")
TIMEOUT = 120


def part(owner):
    g = torch.Generator().manual_seed(owner)
    return [(f"model.layers.{owner}.mlp.down_proj.weight", torch.randn(3, 5, generator=g)),
            (f"model.layers.{owner}.input_layernorm.weight", torch.randn(5, generator=g).to(torch.bfloat16))]


def stage(rank, port):
    import torch.distributed as dist

    from miles.backends.megatron_backend.model_parallel import broadcast_share

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        share = broadcast_share(dist.group.WORLD, [0, 1], torch.device("cpu"))
        got = []
        for owner in (0, 1):
            for name, t in share(owner, part(owner) if owner == rank else None):
                got.append((name, str(t.dtype), t.float().tolist()))
        return {"rank": rank, "got": got}
    finally:
        dist.destroy_process_group()


def test_each_stage_receives_the_other_stages_part():
    from miles.weights import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    got = collect(start(ctx, results, *[(stage, (r, port)) for r in range(2)]), results, TIMEOUT)
    expected = [(n, str(t.dtype), t.float().tolist()) for owner in (0, 1) for n, t in part(owner)]
    for r in got:
        assert r["got"] == expected, r["rank"]
