"""The validated configuration of one run: :class:`RunConfig`, what ``validate_args`` returns.

One frozen object, the argument groups as frozen dataclasses (field names = flag names), with every
tri-state and environment-dependent default resolved, plus what the run derives from them::

    cfg = validate_args(parse_args(["--tiny-model", "--colocate"]), Environment())
    cfg.training.eps_clip, cfg.offload.offload_train, cfg.paths.rank_dir(0, 1), cfg.model_source

Everything downstream (driver, Ray actors, backends, rollout engines) reads typed fields of this
object; Ray pickles it to the actors (frozen dataclasses pickle as plain values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from miles.config.arguments import (
    CheckpointConfig,
    ClusterConfig,
    LoggingConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    RolloutConfig,
    TrainingConfig,
)
from miles.config.paths import RunPaths

MODEL_SOURCES = ("hf_checkpoint", "smollm2", "tiny")


@dataclass(frozen=True)
class RunConfig:
    """All groups of ``miles train``, resolved.

    ``model_source``: what ``miles.models.load_policy`` loads (one of :data:`MODEL_SOURCES`).
    ``paths``: the run's directory tree (:class:`miles.config.paths.RunPaths`).
    ``ray_address``: the cluster the run joins (``RAY_ADDRESS``, which may span several nodes), or None:
    the run starts its own single-node Ray.
    ``run_id``: names this run in the ownership records of the directories it locks and makes
    (``<YYYYmmdd-HHMMSS>-<pid>`` of the driver, the same id as the default root's and run dir's name).
    ``creates``: the output directories that did not exist when validated, which the run creates, each as
    its flag names it (``--save /x/ckpt``); ``miles.train.run`` logs them.
    """

    cluster: ClusterConfig
    model: ModelConfig
    rollout: RolloutConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    offload: OffloadConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    paths: RunPaths
    model_source: str
    run_id: str
    ray_address: Optional[str]
    creates: tuple[str, ...]

    @property
    def uses_rank_dirs(self) -> bool:
        """True when a disk mechanism is on, i.e. each train actor needs its ``cell<i>_rank<j>`` directory."""
        disk_offload = self.offload.offload_train and self.offload.offload_train_target == "disk"
        return disk_offload or self.optimizer.stream_optimizer_state_to_disk
