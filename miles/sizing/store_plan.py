"""What a store would plan over a rank's optimizer entries: the store's own bucket planner, file layout and
moment codecs, so the sizes here are the sizes a built store reports (`store.stats`), not a second model."""

from __future__ import annotations

from dataclasses import dataclass

from miles_plugins.optimizers.streaming.codec import make_moment_codecs
from miles_plugins.optimizers.streaming.config import DEFAULT_BUCKET_NUMEL
from miles_plugins.optimizers.streaming.layout import EXP_AVG, EXP_AVG_SQ, MAIN, bucket_layout
from miles_plugins.optimizers.streaming.plan import place_in_host_ram, plan_buckets

FP32_BYTES = 4


@dataclass(frozen=True)
class StorePlan:
    num_buckets: int
    state_bytes: int  # the bucket files on disk (segments padded to 4 KiB): store.stats.state_bytes
    main_bytes: int  # payload of the main segments: what the first step reads (moments do not exist yet)
    moment_bytes: int  # payload of the moment segments
    max_bucket_numel: int
    buckets: tuple[tuple[int, int], ...] = ()  # per bucket: (file bytes, payload bytes a step reads and writes)

    @property
    def payload_bytes(self) -> int:
        """Bytes one full step reads, and writes (every segment of every bucket)."""
        return self.main_bytes + self.moment_bytes


def plan_store(entry_numels: list[int] | tuple[int, ...], moment_dtype: str = "fp32",
               bucket_numel: int = DEFAULT_BUCKET_NUMEL, streams_main: bool = True) -> StorePlan:
    """The store over these entries. streams_main=False: the params are the fp32 masters (a plain
    torch AdamW over fp32 params), so only the moments stream."""
    codecs = make_moment_codecs(moment_dtype)
    buckets = plan_buckets(list(entry_numels), bucket_numel)
    state = main = moments = 0
    sizes = []
    for bucket in buckets:
        n = bucket.numel
        segments = [(EXP_AVG, codecs[EXP_AVG].encoded_nbytes(n)), (EXP_AVG_SQ, codecs[EXP_AVG_SQ].encoded_nbytes(n))]
        if streams_main:
            segments.insert(0, (MAIN, FP32_BYTES * n))
            main += FP32_BYTES * n
        moments += segments[-1][1] + segments[-2][1]
        state += bucket_layout(segments).file_bytes
        sizes.append((bucket_layout(segments).file_bytes, sum(nbytes for _, nbytes in segments)))
    return StorePlan(len(buckets), state, main, moments, max((b.numel for b in buckets), default=0), tuple(sizes))


@dataclass(frozen=True)
class TierSplit:
    """Where a rank's streamed state lives under a host tier, as the stores place it (whole buckets)."""

    ram_state_bytes: int  # buckets in host RAM only: no file on disk
    disk_state_bytes: int  # the bucket files on disk
    ram_step_bytes: int  # of a step's payload (read, and written), what moves between the GPU and RAM


def split_by_host_tier(stores: tuple[StorePlan, ...], tier_bytes: int) -> TierSplit:
    """The stores' buckets, in order, under one tier of `tier_bytes`: each that still fits whole lives in
    RAM (plan.place_in_host_ram, the store's own rule), the rest in files."""
    buckets = [b for s in stores for b in s.buckets]
    in_ram = place_in_host_ram([f for f, _ in buckets], tier_bytes)
    ram = sum(f for (f, _), r in zip(buckets, in_ram) if r)
    return TierSplit(ram, sum(f for f, _ in buckets) - ram, sum(p for (_, p), r in zip(buckets, in_ram) if r))


def moment_bytes_per_param(moment_dtype: str, numel: int = 1 << 20) -> float:
    """Both moments' bytes per param in this format, as its codecs encode `numel` elements."""
    codecs = make_moment_codecs(moment_dtype)
    return (codecs[EXP_AVG].encoded_nbytes(numel) + codecs[EXP_AVG_SQ].encoded_nbytes(numel)) / numel
