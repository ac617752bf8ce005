"""Stream optimizer state through node-local disk.

fp32 master weights and Adam moments live in per-bucket files and pass through the device one bucket
at a time during `optimizer.step()`, so device residency of optimizer state is bounded by the buckets
in flight. Public API:

    store = stream_optimizer_state(optimizer, dir=..., chunk_mb=256, moment_dtype="fp32")
    optimizer.step()          # streams
    store.refresh_main_from_model_params(); store.save_to(base); store.load_from(base); store.stats; store.close()
    store.prefetch()          # read-ahead before forward/backward; store.flush(): wait for write-behind

The data path lives in `miles_plugins.optimizers.streaming`: plan -> layout -> stager -> bucket -> store
-> bindings (torch here, Megatron in bind_megatron).
"""

from __future__ import annotations

import torch

from .streaming.bind.torch_adam import bind_plain_adam, bind_sharded_adam
from .streaming.errors import CheckpointError, StoreConfigError
from .streaming.plan import DEFAULT_BUCKET_NUMEL, plan_buckets
from .streaming.store import NVMeOptimizerStateStore, StepStats, StoreStats

__all__ = ["stream_optimizer_state", "NVMeOptimizerStateStore", "StoreConfigError", "CheckpointError", "StoreStats",
           "StepStats", "plan_buckets", "DEFAULT_BUCKET_NUMEL"]


def _is_megatron_optimizer(optimizer) -> bool:
    cls = type(optimizer)
    return cls.__module__.startswith("megatron.") and cls.__name__ in {"DistributedOptimizer", "ChainedOptimizer"}


def _default_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def stream_optimizer_state(optimizer, dir: str, chunk_mb: int = 256, moment_dtype: str = "fp32",
                           bucket_numel: int = DEFAULT_BUCKET_NUMEL, rank: int | None = None,
                           io_engine: str = "pipelined", depth: int = 2, io_threads: int = 2,
                           direct_io: bool | None = None, host_cache_mb: int = 0, write_behind: bool = True):
    """Bind `optimizer` in place so its step streams state through files under `dir`; returns the store.

    optimizer: torch.optim.Adam/AdamW over fp32 params (moments stream), miles' ShardedMixedPrecisionAdam
        (masters and moments stream), or a megatron-core DistributedOptimizer / ChainedOptimizer.
    dir: root directory on node-local disk; the store uses `<dir>/rank{r:05d}/opt{instance}_{uid}/`.
    chunk_mb: host staging chunk size. moment_dtype: storage format of the moments.
    bucket_numel: element budget per bucket (device residency per bucket in flight).
    io_engine: "pipelined" (default: worker threads, CUDA streams, O_DIRECT) or "sync" (the seed's
        synchronous path, one bucket at a time; the in-run baseline).
    depth: buckets read ahead and written behind while one updates. Device residency of state is at
        most (2 * depth + 1) buckets (store.stats.residency_bound_bytes); sync is depth 0.
    io_threads: reader and writer threads (each). direct_io: None probes O_DIRECT (logged fallback),
        True asks for it, False never. host_cache_mb: host RAM for images of hot buckets (read from RAM,
        their disk writes run behind the next forward/backward). write_behind: let the step return before the last write-backs
        land (the next read of that bucket, a save/load, flush() and close() wait for them).
    Call `store.prefetch()` before forward/backward to read the next step's first buckets meanwhile.
    """
    if chunk_mb <= 0:
        raise StoreConfigError(f"chunk_mb must be positive, got {chunk_mb}")
    kwargs = dict(dir=dir, chunk_mb=chunk_mb, moment_dtype=moment_dtype, bucket_numel=bucket_numel,
                  rank=_default_rank() if rank is None else rank, io_engine=io_engine, depth=depth,
                  io_threads=io_threads, direct_io=direct_io, host_cache_mb=host_cache_mb,
                  write_behind=write_behind)
    if _is_megatron_optimizer(optimizer):
        from .streaming.bind.megatron_optimizer import bind_megatron
        return bind_megatron(optimizer, **kwargs)
    if hasattr(optimizer, "shards") and hasattr(optimizer, "inner"):
        return bind_sharded_adam(optimizer, **kwargs)
    if isinstance(optimizer, torch.optim.Optimizer):
        return bind_plain_adam(optimizer, **kwargs)
    raise StoreConfigError(f"cannot stream the state of {type(optimizer).__module__}.{type(optimizer).__name__}: "
                           "pass a torch Adam/AdamW, miles' ShardedMixedPrecisionAdam, or a megatron-core "
                           "DistributedOptimizer/ChainedOptimizer")
