"""Stream optimizer state through node-local disk.

fp32 master weights and Adam moments live in per-bucket files and pass through the device one bucket
at a time during `optimizer.step()`, so device residency of optimizer state is bounded by the buckets
in flight. Public API:

    store = stream_optimizer_state(optimizer, dir=..., chunk_mb=256, moment_dtype="fp32")
    optimizer.step()          # streams
    store.refresh_main_from_model_params(); store.save_to(base); store.load_from(base); store.stats; store.close()

The data path lives in `miles_plugins.optimizers.streaming`: plan -> layout -> stager -> bucket -> store
-> bindings (torch here, Megatron in bind_megatron).
"""

from __future__ import annotations

import torch

from .streaming.bind_torch import bind_plain_adam, bind_sharded_adam
from .streaming.checkpoint import CheckpointError
from .streaming.plan import DEFAULT_BUCKET_NUMEL, plan_buckets
from .streaming.stager import StoreConfigError
from .streaming.store import NVMeOptimizerStateStore, StepStats, StoreStats

__all__ = ["stream_optimizer_state", "NVMeOptimizerStateStore", "StoreConfigError", "CheckpointError", "StoreStats",
           "StepStats", "plan_buckets", "DEFAULT_BUCKET_NUMEL"]


def _is_megatron_optimizer(optimizer) -> bool:
    cls = type(optimizer)
    return cls.__module__.startswith("megatron.") and cls.__name__ in {"DistributedOptimizer", "ChainedOptimizer"}


def _default_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def stream_optimizer_state(optimizer, dir: str, chunk_mb: int = 256, moment_dtype: str = "fp32",
                           bucket_numel: int = DEFAULT_BUCKET_NUMEL, rank: int | None = None):
    """Bind `optimizer` in place so its step streams state through files under `dir`; returns the store.

    optimizer: torch.optim.Adam/AdamW over fp32 params (moments stream), miles' ShardedMixedPrecisionAdam
        (masters and moments stream), or a megatron-core DistributedOptimizer / ChainedOptimizer.
    dir: root directory on node-local disk; the store uses `<dir>/rank{r:05d}/opt{instance}_{uid}/`.
    chunk_mb: host staging chunk size. moment_dtype: storage format of the moments.
    bucket_numel: element budget per bucket (device residency per bucket in flight).
    """
    if chunk_mb <= 0:
        raise StoreConfigError(f"chunk_mb must be positive, got {chunk_mb}")
    kwargs = dict(dir=dir, chunk_mb=chunk_mb, moment_dtype=moment_dtype, bucket_numel=bucket_numel,
                  rank=_default_rank() if rank is None else rank)
    if _is_megatron_optimizer(optimizer):
        from .streaming.bind_megatron import bind_megatron
        return bind_megatron(optimizer, **kwargs)
    if hasattr(optimizer, "shards") and hasattr(optimizer, "inner"):
        return bind_sharded_adam(optimizer, **kwargs)
    if isinstance(optimizer, torch.optim.Optimizer):
        return bind_plain_adam(optimizer, **kwargs)
    raise StoreConfigError(f"cannot stream the state of {type(optimizer).__module__}.{type(optimizer).__name__}: "
                           "pass a torch Adam/AdamW, miles' ShardedMixedPrecisionAdam, or a megatron-core "
                           "DistributedOptimizer/ChainedOptimizer")
