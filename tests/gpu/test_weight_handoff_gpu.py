"""Weight handoff on CUDA (skipped without a GPU): CUDA IPC buckets between two processes on one GPU, and
the NCCL weight-update group across two GPUs.

    python -m pytest -q tests/gpu/test_weight_handoff_gpu.py
"""

import multiprocessing as mp
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, start  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from miles.weights import (BucketSpec, WeightUpdateGroup, free_port, iter_buckets, open_bucket,  # noqa: E402
                           receive_bucket, send_buckets, share_bucket, unpack_bucket)

HANDOFFS = 20
MAX_BYTES = 24 << 20
TIMEOUT = 300


def model_weights(device):
    """~230 MB of bf16 and fp32 weights, one of them larger than a bucket; the same in every process."""
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(f"layer{i}.w", (2048, 2048), torch.bfloat16) for i in range(12)]
    shapes += [(f"layer{i}.w32", (2048, 2048), torch.float32) for i in range(6)]
    shapes += [(f"layer{i}.norm", (4096,), torch.float32) for i in range(12)]
    shapes += [("embed", (8192, 2048), torch.bfloat16)]  # 32 MiB > MAX_BYTES: a bucket of its own
    return {name: torch.randn(shape, generator=g).to(dtype).to(device) for name, shape, dtype in shapes}


def advance(weights):
    """What a train step does to the weights (the same deterministic kernels on both sides)."""
    for t in weights.values():
        t.add_(1)


def memory():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def produce(payloads, acks):
    weights = model_weights("cuda")
    sizes, usage = [], {}
    for handoff in range(1, HANDOFFS + 1):
        advance(weights)
        for spec, flat in iter_buckets(weights.items(), MAX_BYTES):
            sizes.append((spec.nbytes, [t.nbytes for t in spec.tensors]))
            shared = share_bucket(spec, flat)
            payloads.put(shared)
            assert acks.get(timeout=TIMEOUT) == (handoff, spec.index)
            shared.release()
        del flat, shared
        payloads.put(("end", handoff))
        if handoff in (2, HANDOFFS):
            usage[handoff] = memory()
    payloads.put(None)
    return {"role": "producer", "sizes": sizes, "usage": usage}


def consume(payloads, acks):
    weights = model_weights("cuda")
    mismatches, usage, handoff, seen = [], {}, 1, set()
    advance(weights)
    while (shared := payloads.get(timeout=TIMEOUT)) is not None:
        if isinstance(shared, tuple):  # ("end", handoff): every bucket of this handoff arrived
            mismatches += [f"handoff {handoff}: {name} missing" for name in weights.keys() - seen]
            if handoff in (2, HANDOFFS):
                usage[handoff] = memory()
            handoff, seen = handoff + 1, set()
            advance(weights)
            continue
        spec, flat = open_bucket(shared)
        for name, view in unpack_bucket(spec, flat):
            copy = view.clone()  # what the engine does: copy out into its own layout
            seen.add(name)
            if not torch.equal(copy, weights[name]):
                mismatches.append(f"handoff {handoff}: {name}")
        del flat, view, copy
        acks.put((handoff, spec.index))
    return {"role": "consumer", "mismatches": mismatches, "usage": usage}


def test_cuda_ipc_handoffs_are_bit_exact_bounded_and_do_not_grow_memory():
    ctx = mp.get_context("spawn")
    payloads, acks, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = start(ctx, results, (produce, (payloads, acks)), (consume, (payloads, acks)))
    got = {r["role"]: r for r in collect(procs, results, TIMEOUT)}
    producer, consumer = got["producer"], got["consumer"]
    assert not consumer["mismatches"], consumer["mismatches"][:10]
    oversized = [s for s in producer["sizes"] if s[0] > MAX_BYTES and not (len(s[1]) == 1 and s[1][0] > MAX_BYTES)]
    assert not oversized, f"buckets over {MAX_BYTES} bytes that are not one large tensor: {oversized[:5]}"
    assert any(s[0] > MAX_BYTES for s in producer["sizes"]), "the large tensor should have had a bucket alone"
    for role, r in got.items():
        (alloc2, reserved2), (alloc20, reserved20) = r["usage"][2], r["usage"][HANDOFFS]
        assert alloc20 <= alloc2 and reserved20 <= reserved2, (
            f"{role}: device memory grew between handoff 2 and {HANDOFFS}: allocated {alloc2} -> {alloc20}, "
            f"reserved {reserved2} -> {reserved20} bytes")


# ---- NCCL across two GPUs ----------------------------------------------------------------------------

def mixed_buckets(device):
    """Three buckets: the first bf16 one, the first fp32 one, and the large tensor's."""
    buckets = list(iter_buckets(model_weights(device).items(), MAX_BYTES))
    first = {}
    for spec, flat in buckets:
        key = "large" if spec.nbytes > MAX_BYTES else spec.dtype
        first.setdefault(key, (spec, flat))
    return [first["bfloat16"], first["float32"], first["large"]]


def nccl_rank(rank, port, specs):
    torch.cuda.set_device(rank)
    group = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=rank, world_size=2,
                              backend="nccl", group_name="weights-gpu-test", timeout_s=TIMEOUT)
    try:
        buckets = mixed_buckets("cuda")
        if rank == 0:
            return {"role": "sender", "sent": send_buckets(group, buckets)}
        mismatches = []
        for d, (spec, expected) in zip(specs, buckets):
            flat = receive_bucket(group, BucketSpec.from_dict(d), torch.device("cuda", rank))
            if not torch.equal(flat, expected):
                mismatches.append(spec.index)
        return {"role": "receiver", "mismatches": mismatches}
    finally:
        group.destroy()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_group_broadcasts_buckets_bit_exact():
    buckets = mixed_buckets("cpu")
    assert len({spec.dtype for spec, _ in buckets}) == 2
    specs = [spec.to_dict() for spec, _ in buckets]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = start(ctx, results, (nccl_rank, (0, port, specs)), (nccl_rank, (1, port, specs)))
    got = {r["role"]: r for r in collect(procs, results, TIMEOUT)}
    assert got["sender"]["sent"] == sum(spec.nbytes for spec, _ in buckets)
    assert not got["receiver"]["mismatches"]
