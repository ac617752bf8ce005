"""The store's configuration: one frozen, typed object, and the one home of every store default.

    from miles_plugins.optimizers.nvme_stream import StreamConfig, stream_optimizer_state
    store = stream_optimizer_state(optimizer, config=StreamConfig(dir="/nvme/opt_state", moment_dtype="bf16"))

`stream_optimizer_state`'s keyword arguments are the same fields; the framework's flags
(`--stream-optimizer-state-*`) take their defaults from the constants here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

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
IO_ENGINES = ("pipelined", "sync")
# host_cache_mb="auto": the host tier takes what the node has free, shared by its ranks (plan.fit_host_cache)
HOST_CACHE_AUTO = "auto"
# What "auto" leaves free on the node, MiB: the OS and its page cache, Ray (raylet, the object store's
# used part), the rollout engine's host memory, checkpoint copies' buffers, and each rank's own growth
# after the store is built. 16 GiB leaves ~100 GiB of the 125 GiB H200 test host to the tier.
DEFAULT_HOST_CACHE_RESERVE_MB = 16 * 1024


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
        False never.
    host_cache_mb: the host tier, MiB of host RAM for buckets (0: none): their reads and writes move
        between the device and RAM only. "auto": fit to the node's free memory when the store is built
        (below; plan.fit_host_cache; logged, and in stats), floored at 0.
    host_cache_ranks_per_node: ranks of this node that take an "auto" tier each (default 1).
    host_cache_reserve_mb: node memory "auto" leaves free (DEFAULT_HOST_CACHE_RESERVE_MB, above).
    host_cache_rank_reserve_mb: memory each rank keeps for itself beside its tier under "auto" (e.g. a
        trainer's cpu backup of its weights while asleep with --offload-train-target=cpu; default 0).
    host_cache_run_reserve_mb: node memory the rest of the run will hold that MemAvailable may not show yet
        when the store is built, left free by "auto" on top of host_cache_reserve_mb (the rollout engine's
        host copies of its weights while it sleeps, Ray's object store as it fills; default 0: the
        framework passes what it knows). "auto" is then
        min(state, (MemAvailable - host_cache_reserve_mb - host_cache_run_reserve_mb) / ranks - rank reserve).
    A tier holds whole buckets: those it can hold live in host RAM only, with no file on disk (the disk is
    asked only for the rest's files); the buckets are placed when the store is built, with the pipelined
    engine. set_io(host_cache_mb=...) later changes only the write-back images over the rest.
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
    host_cache_mb: Union[int, str] = 0
    host_cache_ranks_per_node: int = 1
    host_cache_reserve_mb: int = DEFAULT_HOST_CACHE_RESERVE_MB
    host_cache_rank_reserve_mb: int = 0
    host_cache_run_reserve_mb: int = 0
    write_behind: bool = True
    verify: bool = False
    device_budget_mb: Optional[int] = None

    def __post_init__(self) -> None:
        check_config(self)  # valid by construction: whoever holds a StreamConfig need not check it again


def check_moment_dtype(moment_dtype) -> None:
    if not isinstance(moment_dtype, str) or moment_dtype not in MOMENT_DTYPES:
        expected = f"one of {', '.join(MOMENT_DTYPES)}"
        raise StoreConfigError(f"moment_dtype {moment_dtype!r} is not supported; choose {expected}",
                               "moment_dtype", expected)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: StreamConfig) -> None:
    """The store's rules for its settings, in one place (StreamConfig runs them when it is built, and
    dataclasses.replace runs them again on the new object): StoreConfigError naming the first bad field, its
    value and what to pass instead."""
    def bad(field: str, expected: str) -> StoreConfigError:
        return StoreConfigError(f"{field} must be {expected}, got {getattr(config, field)!r}", field, expected)

    if not isinstance(config.dir, str) or not config.dir:
        raise bad("dir", "a directory on node-local disk (a non-empty path)")
    if not _whole(config.chunk_mb) or config.chunk_mb <= 0:
        raise bad("chunk_mb", f"a positive host staging chunk in MiB (default {DEFAULT_CHUNK_MB})")
    check_moment_dtype(config.moment_dtype)
    if config.bucket_numel is not None and (not _whole(config.bucket_numel) or config.bucket_numel <= 0):
        raise bad("bucket_numel", "a positive element count (left unset: fitted to the device budget, at most "
                                  f"{DEFAULT_BUCKET_NUMEL})")
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
    if config.host_cache_mb != HOST_CACHE_AUTO and (not _whole(config.host_cache_mb) or config.host_cache_mb < 0):
        raise bad("host_cache_mb", f"an integer >= 0, the host tier in MiB (0: none), or {HOST_CACHE_AUTO!r} (fit to "
                                   "the node's free memory)")
    if not _whole(config.host_cache_ranks_per_node) or config.host_cache_ranks_per_node < 1:
        raise bad("host_cache_ranks_per_node", "an integer >= 1: the ranks of this node that share its memory")
    if not _whole(config.host_cache_reserve_mb) or config.host_cache_reserve_mb < 0:
        raise bad("host_cache_reserve_mb", f"an integer >= 0: MiB of node memory host_cache_mb='auto' leaves free "
                                           f"(default {DEFAULT_HOST_CACHE_RESERVE_MB})")
    if not _whole(config.host_cache_rank_reserve_mb) or config.host_cache_rank_reserve_mb < 0:
        raise bad("host_cache_rank_reserve_mb", "an integer >= 0: MiB each rank keeps beside its 'auto' tier")
    if not _whole(config.host_cache_run_reserve_mb) or config.host_cache_run_reserve_mb < 0:
        raise bad("host_cache_run_reserve_mb", "an integer >= 0: MiB of node memory the rest of the run will hold, "
                                               "left free by host_cache_mb='auto'")
    if not isinstance(config.write_behind, bool):
        raise bad("write_behind", "True or False")
    if not isinstance(config.verify, bool):
        raise bad("verify", "True (checksum the bucket files) or False")
    if config.device_budget_mb is not None and (not _whole(config.device_budget_mb) or config.device_budget_mb <= 0):
        raise bad("device_budget_mb", "a positive budget in MiB (left unset: one default bucket's worth)")
