"""The training-backend interface: what one train actor (one data-parallel rank) drives.

Every backend implements :class:`TrainBackend`; :data:`BACKENDS` names them by ``--train-backend``
value as ``"module:Class"`` strings, so choosing a backend imports nothing until an actor builds it
(megatron-core, for one, imports only on GPU machines that have it).

Lifecycle, as :class:`miles.ray.train_actor.TrainActor` calls it::

    trainer = Backend(config, rank=r, world_size=n, cell=c, rank_dir=d)   # cheap: nothing loaded yet
    info = trainer.init(master_port)            # process group, model, optimizer, store, offloader
    metrics = trainer.train(rollout_id, samples, advantages)              # one optimizer step
    weights = trainer.export_weights()          # {HF-layout name: host tensor} for the rollout engines
    trainer.save(base, wait); trainer.finish_save(); trainer.load(base, load_optimizer)
    trainer.sleep(); trainer.wake()             # idempotent; dicts of offload stats
    trainer.shutdown()                          # closes files, removes rank_dir; idempotent
"""

from __future__ import annotations

import abc
import importlib
import logging
import os
import shutil
from typing import Any, Optional

from miles.config import RunConfig

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


def remove_rank_dir(rank_dir: Optional[str], rank: int) -> bool:
    """Remove a rank's private directory (at shutdown, or at process exit as a backstop)."""
    if not rank_dir or not os.path.exists(rank_dir):
        return False
    shutil.rmtree(rank_dir, ignore_errors=True)
    logger.info("rank %d: removed per-rank directory %s", rank, rank_dir)
    return True


class TrainBackend(abc.ABC):
    """One data-parallel rank of a training backend.

    ``config``: the run's :class:`~miles.config.RunConfig`. ``rank``/``world_size``: this rank among the
    train actors of cell ``cell``. ``rank_dir``: this rank's private directory (``cell<i>_rank<j>``;
    None when no disk mechanism is on); the backend wipes it at init and removes it at shutdown.
    """

    def __init__(self, config: RunConfig, *, rank: int, world_size: int, cell: int = 0,
                 rank_dir: Optional[str] = None):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.cell = cell
        self.rank_dir = rank_dir

    @abc.abstractmethod
    def init(self, master_port: int) -> dict[str, Any]:
        """Join the process group at ``127.0.0.1:master_port``, build model and optimizer; returns :meth:`info`."""

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """What this rank runs: rank, pid, device, dtype, num_params, description, offloader, store info."""

    @abc.abstractmethod
    def train(self, rollout_id: int, samples: list, advantages: list[float]) -> dict[str, Any]:
        """One optimizer step over this rank's share of a rollout; returns the step's metrics."""

    @abc.abstractmethod
    def export_weights(self) -> dict[str, Any]:
        """The full weights on the host, HF-layout names (what the rollout engine's model expects)."""

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
