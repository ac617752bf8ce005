"""The training-backend interface: what one train actor (one data-parallel rank) drives.

Every backend implements :class:`TrainBackend`; :data:`BACKENDS` names them by ``--train-backend``
value as ``"module:Class"`` strings, so choosing a backend imports nothing until an actor builds it
(megatron-core, for one, imports only on GPU machines that have it).

Lifecycle, as :class:`miles.ray.train_actor.TrainActor` calls it::

    trainer = Backend(config, rank=r, world_size=n, cell=c, rank_dir=d)   # cheap: nothing loaded yet
    info = trainer.init("127.0.0.1:29500")      # process group at host:port, model, optimizer, store, offloader
    metrics = trainer.train(rollout_id, samples, advantages)              # one optimizer step
    trainer.join_weight_group(spec)             # the source of the weight-update group (engines elsewhere)
    stats = trainer.push_weights(ipc_engines, group_engines)   # weights to the engines, by reference
    trainer.save(base, wait); trainer.finish_save(); trainer.load(base, load_optimizer)
    trainer.sleep(); trainer.wake()             # idempotent; dicts of offload stats
    trainer.shutdown()                          # closes files, removes rank_dir; idempotent

The rank directory is held under a :class:`~miles_plugins.optimizers.streaming.io.ownership.DirectoryLock`
from init to shutdown (:meth:`TrainBackend.claim_rank_dir` / :meth:`TrainBackend.release_rank_dir`),
so two actors, or two runs, never write into one; shutdown removes it only if this run made it.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import logging
import time
from typing import Any, Iterator, Optional

from miles.config import RunConfig
from miles_plugins.optimizers.streaming.io.ownership import DirectoryLock, claim_directory, remove_created

logger = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {
    "torch": "miles.backends.torch_backend.trainer:TorchTrainer",
    "megatron": "miles.backends.megatron_backend.trainer:MegatronTrainer",
}


def resolve_backend(spec: str) -> type["TrainBackend"]:
    """The class named by a ``"module:Class"`` spec (a value of :data:`BACKENDS`), imported now."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"backend spec {spec!r} is not of the form 'module:Class'")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, TrainBackend)):
        raise TypeError(f"backend spec {spec!r} names {cls!r}, which does not implement miles.backends.base.TrainBackend")
    return cls


def offload_stats(stats) -> dict[str, Any]:
    """An :class:`~miles.offload.OffloadStats` as the plain dict sleep/wake return."""
    return {"action": stats.action, "target": stats.target, "skipped": stats.skipped, "storages": stats.storages,
            "bytes": stats.bytes, "seconds": stats.seconds, "path": stats.path}


def stream_step_metrics(stores: list) -> dict[str, Any]:
    """The last optimizer step's streamed I/O over a rank's stores (one for the torch backend, one per
    chained optimizer for megatron): the ``stream_*`` metrics of a train step."""
    steps = [s.stats.last_step for s in stores]
    return {"stream_bytes_read": sum(int(t.bytes_read) for t in steps),
            "stream_bytes_written": sum(int(t.bytes_written) for t in steps),
            # of those, what the disk moved (the rest: the host tier or still resident), and what was read
            # ahead into the host tier since the previous step (after a load)
            "stream_disk_bytes_read": sum(int(t.disk_bytes_read) for t in steps),
            "stream_disk_bytes_written": sum(int(t.disk_bytes_written) for t in steps),
            "stream_tier_fill_bytes": sum(int(t.tier_fill_bytes) for t in steps),
            "stream_seconds": sum(float(t.wall_seconds) for t in steps),
            "stream_io_seconds": sum(float(t.io_seconds) for t in steps),
            "stream_buckets": sum(int(t.buckets) for t in steps),
            "stream_prefetched_buckets": sum(int(t.prefetched_buckets) for t in steps),
            "stream_peak_resident_bytes": max(int(s.stats.peak_resident_bytes) for s in stores)}


def settle_store_for_sleep(store, flush: bool) -> dict[str, Any]:
    """Before the trainer sleeps: the streamed state's store gives back every device buffer it holds.
    ``flush`` (--stream-optimizer-state-flush-at-sleep) also waits until every write-back is on disk;
    otherwise the disk writes land while the rollout engine generates (the store's files live apart from
    the offload's, so sleep does not need them settled) and the next step waits for what is left.
    Returns the seconds the sleep waited, for the per-rollout exposed I/O."""
    if store is None:
        return {}
    start = time.perf_counter()
    if flush:
        store.flush()
    else:
        store.release_device()
    return {"store_wait_seconds": time.perf_counter() - start}


