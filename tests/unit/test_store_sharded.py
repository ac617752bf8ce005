"""The store bound to the torch backend's ZeRO-1 ShardedMixedPrecisionAdam: bit-exact at DP=1 and DP=2."""

import os
import socket
import subprocess
import sys

import torch

from miles.backends.torch_backend.sharded_optimizer import ShardedMixedPrecisionAdam
from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

SIZES = ((37, 29), (1000,), (3,), (4099,), (257, 31))
STEPS = 6


def make_model_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SIZES]


def make_opt(params):
    return ShardedMixedPrecisionAdam([
        {"params": params[:2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0},
    ], betas=(0.9, 0.95))


def masters_and_moments(opt):
    """Per shard: master, exp_avg, exp_avg_sq, as plain tensors (read back from disk when streamed)."""
    store = getattr(opt, "_nvme_state_store", None)
    if store is None:
        return [(s.master.clone(), opt.inner.state[s.master]["exp_avg"].clone(),
                 opt.inner.state[s.master]["exp_avg_sq"].clone()) for s in opt.shards]
    parts = {}
    for bucket in store.buckets:
        bucket.fetch(store.stager, bucket.segments_to_fetch())
        for i, piece in enumerate(bucket.pieces):
            parts.setdefault(piece.entry, []).append(
                (piece.start, bucket.params[i].clone(), *(bucket.moment_views[i][k].clone()
                                                          for k in ("exp_avg", "exp_avg_sq"))))
        bucket.release()
    out = []
    for e in range(len(opt.shards)):
        chunks = sorted(parts[e], key=lambda c: c[0])
        out.append(tuple(torch.cat([c[j] for c in chunks]) for j in (1, 2, 3)))
    return out


def run(rank, world, root, bucket_numel):
    ref_params, params = make_model_params(), make_model_params()
    ref, opt = make_opt(ref_params), make_opt(params)
    store = stream_optimizer_state(opt, dir=root, bucket_numel=bucket_numel)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]
        for ps in (ref_params, params):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        ref.step()
        opt.step()
        if step == 2:
            for o in (ref, opt):
                o.param_groups[1]["lr"] = 1e-3
        assert all(torch.equal(a, b) for a, b in zip(ref_params, params)), f"rank {rank} step {step}: params"
    for (m0, a0, s0), (m1, a1, s1) in zip(masters_and_moments(ref), masters_and_moments(opt)):
        assert torch.equal(m0, m1) and torch.equal(a0, a1) and torch.equal(s0, s1), f"rank {rank}: state"
    mains = 4 * sum(s.stop - s.start for s in opt.shards)
    assert store.stats.last_step.bytes_read == 3 * mains and store.stats.last_step.bytes_written == 3 * mains
    assert store.stats.peak_resident_bytes <= store.stats.residency_bound_bytes
    store.close()
    return store.stats.num_buckets


def test_dp1_bit_exact_with_many_buckets_and_split_params(tmp_path):
    buckets = run(0, 1, str(tmp_path), bucket_numel=4096 + 50)
    assert buckets >= 3


def test_first_step_reads_mains_only(tmp_path):
    params = make_model_params()
    opt = make_opt(params)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=1000)
    mains = 4 * sum(s.stop - s.start for s in opt.shards)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert store.stats.last_step.bytes_read == mains
    assert store.stats.last_step.bytes_written == 3 * mains
    assert all(s.master.untyped_storage().nbytes() == 0 for s in opt.shards), "mains evicted"
    store.close()


def _worker(rank, port, root):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        run(rank, 2, root, bucket_numel=2000)
    finally:
        dist.destroy_process_group()


def test_dp2_gloo_bit_exact(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    assert os.listdir(tmp_path) == []


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
