"""Stream optimizer state through node-local disk.

fp32 master weights and Adam moments live in per-bucket files and pass through the device one bucket
at a time during `optimizer.step()`, so device residency of optimizer state is bounded by the buckets
in flight, which the store sizes to fit a device budget (`device_budget_mb`; default one bucket of
DEFAULT_BUCKET_NUMEL elements). Public API:

    store = stream_optimizer_state(optimizer, dir=..., chunk_mb=256, moment_dtype="fp32")
    store = stream_optimizer_state(optimizer, StreamConfig(dir=..., moment_dtype="bf16"))  # the same, as one object
    optimizer.step()          # streams
    store.refresh_main_from_model_params(); store.save_to(base); store.load_from(base); store.stats; store.close()
    store.prefetch()          # read-ahead before forward/backward
    store.flush()             # the files hold the state (write-behind and the host tier's dirty images landed)
    store.release_device()    # before sleeping: the device buffers are free; the disk may still be busy
    StoreGroup.of(store).stores   # a ChainedOptimizer's stores (stream_optimizer_state returns their group)
    StreamEntry(main=..., group=0, model_view=...)   # a store over raw fp32 shards: NVMeOptimizerStateStore(entries, adam, config)

The code lives in `miles_plugins.optimizers.streaming` (docs/dev/architecture.md draws it): core at the
top (plan -> layout -> codec -> bucket -> store, config, errors), io/ (the stager, the one door to files
and host memory), checkpoint/ (save/load, reshard) and bind/ (torch and Megatron bindings).
"""

from __future__ import annotations

import dataclasses

import torch

from miles_plugins.host.ownership import DirectoryInUseError

from .streaming.bind.megatron_optimizer import StoreGroup, bind_megatron
from .streaming.bind.torch_adam import bind_plain_adam, bind_sharded_adam
from .streaming.bucket import StreamEntry
from .streaming.config import DEFAULT_BUCKET_NUMEL, DEFAULT_CHUNK_MB, MOMENT_DTYPES, StreamConfig
from .streaming.errors import CheckpointError, StateCorruptionError, StoreConfigError, StorePoisonedError
from .streaming.layout import STREAMED_DIR
from .streaming.plan import fit_to_device_budget, plan_buckets
from .streaming.stats import StepStats, StoreStats
from .streaming.store import NVMeOptimizerStateStore

__all__ = ["stream_optimizer_state", "NVMeOptimizerStateStore", "StreamConfig", "StoreConfigError", "CheckpointError",
           "DirectoryInUseError", "StorePoisonedError", "StateCorruptionError",
           "StoreStats", "StepStats", "StoreGroup", "StreamEntry", "plan_buckets", "fit_to_device_budget", "DEFAULT_BUCKET_NUMEL", "DEFAULT_CHUNK_MB", "MOMENT_DTYPES",
           "STREAMED_DIR"]
_FIELDS = tuple(f.name for f in dataclasses.fields(StreamConfig))


def _is_megatron_optimizer(optimizer) -> bool:
    cls = type(optimizer)
    return cls.__module__.startswith("megatron.") and cls.__name__ in {"DistributedOptimizer", "ChainedOptimizer"}


def _default_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def _resolve_config(config: StreamConfig | None, fields: dict) -> StreamConfig:
    """One StreamConfig from either a config or its fields as keywords (not both: which would win is a
    guess), its rank resolved. A StreamConfig validates itself when it is built (config.check_config)."""
    unknown = sorted(set(fields) - set(_FIELDS))
    if unknown:
        raise TypeError(f"stream_optimizer_state() got unexpected keyword arguments {unknown}; "
                        f"the store's settings are {', '.join(_FIELDS)}")
    if config is not None and fields:
        raise TypeError(f"pass either config=StreamConfig(...) or its fields as keywords, not both (got both "
                        f"a config and {sorted(fields)}); use dataclasses.replace(config, ...) to change a config")
    if config is None:
        if "dir" not in fields:
            raise TypeError("stream_optimizer_state() needs dir= (a directory on node-local disk) or config=")
        config = StreamConfig(**fields)
    if not isinstance(config, StreamConfig):
        raise TypeError(f"config must be a StreamConfig, got {type(config).__name__}")
    return config if config.rank is not None else dataclasses.replace(config, rank=_default_rank())


def stream_optimizer_state(optimizer, config: StreamConfig | None = None, *, instance: int | None = None,
                           **fields):
    """Bind `optimizer` in place so its step streams state through files under `config.dir`; returns the store.

    optimizer: torch.optim.Adam/AdamW over fp32 params (moments stream), miles' ShardedMixedPrecisionAdam
        (masters and moments stream), or a megatron-core DistributedOptimizer / ChainedOptimizer.
    config: a StreamConfig; or pass its fields as keywords instead (not both): dir, chunk_mb, moment_dtype,
        bucket_numel, rank, io_engine, depth, io_threads, direct_io, host_cache_mb (MiB or "auto"),
        host_cache_ranks_per_node, host_cache_reserve_mb, host_cache_rank_reserve_mb, write_behind, verify,
        device_budget_mb (the store fits bucket_numel and depth under it unless they are given). What each
        means, and its default, is in streaming/config.py. Bad values raise StoreConfigError naming the field.
    instance: the store's identity within this process (its directory `<dir>/rank{r:05d}/opt{instance}_{part}`
        and its checkpoints'): 0 by default, Megatron's distributed_optimizer_instance_id for Megatron
        optimizers; `part` is the member's index in a ChainedOptimizer. Two open stores of one process
        may not share an identity: give the second optimizer another instance.
    Call `store.prefetch()` before forward/backward to read the next step's first buckets meanwhile.
    """
    config = _resolve_config(config, fields)
    if _is_megatron_optimizer(optimizer):
        return bind_megatron(optimizer, config, instance=instance)
    if hasattr(optimizer, "shards") and hasattr(optimizer, "inner"):
        return bind_sharded_adam(optimizer, config, instance=instance or 0)
    if isinstance(optimizer, torch.optim.Optimizer):
        return bind_plain_adam(optimizer, config, instance=instance or 0)
    raise StoreConfigError(f"cannot stream the state of {type(optimizer).__module__}.{type(optimizer).__name__}: "
                           "pass a torch Adam/AdamW, miles' ShardedMixedPrecisionAdam, or a megatron-core "
                           "DistributedOptimizer/ChainedOptimizer")
