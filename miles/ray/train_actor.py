"""The train actor: one per data-parallel rank, a thin Ray-facing shell around the backend trainer.

Started by :mod:`miles.ray.actor_factory` with its own environment (``MILES_RANK_DIR`` /
``TMS_DISK_BACKUP_DIR`` = its ``cell<i>_rank<j>`` directory, torch_memory_saver variables on GPU).
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any, Optional

logger = logging.getLogger("miles.train_actor")

FAULT_ENV = "MILES_FAULT_INJECT"  # tests: "<method>:<rank>:<rollout_id>" raises inside that call


def configure_logging(level: str = "INFO") -> None:
    root = logging.getLogger()
    if not any(getattr(h, "_miles", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._miles = True
        root.addHandler(handler)
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))


class TrainActor:
    def __init__(self, args: Any, cell: int, rank: int, world_size: int):
        configure_logging(getattr(args, "log_level", "INFO"))
        self.args = args
        self.cell, self.rank, self.world_size = cell, rank, world_size
        self.rank_dir: Optional[str] = os.environ.get("MILES_RANK_DIR") or None
        self.trainer = None
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:  # the process goes away without shutdown(): still reclaim the disk
        from miles.backends.torch_backend.trainer import remove_rank_dir

        remove_rank_dir(self.rank_dir, self.rank)

    def _maybe_fail(self, method: str, rollout_id: Optional[int] = None) -> None:
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return
        name, rank, rid = (spec.split(":") + ["", "", ""])[:3]
        if name == method and int(rank) == self.rank and (rid in ("", "*") or int(rid) == rollout_id):
            raise RuntimeError(f"injected fault ({FAULT_ENV}={spec}) in {method} on rank {self.rank}")

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rank": self.rank, "cell": self.cell, "rank_dir": self.rank_dir,
                "env": {k: v for k, v in os.environ.items() if k.startswith(("TMS_", "MILES_")) or k == "LD_PRELOAD"}}

    def init(self, master_port: int) -> dict[str, Any]:
        backend = getattr(self.args, "train_backend", "torch")
        if backend != "torch":
            raise NotImplementedError(f"--train-backend {backend} is not available in this build; use --train-backend torch")
        from miles.backends.torch_backend.trainer import TorchTrainer

        self.trainer = TorchTrainer(self.args, rank=self.rank, world_size=self.world_size, cell=self.cell,
                                    rank_dir=self.rank_dir)
        self._maybe_fail("init")
        return self.trainer.init(master_port)

    def train(self, rollout_id: int, samples: list, advantages: list) -> dict[str, Any]:
        self._maybe_fail("train", rollout_id)
        return self.trainer.train(rollout_id, samples, advantages)

    def export_weights(self):
        return self.trainer.export_weights()

    def save(self, base: str, wait: bool = True) -> dict[str, Any]:
        return self.trainer.save(base, wait)

    def finish_save(self):
        return self.trainer.finish_save()

    def load(self, base: str, load_optimizer: bool) -> dict[str, Any]:
        return self.trainer.load(base, load_optimizer)

    def sleep(self) -> dict[str, Any]:
        return self.trainer.sleep()

    def wake(self) -> dict[str, Any]:
        return self.trainer.wake()

    def shutdown(self) -> bool:
        if self.trainer is not None:
            self.trainer.shutdown()
        else:
            self._at_exit()
        return True
