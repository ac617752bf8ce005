"""What a store over given entries costs, before any file exists: its bucket size and pipeline depth, its
buckets' file and payload bytes, and the device bytes a step holds at most.

Pure. The store builds itself from these functions (store.py) and `miles plan` sizes a run with
`store_footprint` (miles/sizing), so a plan's bucket counts, state bytes and device bytes are the ones the
built store reports in `store.stats`.

The device budget (None: ONE bucket of DEFAULT_BUCKET_NUMEL elements in flight, config.py) fixes the
bucket size and depth (plan.fit_to_device_budget, over the store's cost model bucket.step_device_bytes);
the buckets are then cut at that size (plan.plan_buckets) and each laid out as one file of its codecs'
encoded segments (layout.bucket_layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .bucket import codec_scratch_bytes, inflight_bytes, step_device_bytes
from .codec import Fp32Codec, make_moment_codecs
from .config import DEFAULT_BUCKET_NUMEL, DEFAULT_DEPTH
from .layout import EXP_AVG, EXP_AVG_SQ, MAIN, BucketLayout, bucket_layout
from .plan import (SPLIT_ALIGN_NUMEL, BucketPlan, DeviceFit, buckets_in_flight, fit_to_device_budget,
                   largest_fitting_bucket, plan_buckets)


@dataclass(frozen=True)
class StoreFootprint:
    bucket_numel: int  # element budget per bucket in effect (fitted to the device budget unless given)
    depth: int  # buckets read ahead / written behind while one updates
    num_buckets: int
    max_bucket_numel: int  # elements of the largest bucket
    bucket_file_bytes: tuple[int, ...]  # per bucket: its file (segments padded to 4 KiB)
    bucket_payload_bytes: tuple[int, ...]  # per bucket: the bytes a full step reads, and writes
    state_bytes: int  # all bucket files: store.stats.state_bytes
    main_bytes: int  # payload of the main segments: what the first step reads (moments do not exist yet)
    moment_bytes: int  # payload of the moment segments
    bucket_inflight_bytes: int  # device bytes one bucket in flight holds at most (fp32 + encoded temporaries)
    codec_scratch_bytes: int  # a narrow codec's chunk temporaries on top (0 for fp32)
    device_budget_bytes: int
    residency_bound_bytes: int  # device bytes a step holds at most; never above device_budget_bytes
    below_minimum: bool  # the budget forced buckets below plan.MIN_BUCKET_NUMEL (the store warns)

    @property
    def payload_bytes(self) -> int:
        """Bytes one full step reads, and writes (every segment of every bucket)."""
        return self.main_bytes + self.moment_bytes


def store_codecs(moment_dtype: str) -> dict:
    """One codec per segment: fp32 mains, the moments as `moment_dtype` stores them (exp_avg_sq may be
    stored differently from exp_avg: codec.py says why)."""
    return {MAIN: Fp32Codec(), **make_moment_codecs(moment_dtype)}


def segment_names(streams_main: bool) -> tuple[str, ...]:
    """The segments of a bucket file, in file order; no main when the params are the fp32 masters."""
    return (MAIN, EXP_AVG, EXP_AVG_SQ) if streams_main else (EXP_AVG, EXP_AVG_SQ)


def default_device_budget_bytes(codecs: dict, names: Sequence[str]) -> int:
    """The budget when none is given: what one bucket of DEFAULT_BUCKET_NUMEL elements holds in flight."""
    return step_device_bytes(codecs, names, DEFAULT_BUCKET_NUMEL, 1)


def fit_store(entry_numels: Sequence[int], codecs: dict, names: Sequence[str], device_budget_bytes: int, *,
              bucket_numel: Optional[int] = None, depth: Optional[int] = None, sync: bool = False) -> DeviceFit:
    """Bucket size and depth within the device budget (plan.fit_to_device_budget over the store's cost
    model); the sync engine is depth 0 whatever is asked."""
    def device_bytes(largest_numel: int, in_flight: int) -> int:
        return step_device_bytes(codecs, names, largest_numel, in_flight)

    return fit_to_device_budget(list(entry_numels), device_budget_bytes, device_bytes,
                                max_depth=0 if sync else DEFAULT_DEPTH, bucket_numel=bucket_numel,
                                depth=0 if sync else depth)


def bucket_layouts(codecs: dict, names: Sequence[str], plans: Sequence[BucketPlan]) -> list[BucketLayout]:
    """Each bucket's file: its segments' encoded bytes, in `names` order."""
    return [bucket_layout([(n, codecs[n].encoded_nbytes(p.numel)) for n in names]) for p in plans]


def residency_bound_bytes(num_buckets: int, depth: int, bucket_inflight_bytes: int, codec_scratch: int) -> int:
    """Device bytes a step at `depth` holds at most: the buckets in flight (plan.buckets_in_flight), each at
    most `bucket_inflight_bytes`, plus one codec's scratch."""
    return buckets_in_flight(num_buckets, depth) * bucket_inflight_bytes + codec_scratch


