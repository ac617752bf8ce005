"""The opt-in live integrity check of bucket files (StreamConfig.verify).

The bucket files are scratch this process owns, so the checksums never go to disk: a write records the
crc32 of each chunk it puts in a file, computed on the host bytes the write already passes through
(a staging buffer, a host-cache image, or a CPU tensor's own memory), and a read from the file computes
the crc32 of the same chunk on its way through and compares. The chunks are the engines' transfer
units (`hostio.cut_into_chunks`: chunk_bytes pieces of a segment from its start, the same for both
engines and for the read and the write of a segment), so one chunk's checksum needs no combining.
zlib.crc32 releases the GIL for large buffers: worker threads checksum in parallel with the step.

Not checked, because the bytes never left memory: reads served from the host cache image and buckets
still resident from their write-back. Not checked either: a segment whose file bytes were written
outside the engines (a checkpoint load, verified against the checkpoint's own crc32 on the way in,
forgets the checksums of the files it rewrites) until its next write.
"""

from __future__ import annotations

import os
import zlib
from typing import Callable

import torch

from ..errors import StateCorruptionError
from ..layout import Segment
from .hostio import host_buffer


def crc32_of(buffers: list[torch.Tensor]) -> int:
    """crc32 of the bytes of contiguous CPU tensors, back to back."""
    crc = 0
    for buffer in buffers:
        crc = zlib.crc32(host_buffer(buffer), crc)
    return crc


class FileChecksums:
    """crc32 of every chunk last written to one bucket file, by file offset, while verify is on."""

    def __init__(self, path: str, bucket: int, segments: dict[str, Segment], enabled: bool):
        self.path = path
        self.bucket = bucket
        self.segments = segments
        self.enabled = enabled
        self._crcs: dict[int, tuple[int, int]] = {}  # chunk offset -> (nbytes, crc32)

    def written(self, offset: int, buffers: list[torch.Tensor]) -> None:
        """The file now holds `buffers` at `offset` (call after the write succeeded)."""
        if not self.enabled:
            return
        nbytes = sum(b.numel() for b in buffers)
        crc = crc32_of(buffers)
        for start in [s for s, (n, _) in self._crcs.items() if s < offset + nbytes and offset < s + n]:
            del self._crcs[start]  # replaced, whatever its chunking was
        self._crcs[offset] = (nbytes, crc)

    def read(self, offset: int, buffers: list[torch.Tensor]) -> None:
        """`buffers` were just read from `offset`: raise StateCorruptionError unless they are the bytes the
        store last wrote there (a chunk not written through the engines since verify went on is not checked)."""
        expected = self._crcs.get(offset) if self.enabled else None
        nbytes = sum(b.numel() for b in buffers)
        if expected is None or expected[0] != nbytes:
            return
        crc = crc32_of(buffers)
        if crc != expected[1]:
            raise self.mismatch(offset, nbytes, crc, expected[1])

    def in_order_check(self) -> Callable[[int, memoryview], None] | None:
        """A check of the whole file read back in order from offset 0 (a checkpoint's copy of it) against
        the chunks recorded now: call it with each piece read, `(file offset, bytes)`; it raises
        StateCorruptionError at the first chunk that differs. None: nothing recorded (verify off)."""
        if not self.enabled or not self._crcs:
            return None
        return _InOrderCheck(self, sorted(self._crcs.items())).feed

    def mismatch(self, offset: int, nbytes: int, crc: int, expected: int) -> StateCorruptionError:
        return StateCorruptionError(
            f"optimizer state of bucket {self.bucket}, segment {self._segment_at(offset)}, bytes "
            f"[{offset}, {offset + nbytes}) of {self.path} changed on disk since the store wrote them (crc32 "
            f"{crc:#010x}, written {expected:#010x}): something outside the store modified the file, or the "
            "disk returned corrupt data. The store is unusable now: restore the model weights and call "
            "store.load_from(<last checkpoint>), or restart from the last checkpoint; check the disk "
            f"({os.path.dirname(self.path)}) and that no other process writes there")

    def forget(self) -> None:
        """The file was rewritten outside the engines (a checkpoint load): nothing recorded holds."""
        self._crcs.clear()

    def enable(self, on: bool) -> None:
        """Turn verify on or off (set_io); either way nothing recorded before holds afterwards."""
        self.enabled = on
        self._crcs.clear()

    def _segment_at(self, offset: int) -> str:
        return next(s.name for s in self.segments.values() if s.offset <= offset < s.offset + s.nbytes)


class _InOrderCheck:
    """Checks a file's bytes, fed in file order with no gap, against recorded chunks (offset, (nbytes,
    crc32)) sorted by offset. A chunk may span pieces (the copy's pieces are not the engines' chunks): its
    crc32 is chained across them. Bytes outside every chunk (alignment padding) are not checked."""

    def __init__(self, checksums: FileChecksums, chunks: list[tuple[int, tuple[int, int]]]):
        self.checksums = checksums
        self.chunks = chunks
        self.next = 0  # the first chunk not yet checked whole
        self.crc = 0  # of the part of chunk `next` fed so far

    def feed(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        while self.next < len(self.chunks):
            start, (nbytes, expected) = self.chunks[self.next]
            if start >= end:
                return  # begins in a later piece
            stop = start + nbytes
            self.crc = zlib.crc32(data[max(start, offset) - offset:min(stop, end) - offset], self.crc)
            if stop > end:
                return  # continues in the next piece
            if self.crc != expected:
                raise self.checksums.mismatch(start, nbytes, self.crc, expected)
            self.next, self.crc = self.next + 1, 0
