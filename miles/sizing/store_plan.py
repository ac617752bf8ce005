"""What a store would build over a rank's optimizer entries: the store's own footprint (bucket size and depth
fitted to the device budget, buckets, file layout, moment codecs, device residency), so the sizes here are the
sizes a built store reports (`store.stats`), not a second model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from miles_plugins.optimizers.streaming.codec import make_moment_codecs
from miles_plugins.optimizers.streaming.footprint import StoreFootprint, store_footprint
from miles_plugins.optimizers.streaming.layout import EXP_AVG, EXP_AVG_SQ
from miles_plugins.optimizers.streaming.plan import place_in_host_ram


def plan_store(entry_numels: Sequence[int], moment_dtype: str = "fp32", bucket_numel: Optional[int] = None,
               device_budget_bytes: Optional[int] = None, streams_main: bool = True) -> StoreFootprint:
    """The store over these entries. bucket_numel, device_budget_bytes: as the run passes them to the store
    (None: the store fits the bucket size to its default budget, one default bucket in flight).
    streams_main=False: the params are the fp32 masters (a plain torch AdamW over fp32 params), so only the
    moments stream. StoreConfigError when the store would refuse the bucket size under the budget."""
    return store_footprint(entry_numels, moment_dtype, streams_main=streams_main, bucket_numel=bucket_numel,
                           device_budget_bytes=device_budget_bytes)


@dataclass(frozen=True)
class TierSplit:
    """Where a rank's streamed state lives under a host tier, as the stores place it (whole buckets)."""

    ram_state_bytes: int  # buckets in host RAM only: no file on disk
    disk_state_bytes: int  # the bucket files on disk
    ram_step_bytes: int  # of a step's payload (read, and written), what moves between the GPU and RAM


def split_by_host_tier(stores: tuple[StoreFootprint, ...], tier_bytes: int) -> TierSplit:
    """The stores' buckets, in order, under one tier of `tier_bytes`: each that still fits whole lives in
    RAM (plan.place_in_host_ram, the store's own rule), the rest in files."""
    buckets = [b for s in stores for b in zip(s.bucket_file_bytes, s.bucket_payload_bytes)]
    in_ram = place_in_host_ram([f for f, _ in buckets], tier_bytes)
    ram = sum(f for (f, _), r in zip(buckets, in_ram) if r)
    return TierSplit(ram, sum(f for f, _ in buckets) - ram, sum(p for (_, p), r in zip(buckets, in_ram) if r))


def moment_bytes_per_param(moment_dtype: str, numel: int = 1 << 20) -> float:
    """Both moments' bytes per param in this format, as its codecs encode `numel` elements."""
    codecs = make_moment_codecs(moment_dtype)
    return (codecs[EXP_AVG].encoded_nbytes(numel) + codecs[EXP_AVG_SQ].encoded_nbytes(numel)) / numel
