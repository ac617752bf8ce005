"""Bucket planning: pure functions from per-entry sizes to buckets, and to the bucket size and pipeline
depth that fit a device budget; and the size of an "auto" host tier.

Buckets are cut at a fixed element budget, independent of any DDP bucketing: a DP1 expert buffer is
one DDP bucket of ~90 GiB and would not fit on the GPU if it were streamed whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .config import DEFAULT_BUCKET_NUMEL, DEFAULT_DEPTH
from .errors import StoreConfigError
from .units import MiB, binary_size
# Split points of a large entry fall on multiples of this many elements, so a split piece starts on a
# 4 KiB boundary for every element size and vectorized kernels walk the same lanes as on the whole entry.
SPLIT_ALIGN_NUMEL = 4096
# The smallest bucket the budget fit picks without a warning: below it the per-bucket costs (one request
# per segment, one optimizer launch per piece, one file) start to outweigh what pipelining hides.
MIN_BUCKET_NUMEL = 1024 * SPLIT_ALIGN_NUMEL  # 4M elements


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of entry `entry` (an index into the planned sequence)."""

    entry: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BucketPlan:
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def plan_buckets(entry_numels: list[int], bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> list[BucketPlan]:
    """Pack entries, in order, into buckets of at most `bucket_numel` elements.

    An entry that does not fit in the current bucket starts a new one; an entry larger than the budget
    is split into budget-sized pieces (split points aligned to SPLIT_ALIGN_NUMEL when the budget allows).
    Empty entries take no space and appear in no bucket.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
    if any(n < 0 for n in entry_numels):
        raise ValueError(f"entry sizes must be >= 0, got {entry_numels}")
    step = bucket_numel - bucket_numel % SPLIT_ALIGN_NUMEL if bucket_numel >= SPLIT_ALIGN_NUMEL else bucket_numel
    buckets: list[BucketPlan] = []
    current: list[Piece] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            buckets.append(BucketPlan(tuple(current)))
        current, used = [], 0

    for index, numel in enumerate(entry_numels):
        if numel == 0:
            continue
        if numel <= bucket_numel:
            if used + numel > bucket_numel:
                close()
            current.append(Piece(index, 0, numel))
            used += numel
            continue
        close()
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            current.append(Piece(index, start, stop))
            used = stop - start
            if stop < numel:
                close()
    close()
    return buckets


# device_bytes(largest_bucket_numel, buckets_in_flight) -> the most state bytes on the device at once when
# that many buckets of at most that many elements are in flight (the store's cost model, bucket.py).
DeviceBytes = Callable[[int, int], int]


@dataclass(frozen=True)
class DeviceFit:
    """A bucket size and pipeline depth, and the device bytes they need at most."""

    bucket_numel: int
    depth: int
    device_bytes: int
    below_minimum: bool  # the buckets are smaller than MIN_BUCKET_NUMEL: the budget forced it (warn)


def buckets_in_flight(num_buckets: int, depth: int) -> int:
    """depth read ahead + one updating + depth held by their write-backs, never more than exist."""
    return min(2 * depth + 1, num_buckets)


def planned_device_bytes(entry_numels: list[int], bucket_numel: int, depth: int, device_bytes: DeviceBytes) -> int:
    """The device bytes a step with this bucket size and depth needs at most, from the actual plan."""
    plans = plan_buckets(entry_numels, bucket_numel)
    largest = max((p.numel for p in plans), default=0)
    return device_bytes(largest, buckets_in_flight(len(plans), depth))


def fit_to_device_budget(entry_numels: list[int], budget_bytes: int, device_bytes: DeviceBytes,
                         max_depth: int = DEFAULT_DEPTH, *, bucket_numel: Optional[int] = None,
                         depth: Optional[int] = None, preferred_bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                         min_bucket_numel: int = MIN_BUCKET_NUMEL) -> DeviceFit:
    """The fastest (bucket_numel, depth) whose step keeps `device_bytes` within `budget_bytes`.

    Rule: the deepest pipeline (depth max_depth down to 0) wins over bigger buckets, because read-ahead and
    write-behind hide the disk while one bucket updates. At each depth the bucket is the preferred size
    when the plan fits (a model whose state is one bucket keeps it whatever the depth), else the largest
    multiple of SPLIT_ALIGN_NUMEL that fits, at least `min_bucket_numel`. When no depth fits a minimum
    bucket, the same search runs down to SPLIT_ALIGN_NUMEL and the fit says `below_minimum`.
    An explicit `bucket_numel` and/or `depth` are used as given: only what is left free is searched, and
    StoreConfigError names both and the budget when they cannot fit. StoreConfigError too when not even
    the smallest bucket fits at depth 0, naming the bytes it needs.
    """
    depths = [depth] if depth is not None else list(range(max_depth, -1, -1))
    if bucket_numel is not None:
        return _check_explicit(entry_numels, budget_bytes, device_bytes, bucket_numel, depth, depths)
    for floor in (min_bucket_numel, SPLIT_ALIGN_NUMEL):
        for d in depths:
            if planned_device_bytes(entry_numels, preferred_bucket_numel, d, device_bytes) <= budget_bytes:
                return _fit(entry_numels, preferred_bucket_numel, d, device_bytes, min_bucket_numel)
            numel = largest_fitting_bucket(budget_bytes, device_bytes, 2 * d + 1, floor, preferred_bucket_numel)
            if numel is not None:
                return _fit(entry_numels, numel, d, device_bytes, min_bucket_numel)
    smallest = min(SPLIT_ALIGN_NUMEL, sum(entry_numels))
    needed = device_bytes(smallest, 1)
    pinned = f" at depth={depth}" if depth is not None else ""
    raise StoreConfigError(
        f"the device budget of {_mib(budget_bytes)} cannot hold even one bucket of {smallest} elements{pinned}"
        f" without read-ahead: that needs {_mib(needed)}. Raise device_budget_mb "
        f"(--stream-optimizer-state-device-budget-mb) to at least {-(-needed // MiB)}"
        + (", or leave depth to the store" if depth else ""))


def _fit(entry_numels: list[int], bucket_numel: int, depth: int, device_bytes: DeviceBytes,
         min_bucket_numel: int) -> DeviceFit:
    return DeviceFit(bucket_numel, depth, planned_device_bytes(entry_numels, bucket_numel, depth, device_bytes),
                     below_minimum=bucket_numel < min(min_bucket_numel, sum(entry_numels)))


def _check_explicit(entry_numels: list[int], budget_bytes: int, device_bytes: DeviceBytes, bucket_numel: int,
                    depth: Optional[int], depths: list[int]) -> DeviceFit:
    for d in depths:
        if planned_device_bytes(entry_numels, bucket_numel, d, device_bytes) <= budget_bytes:
            return DeviceFit(bucket_numel, d, planned_device_bytes(entry_numels, bucket_numel, d, device_bytes),
                             below_minimum=False)
    lowest = depths[-1]
    needed = planned_device_bytes(entry_numels, bucket_numel, lowest, device_bytes)
    shape = f"bucket_numel={bucket_numel} at depth={lowest}" + ("" if depth is not None else " (the shallowest)")
    raise StoreConfigError(
        f"{shape} needs {_mib(needed)} on the device, over the device budget of {_mib(budget_bytes)}: raise "
        f"device_budget_mb (--stream-optimizer-state-device-budget-mb) to at least {-(-needed // MiB)}, or "
        "leave bucket_numel" + (" and depth" if depth is not None else "") + " unset so the store fits them")


def largest_fitting_bucket(budget_bytes: int, device_bytes: DeviceBytes, in_flight: int, floor: int,
                            ceiling: int) -> Optional[int]:
    """The largest multiple of SPLIT_ALIGN_NUMEL in [floor, ceiling] with `in_flight` buckets of it within
    the budget (device_bytes grows with the bucket: bisect), or None."""
    lo, hi = -(-floor // SPLIT_ALIGN_NUMEL), ceiling // SPLIT_ALIGN_NUMEL
    if lo > hi or device_bytes(lo * SPLIT_ALIGN_NUMEL, in_flight) > budget_bytes:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if device_bytes(mid * SPLIT_ALIGN_NUMEL, in_flight) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * SPLIT_ALIGN_NUMEL


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.1f} MiB ({nbytes} bytes)"


def fit_host_cache(available_bytes: int, state_bytes: int, ranks_per_node: int, reserve_bytes: int,
                   rank_reserve_bytes: int) -> int:
    """The host tier of host_cache_mb="auto": this rank's share of the node's free memory after the node
    reserve, less what the rank keeps for itself, floored at 0 and capped at the state (a larger tier
    holds nothing more)."""
    share = (available_bytes - reserve_bytes) // ranks_per_node - rank_reserve_bytes
    return max(0, min(share, state_bytes))


def place_in_host_ram(file_bytes: list[int], budget_bytes: int) -> tuple[bool, ...]:
    """Which buckets live in host RAM only (True) under a host tier of `budget_bytes`: each bucket, in
    order, that still fits whole; the others keep a file on disk. Decided once, when the store is built,
    so the disk is asked only for the files of the rest."""
    placed, used = [], 0
    for nbytes in file_bytes:
        fits = used + nbytes <= budget_bytes
        placed.append(fits)
        used += nbytes if fits else 0
    return tuple(placed)


def check_state_fits(state_bytes: int, ram_bytes: int, free_disk_bytes: int | None, root: str,
                     tier_source: str) -> None:
    """StoreConfigError, before anything is allocated, when the state is larger than the host tier's
    buckets and the disk's free space together (None: the disk is not known yet; not checked). Without
    buckets in RAM the directory's own free-space check says it (Stager.prepare_directory)."""
    disk_bytes = state_bytes - ram_bytes
    if ram_bytes == 0 or free_disk_bytes is None or disk_bytes <= free_disk_bytes:
        return
    raise StoreConfigError(
        f"the optimizer state of {binary_size(state_bytes)} does not fit this rank's host RAM share and disk: the "
        f"host tier holds {binary_size(ram_bytes)} of it ({tier_source}), the other {binary_size(disk_bytes)} need "
        f"files under {root!r}, which has {binary_size(free_disk_bytes)} free. Give the tier more RAM "
        "(--stream-optimizer-state-host-cache-mb), free disk space or choose a larger disk, use narrower moments "
        "(moment_dtype='bf16'), or spread the state over more ranks")