class TrainBackend(abc.ABC):
    """One data-parallel rank of a training backend.

    ``config``: the run's :class:`~miles.config.RunConfig`. ``rank``/``world_size``: this rank among the
    train actors of cell ``cell``. ``rank_dir``: this rank's private directory (``cell<i>_rank<j>``;
    None when no disk mechanism is on); the backend claims it at init (:meth:`claim_rank_dir`) and
    releases it at shutdown (:meth:`release_rank_dir`).
    """

    def __init__(self, config: RunConfig, *, rank: int, world_size: int, cell: int = 0,
                 rank_dir: Optional[str] = None, ranks_on_node: Optional[int] = None):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        # train ranks of this run on this rank's node (they share its host RAM); None: all of them
        self.ranks_on_node = ranks_on_node or world_size
        self.cell = cell
        self.rank_dir = rank_dir
        self.rank_dir_lock: Optional[DirectoryLock] = None
        self.store = None  # the optimizer-state store when streaming (anything with close())
        self.offloader = None  # the sleep/wake offloader when --offload-train (miles.offload)
        self.weight_group = None  # the weight-update group, when this rank is its source
        self.closed = False

    @contextlib.contextmanager
    def awake(self):
        """Wake for the block if asleep (export, save and load need the weights), then sleep again."""
        was_asleep = self.offloader is not None and self.offloader.asleep
        if was_asleep:
            self.wake()
        try:
            yield
        finally:
            if was_asleep:
                self.sleep()

    def close_resources(self) -> bool:
        """Close the store and the offloader once; False when already closed (shutdown is idempotent).
        A store that fails to close is logged, so the rest of the teardown still runs."""
        if self.closed:
            return False
        self.closed = True
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                logger.exception("closing the optimizer-state store failed")
        if self.offloader is not None:
            self.offloader.close()
        if self.weight_group is not None:
            self.weight_group.destroy()
        return True

    def claim_rank_dir(self) -> None:
        """Make the rank directory if missing (marked as this run's) and lock it for this process.

        A directory that already exists is used as it is, not wiped: it was not made by this run, so
        whatever is in it is someone else's (a second run on the same root is refused by the lock)."""
        if not self.rank_dir:
            return
        self.rank_dir_lock = claim_directory(self.rank_dir, self.config.run_id, f"rank {self.rank} directory")
        logger.info("rank %d: per-rank directory %s locked (removed at exit if this run made it)", self.rank,
                    self.rank_dir)

    def release_rank_dir(self) -> None:
        """Remove the rank directory if this run made it, then drop the lock (idempotent; also at exit)."""
        if self.rank_dir_lock is None or not self.rank_dir_lock.held:
            return
        left = remove_created(self.rank_dir, self.config.run_id)
        self.rank_dir_lock.release()
        if left:
            logger.info("rank %d: per-rank directory left in place: %s", self.rank, left)
        else:
            logger.info("rank %d: removed per-rank directory %s", self.rank, self.rank_dir)

    @abc.abstractmethod
    def init(self, rendezvous: str) -> dict[str, Any]:
        """Join the process group at ``tcp://<rendezvous>`` (``host:port`` on rank 0's node), build model
        and optimizer; returns :meth:`info`."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """What this rank runs: rank, pid, device, dtype, num_params, description, offloader, store info."""

    @abc.abstractmethod
    def train(self, rollout_id: int, samples: list, advantages: list[float]) -> dict[str, Any]:
        """One optimizer step over this rank's share of a rollout; returns the step's metrics."""

    @abc.abstractmethod
    def hf_weights(self) -> Iterator[tuple[str, Any]]:
        """The full weights as ``(HF-layout name, tensor on this rank's device)`` pairs (what the rollout
        engine's model expects), converted lazily; a collective when the backend shards weights over ranks
        (expert parallelism), so every rank iterates it. The trainer must be awake."""

    def export_weights(self) -> dict[str, Any]:
        """A host copy of :meth:`hf_weights` (checks and tests; the RL loop hands weights over by reference)."""
        with self.awake():
            return {name: t.detach().to("cpu", copy=True) for name, t in self.hf_weights()}

    def join_weight_group(self, spec: dict[str, Any]) -> None:
        """Join the weight-update group as its source, rank 0 (``spec``: ``master_address``, ``master_port``,
        ``world_size``, ``backend``), while the engines join it at ranks 1..n."""
        from miles.ray.weight_sync import GROUP_NAME
        from miles.weights import WeightUpdateGroup

        self.weight_group = WeightUpdateGroup(rank=0, group_name=GROUP_NAME, **spec)

    def push_weights(self, ipc_engines: list, group_engines: list) -> dict[str, Any]:
        """Hand the weights to the rollout engines (:func:`miles.ray.weight_sync.push_weights`): by
        reference to ``ipc_engines``, by broadcast over the weight-update group to ``group_engines``.
        Every rank calls it (see :meth:`hf_weights`); an engine's session is opened and closed by the driver."""
        from miles.ray.weight_sync import push_weights

        mb = self.config.rollout.weight_sync_bucket_mb
        with self.awake():
            stats = push_weights(self.hf_weights(), ipc_engines=ipc_engines, group=self.weight_group,
                                 group_engines=group_engines, max_bucket_bytes=mb * 2**20)
        return {"rank": self.rank, **stats}

    @abc.abstractmethod
    def save(self, base: str, wait: bool = True) -> dict[str, Any]:
        """Write this rank's part of the checkpoint under ``base``; with ``wait=False`` the streamed
        optimizer state may still be copying until :meth:`finish_save`."""

    @abc.abstractmethod
    def finish_save(self) -> Optional[dict[str, Any]]:
        """Wait for a background save started by ``save(base, wait=False)``."""

    @abc.abstractmethod
    def load(self, base: str, load_optimizer: bool) -> dict[str, Any]:
        """Load this rank's part of the checkpoint at ``base`` (weights; the optimizer state if asked)."""

    @abc.abstractmethod
    def sleep(self) -> dict[str, Any]:
        """Step aside for the rollout engine: offload weights, grads, optimizer state (idempotent)."""

    @abc.abstractmethod
    def wake(self) -> dict[str, Any]:
        """Undo :meth:`sleep`, bit-exactly (idempotent)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Close files, leave the process group, remove ``rank_dir`` (idempotent)."""
