"""The store's configuration: one frozen, typed object, and the one home of every store default.

    from miles_plugins.optimizers.nvme_stream import StreamConfig, stream_optimizer_state
    store = stream_optimizer_state(optimizer, config=StreamConfig(dir="/nvme/opt_state", moment_dtype="bf16"))

`stream_optimizer_state`'s keyword arguments are the same fields; the framework's flags
(`--stream-optimizer-state-*`) take their defaults from the constants here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

DEFAULT_CHUNK_MB = 256  # host staging chunk per transfer, MiB
DEFAULT_BUCKET_NUMEL = 200_000_000  # elements per bucket: device residency per bucket in flight
DEFAULT_DEPTH = 2  # buckets read ahead and written behind while one updates
DEFAULT_IO_THREADS = 2  # reader and writer threads, each
MOMENT_DTYPES = ("fp32", "bf16", "fp16", "fp8e4m3", "fp8e5m2")
IO_ENGINES = ("pipelined", "sync")


@dataclass(frozen=True)
class StreamConfig:
    """Everything a store is built from besides the optimizer.

    dir: root on node-local disk; the store works in `<dir>/rank{rank:05d}/<identity>/`.
    chunk_mb: host staging chunk size, MiB. moment_dtype: storage format of the Adam moments.
    bucket_numel: element budget per bucket. rank: None means torch.distributed's rank (0 without it).
    io_engine: "pipelined" (worker threads, CUDA streams, O_DIRECT) or "sync" (one bucket at a time;
        the in-run baseline). depth: buckets read ahead / written behind while one updates.
    io_threads: reader and writer threads, each. direct_io: None probes O_DIRECT, True requires it,
        False never. host_cache_mb: host RAM for images of hot buckets (0: none).
    write_behind: let the step return before its last write-backs land.
    """

    dir: str
    chunk_mb: int = DEFAULT_CHUNK_MB
    moment_dtype: str = "fp32"
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    rank: Optional[int] = None
    io_engine: str = "pipelined"
    depth: int = DEFAULT_DEPTH
    io_threads: int = DEFAULT_IO_THREADS
    direct_io: Optional[bool] = None
    host_cache_mb: Union[int, str] = 0
    write_behind: bool = True
