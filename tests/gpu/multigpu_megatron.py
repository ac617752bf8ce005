"""Megatron MoE with DP=2 / EP=2 on two GPUs: dense and expert stores per rank, bit-exact.

Run: `torchrun --nproc-per-node 2 tests/gpu/multigpu_megatron.py <store root>` (test_multigpu.py does).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from megatron.core import parallel_state  # noqa: E402

from megatron_models import build, members, params_equal, train_step  # noqa: E402
from miles_plugins.optimizers.nvme_stream import stream_optimizer_state  # noqa: E402


def main(root: str) -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    ref_model, ref_opt = build(moe=True, expert_parallel=2)
    model, opt = build(moe=True, expert_parallel=2)
    group = stream_optimizer_state(opt, dir=root, bucket_numel=30_000)
    stores = getattr(group, "stores", [group])
    kinds = [(m.distributed_optimizer_instance_id, m.data_parallel_group.size()) for m in members(opt)]
    print(f"rank {rank}: members (instance id, DP size) {kinds}; stores "
          f"{[(s.relative_dir, s.stats.num_buckets) for s in stores]}", flush=True)
    assert len(stores) == 2, "dense and expert members get one store each"
    torch.distributed.barrier()
    if rank == 0:
        tree = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
        print("store tree:\n  " + "\n  ".join(tree), flush=True)
    for step in range(5):
        loss_ref = train_step(ref_model, ref_opt, step, data_rank=rank)
        loss = train_step(model, opt, step, data_rank=rank)
        same = params_equal(ref_model, model)
        print(f"rank {rank} step {step}: loss {loss:.5f} (in-memory {loss_ref:.5f}), params bit-identical: {same}",
              flush=True)
        assert same and loss == loss_ref
    group.close()
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
