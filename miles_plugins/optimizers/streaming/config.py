"""The store's configuration: one frozen, typed object, and the one home of every store default.

    from miles_plugins.optimizers.nvme_stream import StreamConfig, stream_optimizer_state
    store = stream_optimizer_state(optimizer, config=StreamConfig(dir="/nvme/opt_state", moment_dtype="bf16"))

`stream_optimizer_state`'s keyword arguments are the same fields; the framework's flags
(`--stream-optimizer-state-*`) take their defaults from the constants here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import StoreConfigError

DEFAULT_CHUNK_MB = 256  # host staging chunk per transfer, MiB
DEFAULT_BUCKET_NUMEL = 200_000_000  # elements per bucket at most (the fit may cut smaller: plan.py)
DEFAULT_DEPTH = 2  # buckets read ahead and written behind while one updates, at most
# The default device budget (device_budget_mb=None) is what ONE bucket of DEFAULT_BUCKET_NUMEL elements
# holds on the device in flight: its fp32 buffers of the streamed segments plus a narrow codec's encoded
# bytes and chunk scratch (the store's cost model, bucket.py). That is the original contract, "device
# residency bounded by about one bucket": fp32 moments with streamed mains 2.4 GB (1.6 GB when only the
# moments stream), bf16 3.2 GB + 0.13 GB scratch. The store spends it on smaller buckets and depth 2.
DEFAULT_IO_THREADS = 2  # reader and writer threads, each
MOMENT_DTYPES = ("fp32", "bf16", "fp16", "fp8e4m3", "fp8e5m2")
# Not offered to users: the unscaled fp8 cast the narrow-moment study compares against (codec.py).
STUDY_MOMENT_DTYPES = ("_fp8e4m3_unscaled",)
IO_ENGINES = ("pipelined", "sync")


@dataclass(frozen=True)
class StreamConfig:
    """Everything a store is built from besides the optimizer.

    dir: root on node-local disk; the store works in `<dir>/rank{rank:05d}/<identity>/`.
    chunk_mb: host staging chunk size, MiB. moment_dtype: storage format of the Adam moments.
    device_budget_mb: MiB of optimizer state the store may hold on the device during a step (buckets in
        flight, encoded temporaries, codec scratch); None: one DEFAULT_BUCKET_NUMEL bucket's worth (above).
        The store picks bucket_numel and depth to fit it (plan.fit_to_device_budget).
    bucket_numel: element budget per bucket; None: the largest that fits the device budget with the
        deepest pipeline, at most DEFAULT_BUCKET_NUMEL. Given, it is used as is (an error if it cannot fit).
    rank: None means torch.distributed's rank (0 without it).
    io_engine: "pipelined" (worker threads, CUDA streams, O_DIRECT) or "sync" (one bucket at a time;
        the in-run baseline). depth: buckets read ahead / written behind while one updates; None: the
        deepest up to DEFAULT_DEPTH that fits the device budget; given, used as is (checked the same way).
    io_threads: reader and writer threads, each. direct_io: None probes O_DIRECT, True requires it,
        False never. host_cache_mb: host RAM for images of hot buckets (0: none).
    write_behind: let the step return before its last write-backs land.
    verify: checksum (crc32) every chunk of the bucket files as it is written and check it whenever it
        is read back from disk: a file changed outside the store raises StateCorruptionError and poisons
        the store instead of training on garbage. Off by default: it costs CPU time per step
        (docs/benchmarks.md); reads served from the host cache or still-resident buckets are not checked.
    """

    dir: str
    chunk_mb: int = DEFAULT_CHUNK_MB
    moment_dtype: str = "fp32"
    bucket_numel: Optional[int] = None
    rank: Optional[int] = None
    io_engine: str = "pipelined"
    depth: Optional[int] = None
    io_threads: int = DEFAULT_IO_THREADS
    direct_io: Optional[bool] = None
    host_cache_mb: int = 0
    write_behind: bool = True
    verify: bool = False
    device_budget_mb: Optional[int] = None


def check_moment_dtype(moment_dtype) -> None:
    if not isinstance(moment_dtype, str) or moment_dtype not in MOMENT_DTYPES + STUDY_MOMENT_DTYPES:
        raise StoreConfigError(f"moment_dtype {moment_dtype!r} is not supported; choose one of "
                               f"{', '.join(MOMENT_DTYPES)}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: StreamConfig) -> None:
    """Raise StoreConfigError naming the first bad field, its value and what to pass instead."""
    def bad(field: str, expected: str) -> StoreConfigError:
        return StoreConfigError(f"{field} must be {expected}, got {getattr(config, field)!r}")

    if not isinstance(config.dir, str) or not config.dir:
        raise bad("dir", "a directory on node-local disk (a non-empty path)")
    if not _whole(config.chunk_mb) or config.chunk_mb <= 0:
        raise bad("chunk_mb", f"positive: a host staging chunk in MiB (default {DEFAULT_CHUNK_MB})")
    check_moment_dtype(config.moment_dtype)
    if config.bucket_numel is not None and (not _whole(config.bucket_numel) or config.bucket_numel <= 0):
        raise bad("bucket_numel", f"None (fitted to the device budget, at most {DEFAULT_BUCKET_NUMEL}) or a "
                                  "positive element count")
    if config.rank is not None and (not _whole(config.rank) or config.rank < 0):
        raise bad("rank", "None (torch.distributed's rank) or an integer >= 0")
    if config.io_engine not in IO_ENGINES:
        raise bad("io_engine", f"one of {IO_ENGINES}")
    if config.depth is not None and (not _whole(config.depth) or config.depth < 0):
        raise bad("depth", f"None (fitted to the device budget, at most {DEFAULT_DEPTH}) or an integer >= 0 "
                           "(0 streams one bucket at a time)")
    if not _whole(config.io_threads) or config.io_threads < 1:
        raise bad("io_threads", f"an integer >= 1 (default {DEFAULT_IO_THREADS})")
    if config.direct_io not in (None, True, False):
        raise bad("direct_io", "None (probe O_DIRECT), True or False")
    if not _whole(config.host_cache_mb) or config.host_cache_mb < 0:
        raise bad("host_cache_mb", "an integer >= 0: the host cache budget in MiB (0: no host cache)")
    if not isinstance(config.write_behind, bool):
        raise bad("write_behind", "True or False")
    if not isinstance(config.verify, bool):
        raise bad("verify", "True (checksum the bucket files) or False")
    if config.device_budget_mb is not None and (not _whole(config.device_budget_mb) or config.device_budget_mb <= 0):
        raise bad("device_budget_mb", "None (one default bucket's worth) or a positive budget in MiB")
