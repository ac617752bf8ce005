"""File layout: where each bucket's segments live, and the one spelling of a store's directory.

A bucket file holds its segments back to back, `[main | exp_avg | exp_avg_sq]` (main absent when the
params are themselves the fp32 masters). Inside a segment the pieces follow the bucket's piece order.
Every segment starts on a 4 KiB boundary, which O_DIRECT and GPUDirect Storage require.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

ALIGN_BYTES = 4096
MAIN, EXP_AVG, EXP_AVG_SQ = "main", "exp_avg", "exp_avg_sq"
MOMENTS = (EXP_AVG, EXP_AVG_SQ)


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    return (nbytes + align - 1) // align * align


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int  # byte offset in the bucket file, a multiple of ALIGN_BYTES
    nbytes: int  # bytes of payload (the file reserves align_up(nbytes))


@dataclass(frozen=True)
class BucketLayout:
    segments: dict[str, Segment]
    file_bytes: int


def bucket_layout(segment_nbytes: list[tuple[str, int]]) -> BucketLayout:
    """Place segments in the given order, each on an ALIGN_BYTES boundary."""
    segments, offset = {}, 0
    for name, nbytes in segment_nbytes:
        segments[name] = Segment(name, offset, nbytes)
        offset += align_up(nbytes)
    return BucketLayout(segments, offset)


def bucket_filename(index: int) -> str:
    return f"bucket{index:05d}.bin"


def store_relative_dir(rank: int, instance: int, uid: int) -> str:
    """`rank{rank:05d}/opt{instance}_{uid}`: used for the live scratch directory and checkpoints alike.

    `uid` is a per-process construction counter: chained dense and expert optimizers can share an
    instance id, and two stores must never share a directory (each would wipe the other's files).
    """
    return f"rank{rank:05d}/opt{instance}_{uid}"


_construction_counter = itertools.count()


def next_store_uid() -> int:
    """Deterministic across runs as long as stores are built in the same order."""
    return next(_construction_counter)
