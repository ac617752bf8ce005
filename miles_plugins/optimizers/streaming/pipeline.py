"""A store's step pipeline: which of its buckets are on the device, and one step's walk over them.

Per bucket, in order: fetch (materialize, read) -> update (Adam over exactly its pieces) -> publish
(mains into the model's storage) -> write back -> release. While bucket i updates, the reads of the next
`depth` buckets and the write-backs of the previous `depth` are in flight (the stager's engine: worker
threads, CUDA streams). A bucket's storage is released once its write-back no longer needs it, unless the
next step can use it as is (held, fp32 segments: no read).
  read-ahead   `prefetch()` starts the reads of the next step's first `depth` buckets that would come
               from disk, while the disk is idle (before forward/backward).
  write-behind with `write_behind` the walk returns with up to `depth` write-backs still in flight.
  order        the bucket order alternates every step, so the buckets written last are read first (still
               in the page cache with buffered I/O, or still resident on the device).
What it holds (`fetching`: reads started, `held`: written back with storage kept, `current`: updating) is
the store's device residency: StoreStats.resident_bytes and peak_resident_bytes are measured here, against
the bound footprint.residency_bound_bytes (at most min(2 * depth + 1, buckets) buckets, plus one codec's
chunk scratch while a narrow codec encodes or decodes).

Errors propagate: the store poisons itself and calls `abort()` (its module doc: failure semantics).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .bucket import Bucket
from .io.stager import Stager
from .layout import EXP_AVG, EXP_AVG_SQ, MAIN
from .stats import StoreStats


@dataclasses.dataclass
class StepWalk:
    """What one step's walk over the buckets measured; the store makes its StepStats from it."""

    read_bytes: int = 0  # the segments the step needed, wherever they came from
    reused_bytes: int = 0  # of those, still resident from the previous step's write-back
    peak_resident_bytes: int = 0
    compute_seconds: float = 0.0  # update + publish, synchronized
    prefetched_buckets: int = 0  # reads in flight when the step began


