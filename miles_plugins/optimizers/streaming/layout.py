"""File layout: where each bucket's segments live, and the one spelling of a store's directories.

A bucket file holds its segments back to back, `[main | exp_avg | exp_avg_sq]` (main absent when the
params are themselves the fp32 masters). Inside a segment the pieces follow the bucket's piece order.
Every segment starts on a 4 KiB boundary, which O_DIRECT and GPUDirect Storage require.
"""

from __future__ import annotations

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


def is_bucket_filename(name: str) -> bool:
    """True for a name :func:`bucket_filename` makes: the only files a store creates in its directory."""
    digits = name[len("bucket"):-len(".bin")]
    return name.startswith("bucket") and name.endswith(".bin") and digits.isdigit() and name == bucket_filename(int(digits))


STREAMED_DIR = "nvme_opt_state"  # a checkpoint holds each store's state under <base>/STREAMED_DIR/<relative_dir>


def store_identity(instance: int, part: int) -> str:
    """`opt{instance}_{part}`: which optimizer of the process a store serves, chosen by its binding.

    instance: the optimizer's instance number (Megatron: distributed_optimizer_instance_id; 0 otherwise).
    part: its index within a Megatron ChainedOptimizer (dense, expert, ...; 0 otherwise). Both depend on
    what the optimizer is, never on the order stores were built in, so a restarted job finds its
    checkpoints; the spelling is the one older checkpoints used for the same stores in a fresh process.
    """
    return f"opt{instance}_{part}"


def store_relative_dir(rank: int, instance: int, part: int) -> str:
    """`rank{rank:05d}/opt{instance}_{part}`: the live scratch directory and the checkpoint's alike."""
    return f"rank{rank:05d}/{store_identity(instance, part)}"
