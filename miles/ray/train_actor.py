"""The train actor: one per data-parallel rank, a thin Ray-facing shell around the backend trainer.

Started by :mod:`miles.ray.actor_factory` with its own environment (``TMS_DISK_BACKUP_DIR`` and the
torch_memory_saver variables on GPU) and its ``cell<i>_rank<j>`` directory as a constructor argument.
``backend`` is a ``"module:Class"`` spec (a value of :data:`miles.config.backends.BACKENDS`) imported
only in :meth:`init`, inside the actor. Every method the driver calls returns its log lines with its
result (:mod:`miles.ray.actor_logs`).
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Optional

from miles.config import RunConfig
from miles.logging_setup import configure_logging

from .actor_logs import ActorLogs, reports_logs


def node_id() -> str:
    """The Ray node this process runs on (the run's summary shows where each rank and engine ran)."""
    import ray

    return ray.get_runtime_context().get_node_id()


class TrainActor:
    def __init__(self, config: RunConfig, cell: int, rank: int, world_size: int, *, backend: str,
                 rank_dir: Optional[str] = None, ranks_on_node: Optional[int] = None):
        configure_logging(config.logging.log_level)
        self.logs = ActorLogs(f"rank {rank}" if cell == 0 else f"cell{cell} rank {rank}")
        self.config = config
        self.cell, self.rank, self.world_size = cell, rank, world_size
        self.backend = backend
        self.rank_dir = rank_dir
        self.ranks_on_node = ranks_on_node
        self.trainer = None
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:  # the process goes away without shutdown(): still reclaim the disk
        if self.trainer is not None:
            self.trainer.release_rank_dir()

    @reports_logs
    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": node_id(), "rank": self.rank, "cell": self.cell, "rank_dir": self.rank_dir,
                "env": {k: v for k, v in os.environ.items() if k.startswith(("TMS_", "MILES_")) or k == "LD_PRELOAD"}}

    @reports_logs
    def rendezvous(self) -> str:
        """``host:port`` for the process group, on this actor's node: its address as Ray knows it and a
        port that is free there now (rank 0 listens on it)."""
        import ray

        from miles.weights.group import free_port

        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    @reports_logs
    def init(self, rendezvous: str) -> dict[str, Any]:
        from miles.backends.rank import resolve_backend

        cls = resolve_backend(self.backend)
        self.trainer = cls(self.config, rank=self.rank, world_size=self.world_size, cell=self.cell,
                           rank_dir=self.rank_dir, ranks_on_node=self.ranks_on_node)
        return {**self.trainer.init(rendezvous), "node_id": node_id(), "ranks_on_node": self.ranks_on_node}

    @reports_logs
    def train(self, rollout_id: int, samples: list, advantages: list) -> dict[str, Any]:
        return self.trainer.train(rollout_id, samples, advantages)

    @reports_logs
    def join_weight_group(self, spec: dict[str, Any]) -> None:
        self.trainer.join_weight_group(spec)

    @reports_logs
    def join_payload_groups(self, groups: list) -> None:
        self.trainer.join_payload_groups(groups)

    @reports_logs
    def push_weights(self, ipc_engines: list, group_engines: list, payload: str, tp_size: int,
                     peers=None) -> dict[str, Any]:
        return self.trainer.push_weights(ipc_engines, group_engines, payload, tp_size, peers)

    @reports_logs
    def save(self, base: str, wait: bool = True) -> dict[str, Any]:
        return self.trainer.save(base, wait)

    @reports_logs
    def finish_save(self):
        return self.trainer.finish_save()

    @reports_logs
    def load(self, base: str, load_optimizer: bool) -> dict[str, Any]:
        return self.trainer.load(base, load_optimizer)

    @reports_logs
    def sleep(self, engine=None) -> dict[str, Any]:
        return self.trainer.sleep(engine)

    @reports_logs
    def wake(self, engine_weights=None) -> dict[str, Any]:
        return self.trainer.wake(engine_weights)

    @reports_logs
    def shutdown(self) -> bool:
        if self.trainer is not None:
            self.trainer.shutdown()
        return True