def store_footprint(entry_numels: Sequence[int], moment_dtype: str, *, streams_main: bool = True,
                    bucket_numel: Optional[int] = None, depth: Optional[int] = None,
                    device_budget_bytes: Optional[int] = None, sync: bool = False) -> StoreFootprint:
    """The store over entries of these sizes, as it builds itself (StreamConfig's fields: bucket_numel, depth
    and the device budget in bytes; None leaves each to the store, sync: io_engine="sync").
    streams_main=False: the params are the fp32 masters, so only the moments stream.
    StoreConfigError, as the store raises it, when the budget cannot hold what is asked."""
    codecs, names = store_codecs(moment_dtype), segment_names(streams_main)
    budget = default_device_budget_bytes(codecs, names) if device_budget_bytes is None else device_budget_bytes
    fit = fit_store(entry_numels, codecs, names, budget, bucket_numel=bucket_numel, depth=depth, sync=sync)
    plans = plan_buckets(list(entry_numels), fit.bucket_numel)
    layouts = bucket_layouts(codecs, names, plans)
    payloads = tuple(sum(s.nbytes for s in layout.segments.values()) for layout in layouts)
    main = sum(layout.segments[MAIN].nbytes for layout in layouts) if streams_main else 0
    largest = max((p.numel for p in plans), default=0)
    inflight, scratch = inflight_bytes(codecs, names, largest), codec_scratch_bytes(codecs, names, largest)
    return StoreFootprint(
        bucket_numel=fit.bucket_numel, depth=fit.depth, num_buckets=len(plans), max_bucket_numel=largest,
        bucket_file_bytes=tuple(layout.file_bytes for layout in layouts), bucket_payload_bytes=payloads,
        state_bytes=sum(layout.file_bytes for layout in layouts), main_bytes=main, moment_bytes=sum(payloads) - main,
        bucket_inflight_bytes=inflight, codec_scratch_bytes=scratch, device_budget_bytes=budget,
        residency_bound_bytes=residency_bound_bytes(len(plans), fit.depth, inflight, scratch),
        below_minimum=fit.below_minimum)


def smallest_bucket_numel(moment_dtype: str, *, streams_main: bool = True,
                          device_budget_bytes: Optional[int] = None) -> int:
    """A floor under the bucket size the store fits to this device budget (bucket_numel and depth left to the
    store), whatever the state: the largest multiple of SPLIT_ALIGN_NUMEL, up to DEFAULT_BUCKET_NUMEL, of
    which the deepest step's buckets in flight fit, and at least SPLIT_ALIGN_NUMEL. The fit cuts a state of
    many buckets at exactly this size when it is at least plan.MIN_BUCKET_NUMEL; a smaller state, or a budget
    that makes it go shallower, keeps larger buckets. Lets a planner bound a state's bucket count without
    planning it (the planning costs per bucket)."""
    codecs, names = store_codecs(moment_dtype), segment_names(streams_main)
    budget = default_device_budget_bytes(codecs, names) if device_budget_bytes is None else device_budget_bytes
    deepest = 2 * DEFAULT_DEPTH + 1
    if step_device_bytes(codecs, names, DEFAULT_BUCKET_NUMEL, deepest) <= budget:
        return DEFAULT_BUCKET_NUMEL
    fitted = largest_fitting_bucket(budget, lambda numel, in_flight: step_device_bytes(codecs, names, numel, in_flight),
                                    deepest, SPLIT_ALIGN_NUMEL, DEFAULT_BUCKET_NUMEL)
    return SPLIT_ALIGN_NUMEL if fitted is None else fitted
