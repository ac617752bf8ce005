"""Bucket planning: a pure function from per-entry sizes to buckets under an element budget.

Buckets are cut at a fixed element budget, independent of any DDP bucketing: a DP1 expert buffer is
one DDP bucket of ~90 GiB and would not fit on the GPU if it were streamed whole.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BUCKET_NUMEL = 200_000_000
# Split points of a large entry fall on multiples of this many elements, so a split piece starts on a
# 4 KiB boundary for every element size and vectorized kernels walk the same lanes as on the whole entry.
SPLIT_ALIGN_NUMEL = 4096


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
