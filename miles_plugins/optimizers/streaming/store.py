"""The store: owns the buckets of one optimizer's fp32 state and streams them through one step.

Per bucket, in order: fetch (materialize, read) -> update (Adam over exactly its pieces) -> publish
(mains into the model's storage) -> write back -> release. Residency is bounded by the buckets in
flight, never the whole state.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import torch

from . import checkpoint
from .bucket import Bucket, StreamEntry
from .codec import Fp32Codec, make_moment_codecs
from .layout import EXP_AVG, EXP_AVG_SQ, MAIN, bucket_filename, bucket_layout, next_store_uid, store_relative_dir
from .plan import DEFAULT_BUCKET_NUMEL, plan_buckets
from .stager import Stager, StoreConfigError

logger = logging.getLogger(__name__)
GB = 1e9


@dataclass
class StepStats:
    bytes_read: int = 0
    bytes_written: int = 0
    buckets: int = 0
    io_seconds: float = 0.0
    compute_seconds: float = 0.0
    wall_seconds: float = 0.0


@dataclass
class StoreStats:
    num_buckets: int = 0
    state_bytes: int = 0  # bytes of all streamed segments on disk
    steps: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    peak_resident_bytes: int = 0  # most state bytes materialized at once (device buffers + lazy moments)
    resident_bytes: int = 0
    max_bucket_bytes: int = 0  # fp32 bytes of the largest bucket: the residency bound per bucket in flight
    last_step: StepStats = field(default_factory=StepStats)


class NVMeOptimizerStateStore:
    """Streams the fp32 state of `entries` (mains and/or Adam moments) through per-bucket files.

    Build it through `stream_optimizer_state`, which validates the optimizer and binds it.
    """

    def __init__(self, entries: list[StreamEntry], master: torch.optim.Optimizer, *, dir: str, rank: int = 0,
                 instance: int = 0, chunk_mb: int = 256, moment_dtype: str = "fp32",
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        _check_entries(entries)
        self.master = master
        self.entries = entries
        self.streams_main = bool(entries) and entries[0].model_view is not None
        self.device = entries[0].main.device if entries else torch.device("cpu")
        self.moment_dtype = moment_dtype
        self.uid = next_store_uid()
        self.relative_dir = store_relative_dir(rank, instance, self.uid)
        # One codec per segment: exp_avg_sq may be stored differently from exp_avg (codec.py says why).
        self.codecs = {MAIN: Fp32Codec(), **make_moment_codecs(moment_dtype)}
        plans = plan_buckets([e.main.numel() for e in entries], bucket_numel)
        names = (MAIN, EXP_AVG, EXP_AVG_SQ) if self.streams_main else (EXP_AVG, EXP_AVG_SQ)
        file_bytes = [bucket_layout([(n, self.codecs[n].encoded_nbytes(p.numel)) for n in names]).file_bytes
                      for p in plans]
        self.stager = Stager(self.device, chunk_mb * 2**20)
        self.path = self.stager.prepare_directory(dir, self.relative_dir, sum(file_bytes))
        self.buckets: list[Bucket] = []
        try:
            for i, (plan, nbytes) in enumerate(zip(plans, file_bytes)):
                file = self.stager.create_file(os.path.join(self.path, bucket_filename(i)), nbytes)
                self.buckets.append(Bucket(i, plan, entries, master, self.codecs, file, self.device,
                                           self.streams_main))
            self._evict_mains()
        except BaseException:
            self.close()
            raise
        self.stats = StoreStats(num_buckets=len(self.buckets), state_bytes=sum(file_bytes),
                                max_bucket_bytes=max((len(names) * 4 * p.numel for p in plans), default=0))
        self._closed = False
        _LIVE_STORES.add(self)
        logger.info("streaming optimizer state: %d buckets, %.3f GB in %s (moments %s, mains %s)",
                    len(self.buckets), self.stats.state_bytes / GB, self.path, moment_dtype,
                    "streamed" if self.streams_main else "resident (they are the model params)")

    # ---- construction -------------------------------------------------------------------------
    def _evict_mains(self) -> None:
        """Write the mains to disk and free them now, not at the first step: the first rollout and
        forward/backward run before any step, and tight configurations OOM before a lazy store flushes."""
        if not self.streams_main:
            return
        for bucket in self.buckets:
            views = [self.entries[p.entry].main.detach().view(-1)[p.start:p.stop] for p in bucket.pieces]
            bucket._write_segment(self.stager, MAIN, views)
        for entry in self.entries:
            entry.main.untyped_storage().resize_(0)

    # ---- the step -----------------------------------------------------------------------------
    def _order(self) -> list[Bucket]:
        """Alternate direction every step: the buckets written last are read first, still in page cache."""
        return self.buckets if self.stats.steps % 2 == 0 else self.buckets[::-1]

    def _track_residency(self, in_flight: list[Bucket]) -> None:
        self.stats.resident_bytes = sum(b.resident_bytes() for b in in_flight)
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def step(self) -> StepStats:
        self._check_open()
        start = time.perf_counter()
        read0, written0 = self.stager.counters.bytes_read, self.stager.counters.bytes_written
        compute = 0.0
        for bucket in self._order():
            bucket.fetch(self.stager, bucket.segments_to_fetch())
            self._track_residency([bucket])
            t = time.perf_counter()
            bucket.update()
            bucket.publish()
            self._sync()
            compute += time.perf_counter() - t
            self._track_residency([bucket])
            bucket.write_back(self.stager)
            bucket.release()
        self.stats.resident_bytes = 0
        wall = time.perf_counter() - start
        last = StepStats(bytes_read=self.stager.counters.bytes_read - read0,
                         bytes_written=self.stager.counters.bytes_written - written0,
                         buckets=len(self.buckets), io_seconds=wall - compute, compute_seconds=compute,
                         wall_seconds=wall)
        self.stats.steps += 1
        self.stats.bytes_read += last.bytes_read
        self.stats.bytes_written += last.bytes_written
        self.stats.last_step = last
        moved = (last.bytes_read + last.bytes_written) / GB
        logger.info("optimizer step %d streamed %d buckets: read %.3f GB, wrote %.3f GB in %.2f s "
                    "(%.2f GB/s; io %.2f s, compute %.2f s), peak resident %.3f GB",
                    self.stats.steps, last.buckets, last.bytes_read / GB, last.bytes_written / GB, wall,
                    moved / wall if wall else 0.0, last.io_seconds, last.compute_seconds,
                    self.stats.peak_resident_bytes / GB)
        return last

    @torch.no_grad()
    def refresh_main_from_model_params(self) -> None:
        """After the model weights were replaced (checkpoint load): mains <- model params."""
        self._check_open()
        for bucket in self.buckets if self.streams_main else ():
            bucket.refresh_main(self.stager)

    # ---- checkpoints --------------------------------------------------------------------------
    def save_to(self, checkpoint_base: str, wait: bool = True) -> dict | None:
        """Write the state to `<base>/nvme_opt_state/<relative_dir>/` (format: checkpoint.py), atomically.

        wait=False returns once the state is snapshotted; the files are copied in the background and
        the next step waits only for buckets it overwrites before they are copied. Call
        `wait_for_save()` before treating the checkpoint as complete. Returns the save's stats when waited.
        """
        self._check_open()
        self.wait_for_save()
        self._save_job = checkpoint.SaveJob(self, checkpoint_base)
        return self.wait_for_save() if wait else None

    def wait_for_save(self) -> dict | None:
        """Block until the save in flight (if any) is published; raise CheckpointError if it failed."""
        job, self._save_job = getattr(self, "_save_job", None), None
        if job is None:
            return None
        self.last_save = job.wait()
        logger.info("saved optimizer state to %s: %.3f GB, blocked %.3f s, step stalled %.3f s, published "
                    "after %.2f s", job.final, job.stats["bytes"] / GB, job.stats["blocked_seconds"],
                    job.stats["stalled_seconds"], job.stats["seconds"])
        return self.last_save

    def load_from(self, checkpoint_base: str) -> bool:
        """Restore the state saved by `save_to` (resharding onto this layout when it differs). False:
        the checkpoint has no streamed state (logged; the optimizer starts fresh). Call it after the
        model weights and any `refresh_main_from_model_params()`: it overwrites the mains."""
        self._check_open()
        self.wait_for_save()
        return checkpoint.load(self, checkpoint_base)

    # ---- lifetime -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if getattr(self, "_closed", True):
            raise RuntimeError(f"the optimizer-state store at {getattr(self, 'path', '?')} is closed")

    def close(self) -> None:
        """Close and remove the bucket files. Runs at exit too; safe to call twice."""
        if getattr(self, "_closed", False):
            return
        try:  # a checkpoint still copying from the live files finishes first
            self.wait_for_save()
        except Exception:
            logger.exception("a background save of optimizer state failed")
        self._closed = True
        for bucket in getattr(self, "buckets", []):
            self.stager.close_file(bucket.file)
        if hasattr(self, "path"):
            self.stager.remove_directory(self.path)
        if hasattr(self, "stager"):
            self.stager.close()
        _LIVE_STORES.discard(self)


_LIVE_STORES: "weakref.WeakSet[NVMeOptimizerStateStore]" = weakref.WeakSet()


@atexit.register
def _close_live_stores() -> None:
    for store in list(_LIVE_STORES):
        store.close()


def _check_entries(entries: list[StreamEntry]) -> None:
    devices = {e.main.device for e in entries}
    if len(devices) > 1:
        raise StoreConfigError(f"optimizer params are on mixed devices {sorted(map(str, devices))}; "
                               "one store streams the state of one device: move the params to one device")
    for e in entries:
        if e.main.dtype != torch.float32:
            raise StoreConfigError(f"master params must be fp32, got {e.main.dtype} (shape {tuple(e.main.shape)}); "
                                   "for low-precision model params use a mixed-precision optimizer with fp32 masters")
        if not e.main.is_contiguous():
            raise StoreConfigError(f"master param of shape {tuple(e.main.shape)} is not contiguous; "
                                   "make the params contiguous before streaming")
    if len({e.model_view is None for e in entries}) > 1:
        raise StoreConfigError("one store cannot mix streamed and resident mains")
