"""What a store reports: its running totals (StoreStats, ``store.stats``) and one step's (StepStats,
``store.stats.last_step`` and the return value of ``store.step()``). Plain data, filled in by the store."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    bytes_read: int = 0  # state bytes the step consumed: from disk, the host cache, or still resident
    bytes_written: int = 0  # state bytes the step wrote back (some may land after it returned)
    buckets: int = 0
    io_seconds: float = 0.0  # wall - compute: time the step waited for I/O (exposed I/O)
    io_task_seconds: float = 0.0  # time the engine's tasks spent moving bytes during the step, summed over
    #   its threads (total I/O; the part not in io_seconds overlapped compute)
    compute_seconds: float = 0.0  # update + publish (device-synchronized)
    wall_seconds: float = 0.0
    disk_bytes_read: int = 0  # of bytes_read, read from the files (including read-ahead before the step)
    cache_bytes_read: int = 0  # of bytes_read, served from the host cache
    disk_bytes_written: int = 0  # bytes sent to the files since the previous step (buckets without a host
    #   image, and write-backs of dirty images by flush/save in between; 0 on steady steps when the host tier
    #   holds every bucket; counted from the end of a load_from, whose own write-back is not a step's)
    reused_bytes: int = 0  # of bytes_read, still resident from the previous step's write-back
    prefetched_buckets: int = 0  # buckets whose reads started before the step (prefetch)
    pending_writes: int = 0  # buckets whose write-back was still in flight when the step returned
    peak_resident_bytes: int = 0  # this step's peak
    tier_fill_bytes: int = 0  # disk bytes read ahead into the host tier since the previous step
    #   (fill_host_tier); the step then reads them from the tier, as part of cache_bytes_read


@dataclass
class StoreStats:
    num_buckets: int = 0
    state_bytes: int = 0  # bytes of all streamed segments on disk
    steps: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    peak_resident_bytes: int = 0  # most state bytes on the device at once: buckets in flight + codec scratch
    resident_bytes: int = 0  # now (between steps: prefetched and write-behind buckets)
    max_bucket_bytes: int = 0  # fp32 bytes of the largest bucket
    last_step: StepStats = field(default_factory=StepStats)
    io_engine: str = "pipelined"
    depth: int = 0  # buckets read ahead / written behind while one updates
    bucket_numel: int = 0  # element budget per bucket in effect (fitted to the device budget unless given)
    bucket_inflight_bytes: int = 0  # most bytes one bucket in flight materializes (fp32 + codec temporaries)
    codec_scratch_bytes: int = 0  # a narrow codec's chunk temporaries while it encodes or decodes (0 for fp32)
    # min(2 * depth + 1, num_buckets) * bucket_inflight_bytes + codec_scratch_bytes: peak_resident_bytes never
    # exceeds it, and it never exceeds device_budget_bytes
    residency_bound_bytes: int = 0
    device_budget_bytes: int = 0  # StreamConfig.device_budget_mb in bytes (or the default: one default bucket)
    staging_bytes: int = 0  # host staging the engine may allocate (pinned on CUDA)
    host_cache_bytes: int = 0  # host-RAM budget for images of buckets (the host tier; host_cache_mb="auto": the
    #   size chosen when the store was built, or by set_io)
    ram_state_bytes: int = 0  # of state_bytes, the buckets that live in host RAM only (no file on disk; placed
    #   when the store was built); state_bytes - ram_state_bytes is what the files on disk hold
