"""The store: owns the buckets of one optimizer's fp32 state and streams them through one step.

Per bucket, in order: fetch (materialize, read) -> update (Adam over exactly its pieces) -> publish
(mains into the model's storage) -> write back -> release. Residency is bounded by the buckets in
flight, never the whole state. pipeline.py walks the buckets through those phases (read-ahead of the
next `depth`, write-behind of the previous `depth`, the alternating order); the store builds the
buckets, checks and counts each step, and owns what lasts between steps:
  write-behind the step returns with up to `depth` write-backs still in flight; the next read of such a
               bucket, a save/load (stager.drain), `flush()` and `close()` wait for them. A bucket still
               resident from its write-back is reused by the next step without a read (fp32 segments).
  host tier    optional (host_cache_mb): the buckets it holds whole when the store is built live in host
               RAM only, with no file (plan.place_in_host_ram, Stager.create_in_ram); the disk holds the rest.
               What is left, or a tier set later by set_io, keeps write-back images of files
               (io/hostcache.py): their reads and writes cost a host<->device copy and no disk I/O. Their bytes
               reach the files only on flush() and save_to() (and set_io, which flushes); load_from() replaces
               the state and close() removes the files, neither writes them. release_device() frees
               the device without waiting for the disk. Images are fixed per file once given; a load
               or set_io drops them, and fill_host_tier() (called by both) reads the buckets back into
               the tier in the background, so the next step finds them in host RAM.
Device budget (StreamConfig.device_budget_mb; default one DEFAULT_BUCKET_NUMEL bucket's worth, config.py):
the store picks bucket_numel and depth with plan.fit_to_device_budget (footprint.py: the one cost model of a
store, which `miles plan` sizes runs with) so that the residency bound stays within it. Residency bound
(StoreStats.residency_bound_bytes <= device_budget_bytes): at most min(2 * depth + 1, buckets) are
materialized at any time (depth reading ahead, one updating, depth held by their write-backs), each at most
`bucket_inflight_bytes` (fp32 buffers of the streamed segments + encoded temporaries of narrow moment
codecs), plus one narrow codec's chunk scratch (`codec_scratch_bytes`). The engine stages on the host only:
no device staging. peak_resident_bytes measures the same ledger. Between steps at most 2 * depth buckets
(prefetched + write-behind). Host memory on top: the engine's staging (`staging_bytes`) and the optional
host cache (`host_cache_bytes`). The Adam kernel's own temporaries are not state and not counted.
io_engine="sync" is depth 0: one bucket, no write-behind.

Failure semantics (both engines; docs/dev/contracts.md): a step either lands every bucket or poisons
the store. Any error while a step runs, and any I/O error of its write-behind found later (the next
step, prefetch, flush, save), leaves some buckets a step ahead of others, so the store is poisoned:
`step`, `prefetch`, `flush` and `save_to` raise StorePoisonedError (saying how to recover) instead of
stepping on or publishing that torn state. `load_from(last checkpoint)` recovers: it rebuilds the I/O
engine, restores the state and clears the poison (restore the model weights first, as for any resume).
`close` always works.

verify (opt-in, io/verify.py): every chunk of a bucket file is checksummed when written and checked when
read back from disk; a file changed outside the store raises StateCorruptionError from the step, which
poisons the store like any I/O failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import weakref
from typing import Callable

import torch
from tqdm import tqdm

from miles_plugins.host.memory import available_host_memory

from .checkpoint import save_load as checkpoint
from .bucket import Bucket, StreamEntry, storage_identity
from .config import HOST_CACHE_AUTO, StreamConfig
from .errors import CheckpointError, StateCorruptionError, StoreConfigError, StorePoisonedError
from .footprint import bucket_layouts, fit_store, residency_bound_bytes, segment_names, store_codecs, store_footprint
from .io.stager import Stager, free_disk_bytes
from .layout import MAIN, STREAMED_DIR, bucket_filename, store_identity, store_relative_dir
from .lifetime import LIVE_STORES, StoreResources, call_if_alive, refuse_shared_directory, release_dropped_store
from .pipeline import BucketPipeline
from .plan import (DEFAULT_BUCKET_NUMEL, MIN_BUCKET_NUMEL, check_state_fits, fit_host_cache, place_in_host_ram,
                   plan_buckets)
from .stats import StepStats, StoreStats
from .units import GB, MiB

logger = logging.getLogger(__name__)


class NVMeOptimizerStateStore:
    """Streams the fp32 state of `entries` (mains and/or Adam moments) through per-bucket files.

    Build it through `stream_optimizer_state`, which validates the optimizer and binds it.
    """

    def __init__(self, entries: list[StreamEntry], master: torch.optim.Optimizer, config: StreamConfig, *,
                 instance: int = 0, part: int = 0, resident_adam=None, model_params: dict[str, int] | None = None,
                 shard_of: Callable[[str], str] | None = None):
        """config: a StreamConfig (valid by construction: config.check_config; stream_optimizer_state checks that it
        is one); its rank must be resolved.
        instance, part: the store's identity, chosen by the binding (layout.store_relative_dir): the
        directory it works in and the one its checkpoints are saved under. resident_adam: the small
        always-resident Adam over native-fp32 params the binding steps beside the store (or None);
        checkpoints carry its state. model_params: {entry name: elements} of every param this store's
        identity covers across ranks, so a load refuses a checkpoint of another model (None: the binding
        cannot list them; not checked). shard_of: an entry name's model shard (the parallel coordinates other
        than data parallelism it carries), with which a load on another data-parallel size reshards from this
        shard's saved states only (None: every saved state of this identity is this shard's)."""
        if config.rank is None:
            raise StoreConfigError("config.rank is None: resolve it (torch.distributed's rank) before building a store")
        _check_entries(entries)
        self.config = config
        self.master = master
        self.entries = entries
        self.resident_adam = resident_adam
        self.model_params = model_params
        self.shard_of = shard_of
        self.streams_main = bool(entries) and entries[0].model_view is not None
        self.device = entries[0].main.device if entries else torch.device("cpu")
        self.moment_dtype = config.moment_dtype
        self.identity = store_identity(instance, part)
        self.relative_dir = store_relative_dir(config.rank, instance, part)
        self._save_job = None
        self.last_save: dict | None = None
        self.poisoned_by: BaseException | None = None  # the failure that left a torn state (see the module doc)
        self._closed = True  # until the files exist
        self.path: str | None = None
        self.directory_lock = None  # held from before the wipe until close: one live store per directory
        self.buckets: list[Bucket] = []
        self.codecs = store_codecs(config.moment_dtype)
        self.segment_names = segment_names(self.streams_main)
        footprint = self._fit_footprint(config)
        plans = plan_buckets(self._entry_numels(), self.bucket_numel)
        layouts = bucket_layouts(self.codecs, self.segment_names, plans)
        live_path = os.path.join(os.path.abspath(config.dir), self.relative_dir)
        _refuse_directory_in_a_checkpoint(live_path)
        refuse_shared_directory(live_path)
        in_ram = self._place_in_ram(config, list(footprint.bucket_file_bytes))
        self.stager = Stager(self.device, config.chunk_mb * MiB, io_engine=config.io_engine,
                             io_threads=config.io_threads, direct_io=config.direct_io,
                             host_cache_bytes=self.host_cache_bytes, ram_home_bytes=self.stats.ram_state_bytes)
        self.pipeline = BucketPipeline(self.buckets, self.stager, self.codecs, self.stats, self.device,
                                       depth=footprint.depth, write_behind=_write_behind(config),
                                       streams_main=self.streams_main)
        # weakly: the stager outlives a dropped store in its finalizer, and must not keep its pipeline alive
        self.stager.on_drain(call_if_alive(weakref.WeakMethod(self.pipeline.release_all)))
        self._resources = StoreResources(self.stager)
        self._finalizer = weakref.finalize(self, release_dropped_store, self._resources, self.relative_dir)
        self._finalizer.atexit = False  # at exit, lifetime.close_live_stores closes the live ones in full
        self._bound = self._binding()
        self._update_io_stats()
        self._closed = False
        LIVE_STORES.add(self)
        self._create_buckets(plans, layouts, in_ram)
        self._log_construction(footprint.below_minimum)

    def _fit_footprint(self, config: StreamConfig):
        """The store's footprint (footprint.py: bucket size and depth fitted to the device budget, bucket
        and state bytes); sets the sizes it decides and the construction's stats."""
        footprint = store_footprint(self._entry_numels(), config.moment_dtype, streams_main=self.streams_main,
                                    bucket_numel=config.bucket_numel, depth=config.depth,
                                    device_budget_bytes=_device_budget_bytes(config), sync=config.io_engine == "sync")
        self.device_budget_bytes = footprint.device_budget_bytes
        self.bucket_numel = footprint.bucket_numel
        self.stats = StoreStats(num_buckets=footprint.num_buckets, state_bytes=footprint.state_bytes,
                                max_bucket_bytes=len(self.segment_names) * 4 * footprint.max_bucket_numel,
                                bucket_numel=self.bucket_numel, bucket_inflight_bytes=footprint.bucket_inflight_bytes,
                                codec_scratch_bytes=footprint.codec_scratch_bytes,
                                device_budget_bytes=self.device_budget_bytes)
        return footprint

    def _place_in_ram(self, config: StreamConfig, file_bytes: list[int]) -> tuple[bool, ...]:
        """Size the host tier and choose the buckets that live in it only (RAM first, files for the rest);
        StoreConfigError before anything is allocated when the tier and the free disk together cannot hold
        the state."""
        self.host_cache_bytes = self._host_cache_bytes(config)
        in_ram = place_in_host_ram(file_bytes, self.host_cache_bytes if config.io_engine == "pipelined" else 0)
        self.stats.ram_state_bytes = sum(n for n, ram in zip(file_bytes, in_ram) if ram)
        check_state_fits(self.stats.state_bytes, self.stats.ram_state_bytes,
                         free_disk_bytes(config.dir, self.relative_dir), config.dir,
                         f"host_cache_mb={config.host_cache_mb!r}: {self.host_cache_bytes / GB:.3f} GB")
        return in_ram

    def _create_buckets(self, plans, layouts, in_ram: tuple[bool, ...]) -> None:
        """Lock and empty the store's directory, make each planned bucket (a file, or host RAM only where
        in_ram says so) and evict the mains into them. Any failure closes the store, then raises."""
        config = self.config
        file_bytes = [layout.file_bytes for layout in layouts]
        try:
            self.directory_lock = self.stager.prepare_directory(config.dir, self.relative_dir,
                                                                sum(file_bytes) - self.stats.ram_state_bytes)
            self._resources.directory_lock = self.directory_lock
            self.path = self.directory_lock.directory
            self.stager.expect_files(max(file_bytes, default=0))
            for i, (plan, layout) in enumerate(zip(plans, layouts)):
                create = self.stager.create_in_ram if in_ram[i] else self.stager.create_file
                file = create(os.path.join(self.path, bucket_filename(i)), layout.file_bytes, layout=layout, bucket=i,
                              verify=config.verify)
                self._resources.files.append(file)
                self.buckets.append(Bucket(i, plan, self.entries, self.master, self.codecs, file, self.device,
                                           self.streams_main))
            self._evict_mains()
        except BaseException:
            self.close()
            raise

    def _log_construction(self, below_minimum: bool) -> None:
        config = self.config
        logger.info("streaming optimizer state: %d buckets of <= %d elements, %.3f GB in %s (moments %s, mains "
                    "%s); %s I/O, depth %d, device residency bound %.3f GB of a %.3f GB device budget (%s) + "
                    "host staging %.3f GB + host cache %.3f GB (%.3f GB of the state in host RAM only, %.3f GB "
                    "in files)",
                    len(self.buckets), self.bucket_numel, self.stats.state_bytes / GB, self.path,
                    config.moment_dtype, "streamed" if self.streams_main else "resident (they are the model params)",
                    self.stats.io_engine, self.depth, self.stats.residency_bound_bytes / GB,
                    self.device_budget_bytes / GB, "given" if config.device_budget_mb else "default: one bucket of "
                    f"{DEFAULT_BUCKET_NUMEL} elements", self.stats.staging_bytes / GB, self.stats.host_cache_bytes / GB,
                    self.stats.ram_state_bytes / GB, (self.stats.state_bytes - self.stats.ram_state_bytes) / GB)
        if below_minimum:
            logger.warning("the device budget of %.3f GB holds only buckets of %d elements (depth %d), below the "
                           "%d the store prefers: many small buckets cost per-bucket overhead every step. Raise "
                           "device_budget_mb (--stream-optimizer-state-device-budget-mb) if the device has room",
                           self.device_budget_bytes / GB, self.bucket_numel, self.depth, MIN_BUCKET_NUMEL)

    def _entry_numels(self) -> list[int]:
        return [e.main.numel() for e in self.entries]

    def _fit_to_budget(self, config: StreamConfig, bucket_numel: int | None):
        """Bucket size and depth within the device budget; the sync engine is depth 0 whatever is asked."""
        return fit_store(self._entry_numels(), self.codecs, self.segment_names, self.device_budget_bytes,
                         bucket_numel=bucket_numel, depth=config.depth, sync=config.io_engine == "sync")

    def _update_io_stats(self) -> None:
        """The stats that follow the I/O configuration (construction and set_io)."""
        s = self.stats
        s.io_engine, s.depth = self.stager.io_engine, self.depth
        s.residency_bound_bytes = residency_bound_bytes(s.num_buckets, self.depth, s.bucket_inflight_bytes,
                                                        s.codec_scratch_bytes)
        s.staging_bytes, s.host_cache_bytes = self.stager.staging_bytes, self.host_cache_bytes
        self._marks = self._read_marks()

    def _host_cache_bytes(self, config: StreamConfig) -> int:
        """The host tier's budget: host_cache_mb, or under "auto" this rank's share of the node's free
        memory now (plan.fit_host_cache), logged with the numbers it came from."""
        if config.host_cache_mb != HOST_CACHE_AUTO:
            return config.host_cache_mb * MiB
        available = available_host_memory()
        if available is None:
            logger.warning("host_cache_mb='auto': this host's available memory cannot be read (/proc/meminfo): no host "
                           "tier; pass host_cache_mb in MiB instead")
            return 0
        reserve, rank_reserve = config.host_cache_reserve_mb * MiB, config.host_cache_rank_reserve_mb * MiB
        run_reserve = config.host_cache_run_reserve_mb * MiB
        size = fit_host_cache(available, self.stats.state_bytes, config.host_cache_ranks_per_node,
                              reserve + run_reserve, rank_reserve)
        logger.info("host tier (host_cache_mb='auto'): %.3f GB = min(state %.3f GB, (available %.3f GB - node "
                    "reserve %.3f GB - the run's other host memory %.3f GB) / %d ranks on the node - rank reserve "
                    "%.3f GB), at least 0",
                    size / GB, self.stats.state_bytes / GB, available / GB, reserve / GB, run_reserve / GB,
                    config.host_cache_ranks_per_node, rank_reserve / GB)
        return size

    @property
    def depth(self) -> int:
        """Buckets read ahead and written behind (the pipeline's; set_io may change it)."""
        return self.pipeline.depth

    @property
    def write_behind(self) -> bool:
        """Whether a step returns before its last write-backs land (never with the sync engine)."""
        return self.pipeline.write_behind

    @property
    def direct_io(self) -> bool:
        """Whether the engine moves bytes with O_DIRECT now (a probe may have fallen back to buffered)."""
        return self.stager.direct_io

    def reset_stats(self) -> None:
        """Start the peak-residency measurement over (benchmarks measure one configuration at a time)."""
        self.stats.peak_resident_bytes = self.stats.resident_bytes

    # ---- construction -------------------------------------------------------------------------
    def _evict_mains(self) -> None:
        """Write the mains to disk and free them now, not at the first step: the first rollout and
        forward/backward run before any step, and tight configurations OOM before a lazy store flushes."""
        if not self.streams_main:
            return
        start = time.perf_counter()
        progress = tqdm(self.buckets, desc="writing fp32 mains to disk", unit="bucket", leave=False,
                        disable=len(self.buckets) < 8 or not logger.isEnabledFor(logging.INFO))
        for bucket in progress:
            views = [self.entries[p.entry].main.detach().view(-1)[p.start:p.stop] for p in bucket.pieces]
            bucket.write_segment(self.stager, MAIN, views)
        self.stager.wait_all()  # the writes read from the mains' storage
        for entry in self.entries:
            entry.main.untyped_storage().resize_(0)
        nbytes = 4 * sum(b.numel for b in self.buckets)
        self._marks = self._read_marks()  # the first step's stats count from here: not the eviction's writes
        logger.info("evicted %.3f GB of fp32 mains to disk in %.2f s", nbytes / GB, time.perf_counter() - start)

    # ---- the step: a walk of the pipeline over the bucket phases -----------------------------
    def _read_marks(self) -> tuple[int, int, int, float, int]:
        """The engine's counters a step's stats are differences of: disk bytes read, host-cache bytes
        read, disk bytes written, task seconds, bytes read ahead into the host tier."""
        c = self.stager.counters
        return (c.bytes_read - c.cache_bytes_read, c.cache_bytes_read, c.disk_bytes_written,
                c.read_seconds + c.write_seconds, c.fill_bytes_read)

    def fill_host_tier(self) -> int:
        """Read-ahead into the host tier's free space: start reading, on the I/O threads, the buckets the
        tier has room for but holds no image of, in the next step's order. Nothing waits for these
        reads but the step's reads of the same buckets, which then cost a host->device copy instead of
        a disk read. The tier has free space only after a load or set_io dropped its images, and both
        call this (in `miles train` the reads then land during the first rollout's generation): while
        the store runs, a file gets an image at its first write as long as the budget lasts, and keeps
        it. Returns the bytes started."""
        self._check_usable()
        with self._poisons_on_failure("reading ahead into the host tier"):  # a failed read breaks the engine
            started, buckets = self.pipeline.fill_host_tier()
        if started:
            logger.info("host tier: reading %d buckets (%.3f GB) from disk into host RAM ahead of the next step",
                        buckets, started / GB)
        return started

    @torch.no_grad()
    def prefetch(self) -> int:
        """Read-ahead: start reading the next step's first buckets now, while the disk would otherwise
        be idle (call it before forward/backward). Starts up to `depth` reads, skipping buckets that
        need no disk read (still resident from their write-back, or in the host cache); they stay
        resident until the step consumes them (or flush()). Returns the number of reads started."""
        self._check_usable()
        with self._poisons_on_failure("a previous step's write-behind"):
            self.stager.check()
        return self.pipeline.prefetch()

    def flush(self) -> None:
        """Wait until every write-back is in the files, the host tier's dirty images included, and
        release everything the pipeline holds (write-behind and prefetched buckets). Afterwards the
        files hold the state. Saves and loads do this on their own; call it before the files must hold
        the state for someone else, or to measure a step end to end. A trainer going to sleep only needs
        the device back: release_device()."""
        self._check_usable()
        try:
            with self._poisons_on_failure("a previous step's write-behind"):
                self.stager.write_back()
        finally:
            self.pipeline.release_all()

    def release_device(self) -> None:
        """Free every device buffer the pipeline holds, without waiting for the disk: return once each
        read in flight has landed and each write-back has left the device (into its host image, or into
        staging: a bucket without an image still waits for most of its disk write, since staging is
        bounded). Dirty host images stay dirty and staged writes land on the engine's threads while the
        trainer sleeps; the next step, save or flush orders itself after them, and an I/O error among
        them poisons the store at that call. Call it before handing the device memory to someone else."""
        self._check_usable()
        try:
            with self._poisons_on_failure("a previous step's write-behind"):
                self.stager.wait_device()
        finally:
            self.pipeline.release_all()

    def set_io(self, *, io_engine: str | None = None, depth: int | None = None, write_behind: bool | None = None,
               io_threads: int | None = None, direct_io: bool | None = None, host_cache_mb: int | str | None = None,
               verify: bool | None = None) -> None:
        """Switch the I/O configuration between steps, on the same files (benchmarks, A/B runs).
        Flushes first; arguments left None keep their value (store.config holds the current ones).
        verify turned on checks a segment's reads from its next write on (the next step's writes)."""
        self.flush()
        changes = dict(io_engine=io_engine, depth=depth, write_behind=write_behind, io_threads=io_threads,
                       direct_io=direct_io, host_cache_mb=host_cache_mb, verify=verify)
        # a new config, checked when built
        config = dataclasses.replace(self.config, **{k: v for k, v in changes.items() if v is not None})
        depth = self._fit_to_budget(config, self.bucket_numel).depth  # the files fix the bucket size
        # "auto" is sized once; a new value is sized now (an "auto" coming in sees the old tier's images
        # still allocated: it may come out smaller than a fresh store's)
        if config.host_cache_mb != self.config.host_cache_mb:
            self.host_cache_bytes = self._host_cache_bytes(config)
        self.stager.set_engine(config.io_engine, io_threads=config.io_threads, direct_io=config.direct_io,
                               host_cache_bytes=self.host_cache_bytes)
        if config.verify != self.config.verify:
            self.stager.set_verify([b.file for b in self.buckets], config.verify)
        self.config = config
        self.pipeline.configure(depth=depth, write_behind=_write_behind(config))
        self._update_io_stats()
        self.fill_host_tier()  # the new engine starts without images

    @torch.no_grad()
    def step(self) -> StepStats:
        self._check_usable()
        self._check_binding()
        with self._poisons_on_failure("a previous step's write-behind"):
            self.stager.check()
        start = time.perf_counter()
        written0 = self.stager.counters.bytes_written
        try:
            walk = self.pipeline.walk()
            self.stager.check()
        except BaseException as e:
            self._poison(e, f"step {self.stats.steps + 1}")
            self.pipeline.abort()
            raise
        wall = time.perf_counter() - start
        disk0, cache0, disk_written0, task0, fill0 = self._marks
        self._marks = disk1, cache1, disk_written1, task1, fill1 = self._read_marks()
        pending = sum(1 for b in self.buckets if self.stager.writes_in_flight(b.file))
        last = StepStats(bytes_read=walk.read_bytes, bytes_written=self.stager.counters.bytes_written - written0,
                         buckets=len(self.buckets), io_seconds=wall - walk.compute_seconds,
                         io_task_seconds=task1 - task0, compute_seconds=walk.compute_seconds, wall_seconds=wall,
                         disk_bytes_read=disk1 - disk0, cache_bytes_read=cache1 - cache0,
                         disk_bytes_written=disk_written1 - disk_written0, reused_bytes=walk.reused_bytes,
                         prefetched_buckets=walk.prefetched_buckets, pending_writes=pending,
                         peak_resident_bytes=walk.peak_resident_bytes, tier_fill_bytes=fill1 - fill0)
        self.stats.steps += 1
        self.stats.bytes_read += last.bytes_read
        self.stats.bytes_written += last.bytes_written
        self.stats.last_step = last
        moved = (last.bytes_read + last.bytes_written) / GB
        logger.info("optimizer step %d streamed %d buckets: read %.3f GB (disk %.3f, host cache %.3f, still "
                    "resident %.3f), wrote %.3f GB (disk %.3f) in %.2f s (%.2f GB/s; exposed io %.2f s of %.2f s "
                    "busy, compute %.2f s); %d buckets prefetched, %d writes behind; device peak %.3f GB (bound "
                    "%.3f GB, budget %.3f GB)",
                    self.stats.steps, last.buckets, last.bytes_read / GB, last.disk_bytes_read / GB,
                    last.cache_bytes_read / GB, last.reused_bytes / GB, last.bytes_written / GB,
                    last.disk_bytes_written / GB, wall, moved / wall if wall else 0.0, last.io_seconds,
                    last.io_task_seconds, last.compute_seconds, last.prefetched_buckets, pending,
                    last.peak_resident_bytes / GB, self.stats.residency_bound_bytes / GB,
                    self.device_budget_bytes / GB)
        return last

    @torch.no_grad()
    def refresh_main_from_model_params(self) -> None:
        """After the model weights were replaced (checkpoint load): mains <- model params. Allowed on a
        poisoned store (the recovery restores the model weights, refreshes, then calls load_from): the
        failed engine is replaced, what it held is dropped unwritten, and the store stays poisoned until a
        load restores the moments."""
        self._check_open()
        if self.poisoned_by is None:
            self.flush()  # no write-back in flight may land over the refreshed mains; prefetched mains are stale
        else:
            self._recover_io()  # nothing in flight after it, no image: the torn state is not written back
        for bucket in self.buckets if self.streams_main else ():
            bucket.refresh_main(self.stager)

    @property
    def mains_in_host_ram(self) -> bool:
        """Whether this store streams the mains and every bucket lives in host RAM only (no file): reading
        the mains back costs host->device copies and no disk read."""
        return self.streams_main and self.stats.ram_state_bytes == self.stats.state_bytes

    @torch.no_grad()
    def publish_mains(self) -> int:
        """model params <- mains cast to their dtype, bucket by bucket (one in flight): the inverse of
        refresh_main_from_model_params, and what a step's publish wrote. A trainer that dropped its
        low-precision weights at sleep rebuilds them with this at wake, exactly. The reads are not a
        step's: the next step's stats do not count them. Returns the fp32 bytes read."""
        self._check_usable()
        if not self.streams_main:
            return 0
        self.release_device()  # nothing held: each bucket below is read fresh, after its write-back
        disk0, cache0, _, task0, _ = self._read_marks()
        nbytes = 0
        with self._poisons_on_failure("reading the mains back"):
            for bucket in self.buckets:
                bucket.fetch(self.stager, (MAIN,))
                bucket.publish()
                bucket.release()
                nbytes += 4 * bucket.numel
        disk1, cache1, _, task1, _ = self._read_marks()
        m = self._marks  # shift the step's baseline past these reads
        self._marks = (m[0] + disk1 - disk0, m[1] + cache1 - cache0, m[2], m[3] + task1 - task0, m[4])
        return nbytes

    # ---- checkpoints --------------------------------------------------------------------------
    def save_to(self, checkpoint_base: str, wait: bool = True) -> dict | None:
        """Write the state to `<base>/nvme_opt_state/<relative_dir>/` (format: checkpoint/save_load.py), atomically.

        wait=False returns once the state is snapshotted; the files are copied in the background and
        the next step waits only for buckets it overwrites before they are copied. Call
        `wait_for_save()` before treating the checkpoint as complete. Returns the save's stats when waited.
        """
        self._check_usable()
        self._refuse_overlap(checkpoint_base, "save to")
        self.wait_for_save()
        with self._poisons_on_failure("a previous step's write-behind or writing the host images back"):
            self.stager.write_back()  # a torn state must never be published; the copy reads the files
        self._save_job = checkpoint.SaveJob(self, checkpoint_base)
        return self.wait_for_save() if wait else None

    def wait_for_save(self) -> dict | None:
        """Block until the save in flight (if any) is published; raise CheckpointError if it failed."""
        job, self._save_job = self._save_job, None
        if job is None:
            return None
        try:
            self.last_save = job.wait()
        except StateCorruptionError as e:  # verify: the save read a live file changed on disk
            self._poison(e, "a save")
            raise
        logger.info("saved optimizer state to %s: %.3f GB, blocked %.3f s, step stalled %.3f s, published "
                    "after %.2f s", job.final, job.stats["bytes"] / GB, job.stats["blocked_seconds"],
                    job.stats["stalled_seconds"], job.stats["seconds"])
        return self.last_save

    def load_from(self, checkpoint_base: str) -> bool:
        """Restore the state saved by `save_to` (resharding onto this layout when it differs). False:
        the checkpoint has no streamed state (logged; the optimizer starts fresh). Call it after the
        model weights and any `refresh_main_from_model_params()`: it overwrites the mains. The same
        layout resumes bit-identically for every moment_dtype (the rounding noise's generators are
        restored); resharded fp16/fp8 moments are re-quantized once (checkpoint.py).

        On a poisoned store (a step failed part way) this is the recovery: the I/O engine is rebuilt and
        a successful load clears the poison; a checkpoint without streamed state (False) leaves it."""
        self._check_open()
        self._refuse_overlap(checkpoint_base, "load from")
        self.wait_for_save()
        if self.poisoned_by is None:  # an earlier write-behind that failed poisons first; nothing is written back
            with self._poisons_on_failure("a previous step's write-behind"):
                self.stager.wait_all()
        self._recover_io()  # a poisoned store's images are dropped unwritten: its state is torn anyway
        loaded = checkpoint.load(self, checkpoint_base)
        if loaded and self.poisoned_by is not None:
            logger.warning("optimizer-state store %s recovered from %s: the state is the checkpoint's",
                           self.relative_dir, checkpoint_base)
            self.poisoned_by = None
        self._marks = self._read_marks()  # the next step's stats count from here: not the load's own I/O
        if self.poisoned_by is None:
            self.fill_host_tier()  # the load dropped the tier's images
        return loaded

    def _refuse_overlap(self, checkpoint_base: str, what: str) -> None:
        """A checkpoint's streamed folder inside the live directory (or around it) is deleted with the
        live files at close(): refuse it, naming both."""
        streamed = os.path.join(os.path.abspath(checkpoint_base), STREAMED_DIR)
        for a, b in ((streamed, self.path), (os.path.realpath(streamed), os.path.realpath(self.path))):
            if os.path.commonpath([a, b]) in (a, b):
                raise CheckpointError(
                    f"cannot {what} {checkpoint_base}: its streamed state {streamed} overlaps the store's live "
                    f"directory {self.path}, which close() removes; pass a checkpoint directory outside "
                    f"{self.config.dir}")

    # ---- failures -----------------------------------------------------------------------------
    def _poison(self, error: BaseException, during: str) -> None:
        if self.poisoned_by is None:
            self.poisoned_by = error
            logger.error("optimizer-state store %s is poisoned: %s failed part way (%r); its buckets hold a mix "
                         "of two steps until load_from restores a checkpoint", self.relative_dir, during, error)

    @contextlib.contextmanager
    def _poisons_on_failure(self, during: str):
        try:
            yield
        except BaseException as e:
            self._poison(e, during)
            raise

    def _binding(self) -> tuple:
        """What the store was bound to: the master's param groups (by identity) and the storage of the
        params it updates in place (plain Adam). A step over anything else would train nothing."""
        groups = tuple(tuple(id(p) for p in g["params"]) for g in self.master.param_groups)
        storage = tuple((storage_identity(e.main), tuple(e.main.shape)) for e in self.entries if e.model_view is None)
        return groups, storage

    def _check_binding(self) -> None:
        groups, storage = self._binding()
        if groups != self._bound[0]:
            raise StoreConfigError(
                f"the optimizer's param groups changed after the store was bound ({len(self._bound[0])} groups of "
                f"{[len(g) for g in self._bound[0]]} params then, {len(groups)} of {[len(g) for g in groups]} now: "
                "add_param_group or a replaced param list); their params would not be trained. Add every param "
                "group before stream_optimizer_state")
        if storage != self._bound[1]:
            first = next(i for i, (a, b) in enumerate(zip(storage, self._bound[1])) if a != b)
            raise StoreConfigError(
                f"param {first} of the streamed optimizer was given new storage after the store was bound "
                f"(param.data replaced; shape {self._bound[1][first][1]} then, {storage[first][1]} now); the store "
                "updates the storage it was bound to. Copy new values in place (param.data.copy_(...)) instead")

    def _check_usable(self) -> None:
        """Open and not poisoned: raise StorePoisonedError saying how to recover otherwise."""
        self._check_open()
        if self.poisoned_by is not None:
            raise StorePoisonedError(
                f"the optimizer-state store {self.relative_dir} under {self.config.dir} is unusable: a step failed "
                f"part way ({self.poisoned_by!r}), so its buckets hold a mix of two steps and may be neither "
                "stepped nor saved. Recover: restore the model weights and call store.load_from(<last "
                "checkpoint>) (it rebuilds the I/O engine), or restart from the last checkpoint."
            ) from self.poisoned_by

    def _recover_io(self) -> None:
        """On a poisoned store: drop what the pipeline holds and replace the failed I/O engine by a fresh
        one with the same settings (same files, same descriptors)."""
        if self.poisoned_by is None:
            return
        self.pipeline.abort()
        self.stager.set_engine(self.config.io_engine, io_threads=self.config.io_threads,
                               direct_io=self.config.direct_io, host_cache_bytes=self.host_cache_bytes,
                               discard_errors=True)
        self._update_io_stats()

    # ---- lifetime -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the optimizer-state store {self.relative_dir} under {self.config.dir} is closed")

    def close(self) -> None:
        """Close and remove the bucket files, stop the I/O threads. Runs at exit too, and when the store
        is garbage-collected unclosed (without waiting for a save: a save in flight keeps it alive);
        safe to call twice."""
        if self._closed:
            return
        try:  # a checkpoint still copying from the live files finishes first
            self.wait_for_save()
        except Exception:
            logger.exception("a background save of optimizer state failed")
        self._closed = True
        self.pipeline.abort()  # write-behind in flight ends before its files close
        if self._finalizer.detach() is not None:
            self._resources.release()
        LIVE_STORES.discard(self)


def _device_budget_bytes(config: StreamConfig) -> int | None:
    """device_budget_mb in bytes; None: the store's default (footprint.default_device_budget_bytes)."""
    return None if config.device_budget_mb is None else config.device_budget_mb * MiB


def _write_behind(config: StreamConfig) -> bool:
    """Whether the step may return before its write-backs land: never with the sync engine."""
    return config.write_behind and config.io_engine != "sync"


def _refuse_directory_in_a_checkpoint(path: str) -> None:
    """The store empties its directory and close() removes it: one inside a checkpoint would delete
    that checkpoint. Refuse it before anything is touched."""
    found = checkpoint.enclosing_checkpoint(path)
    if found is not None:
        base, why = found
        raise StoreConfigError(
            f"the optimizer-state directory {path} lies inside the checkpoint {base} ({why}); the store empties "
            "its directory and removes it at close, which would delete that checkpoint: choose a store directory "
            "outside every checkpoint (dir=..., --offload-train-disk-dir)")


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