class BucketPipeline:
    """Moves a store's buckets through the device: one step's walk, read-ahead, release.

    buckets: the store's list (the store fills it as it creates them). stats: the store's StoreStats,
    whose residency figures this keeps. depth, write_behind: the fitted depth and whether the walk may
    return before its write-backs land (`configure` changes both between steps)."""

    def __init__(self, buckets: list[Bucket], stager: Stager, codecs: dict, stats: StoreStats, device: torch.device,
                 *, depth: int, write_behind: bool, streams_main: bool):
        self.buckets, self.stager, self.codecs, self.stats, self.device = buckets, stager, codecs, stats, device
        self.depth, self.write_behind, self.streams_main = depth, write_behind, streams_main
        self.fetching: dict[int, Bucket] = {}  # reads started, not yet consumed by a step
        self.held: dict[int, tuple[Bucket, int]] = {}  # written back, storage kept: (bucket, extra bytes)
        self.current: Bucket | None = None
        self.order_flipped = False  # a load restored a saved run's bucket order (restore_next_order)
        self._walk = StepWalk()

    def configure(self, *, depth: int, write_behind: bool) -> None:
        """A new depth and write-behind, between steps (the store's set_io, after a flush)."""
        self.depth, self.write_behind = depth, write_behind

    # ---- order ---------------------------------------------------------------------------------
    def next_order(self) -> list[Bucket]:
        """The order the next step walks the buckets in. It alternates every step: the buckets written
        last are read first, still in page cache. A checkpoint records the direction (the encode order
        decides which bucket draws which stochastic-rounding noise) and a load restores it."""
        return self.buckets[::-1] if self.next_order_descending() else self.buckets

    def next_order_descending(self) -> bool:
        return (self.stats.steps % 2 == 1) != self.order_flipped

    def restore_next_order(self, descending: bool) -> None:
        """Make the next step walk the buckets as a saved run's next step would have (checkpoint load)."""
        self.order_flipped = descending != (self.stats.steps % 2 == 1)

    # ---- a step ----------------------------------------------------------------------------------
    def walk(self) -> StepWalk:
        """One optimizer step over every bucket, in the next order (the store counts it in stats.steps,
        which the order alternates with). Raises what the step raised; the caller poisons the store and
        calls abort()."""
        self._walk = walk = StepWalk(prefetched_buckets=len(self.fetching))
        order = self.next_order()
        for i, bucket in enumerate(order):
            self._acquire(bucket)
            self._read_ahead(order, i + 1)
            start = time.perf_counter()
            bucket.update()
            bucket.publish()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            walk.compute_seconds += time.perf_counter() - start
            self._track_residency()
            self._write_back(bucket)
            self._release_written(self.depth)
        if not self.write_behind:
            self._release_written(0)
            for bucket in self.buckets:
                self.stager.wait_writes(bucket.file)
        return walk

    def prefetch(self) -> int:
        """Start reads of the next step's first buckets that need the disk, up to `depth` in flight
        (skipping buckets still resident from their write-back or in the host cache). Returns the reads
        started."""
        if self.depth == 0:
            return 0
        self._release_written(self.depth)
        return self._read_ahead(self.next_order(), 0, disk_only=True)

    def fill_host_tier(self) -> tuple[int, int]:
        """Start reading into the host tier's free space the buckets it holds no image of, in the next
        step's order (stager.fill_host_tier). Returns (bytes started, buckets started)."""
        started = buckets = 0
        for bucket in self.next_order():
            names = bucket.segments_to_fetch()
            if not names or self._host_cached(bucket, names) or bucket.index in self.fetching:
                continue
            spans = [(bucket.layout.segments[n].offset, bucket.layout.segments[n].nbytes) for n in names]
            nbytes = self.stager.fill_host_tier(bucket.file, spans)
            started, buckets = started + nbytes, buckets + (nbytes > 0)
        return started, buckets

    def release_all(self) -> None:
        """Release every bucket held (the I/O in flight has ended): prefetched buckets are discarded (the
        next step reads them again), written-back ones freed."""
        for bucket in list(self.fetching.values()):
            bucket.discard_pending_decode()
            bucket.release()
        for bucket, _ in self.held.values():
            bucket.release()
        if self.current is not None:
            self.current.release()
        self.fetching, self.held, self.current = {}, {}, None
        self.stats.resident_bytes = 0

    def abort(self) -> None:
        """After a failed step: wait out the I/O in flight, ignoring its errors, and release everything."""
        self.stager.wait_all(raise_errors=False)
        self.release_all()

    # ---- the phases --------------------------------------------------------------------------------
    def _track_residency(self, scratch: int = 0) -> None:
        """Measure the state bytes on the device now: every bucket in flight, plus `scratch` while a
        codec encodes or decodes (its chunk temporaries are not tensors the store holds: their bound)."""
        live = {b.index: b for b in self.fetching.values()}
        live.update((i, b) for i, (b, _) in self.held.items())
        if self.current is not None:
            live[self.current.index] = self.current
        total = sum(b.resident_bytes() + b.pending_decode_bytes() for b in live.values())
        total += sum(extra for _, extra in self.held.values()) + scratch
        self.stats.resident_bytes = total
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, total)
        self._walk.peak_resident_bytes = max(self._walk.peak_resident_bytes, total)

    def _reusable(self, bucket: Bucket, names: tuple[str, ...]) -> bool:
        """Held by its write-back with every segment to fetch resident: its buffers hold exactly what
        the file will, so the next step needs no read. Only segments stored as is (a narrow codec's file
        bytes are a rounding of the buffer, and the update must see what a read would give)."""
        return (bucket.index in self.held and bool(names)
                and all(self.codecs[n].reads_in_place() for n in names)
                and all(bucket.flat[n].untyped_storage().nbytes() == bucket.numel * 4 for n in names))

    def _host_cached(self, bucket: Bucket, names: tuple[str, ...]) -> bool:
        """The host cache holds these segments: a read costs a host->device copy, no disk."""
        return bool(names) and all(self.stager.is_cached(bucket.file, bucket.layout.segments[n].offset,
                                                         bucket.layout.segments[n].nbytes) for n in names)

    def _start_fetch(self, bucket: Bucket) -> None:
        self.held.pop(bucket.index, None)  # its storage is refilled once its write-back has landed
        bucket.start_fetch(self.stager, bucket.segments_to_fetch())
        self.fetching[bucket.index] = bucket
        self._track_residency()

    def _read_ahead(self, order: list[Bucket], start: int, disk_only: bool = False) -> int:
        """Start reads of the buckets from order[start] on until `depth` are in flight; disk_only skips
        the buckets the host cache holds (the step's own read of them is a copy, no disk)."""
        started = 0
        for bucket in order[start:]:
            if len(self.fetching) >= self.depth:
                break
            names = bucket.segments_to_fetch()
            if bucket.index in self.fetching or not names or self._reusable(bucket, names):
                continue
            if disk_only and self._host_cached(bucket, names):
                continue
            self._start_fetch(bucket)
            started += 1
        return started

    def _acquire(self, bucket: Bucket) -> None:
        """fetch: make `bucket` resident with its current state (prefetched, still resident, or read now)."""
        names = bucket.segments_to_fetch()
        nbytes = sum(bucket.layout.segments[n].nbytes for n in names)
        self._walk.read_bytes += nbytes
        if bucket.index in self.fetching and not all(
                bucket.flat[n].untyped_storage().nbytes() == bucket.numel * 4 for n in names):
            bucket.finish_fetch(self.stager)  # released behind the pipeline's back (a direct bucket.fetch/
            del self.fetching[bucket.index]  # release by a test or a tool): read it again
        if bucket.index not in self.fetching and self._reusable(bucket, names):
            self.stager.wait_sources(bucket.file)  # the update must not change what is still being copied out
            del self.held[bucket.index]
            self._walk.reused_bytes += nbytes
        else:
            if bucket.index not in self.fetching:
                self._start_fetch(bucket)
            self._track_residency(scratch=self._codec_scratch(bucket.segments_to_fetch()))  # decoding
            bucket.finish_fetch(self.stager)
            del self.fetching[bucket.index]
        self.current = bucket
        self._track_residency()

    def _write_back(self, bucket: Bucket) -> None:
        """write back: submit the bucket's writes; its storage stays held until they no longer need it."""
        lazy = bucket.resident_bytes() - sum(f.untyped_storage().nbytes() for f in bucket.flat.values())
        bucket.write_back(self.stager)
        written = ((MAIN,) if self.streams_main else ()) + ((EXP_AVG, EXP_AVG_SQ) if bucket.moments_on_disk else ())
        encoded = sum(self.codecs[n].encoded_nbytes(bucket.numel) for n in written
                      if not self.codecs[n].reads_in_place())
        self.held[bucket.index] = (bucket, lazy + encoded)
        self.current = None
        self._track_residency(scratch=self._codec_scratch(written))  # what encoding it held at its deepest

    def _codec_scratch(self, names) -> int:
        """The codec scratch bound while segments `names` are encoded or decoded (0 when all are fp32)."""
        return 0 if all(self.codecs[n].reads_in_place() for n in names) else self.stats.codec_scratch_bytes

    def _release_written(self, limit: int) -> None:
        """release: free buckets whose write-backs no longer need their storage (keeping the ones the
        next step can reuse), and block on the oldest while more than `limit` are held."""
        for index, (bucket, _) in list(self.held.items()):
            names = bucket.segments_to_fetch()
            keep = self._reusable(bucket, names) and not self._host_cached(bucket, names)
            if self.stager.sources_released(bucket.file) and not keep:
                bucket.release()
                del self.held[index]
        while len(self.held) > limit:
            index, (bucket, _) = next(iter(self.held.items()))
            self.stager.wait_sources(bucket.file)
            bucket.release()
            del self.held[index]
        self._track_residency()
