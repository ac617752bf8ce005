"""The validated configuration of one run: :class:`RunConfig`, what :func:`miles.preflight.validate_args` returns.

One frozen object, the argument groups as frozen dataclasses (field names = flag names), with every
tri-state and environment-dependent default resolved, plus what the run derives from them::

    cfg = validate_args(parse_args(["--tiny-model", "--colocate"]), Environment())
    cfg.training.eps_clip, cfg.offload.offload_train, cfg.paths.rank_dir(0, 1), cfg.model_source

Everything downstream (driver, Ray actors, backends, rollout engines) reads typed fields of this
object; Ray pickles it to the actors (frozen dataclasses pickle as plain values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from miles.config.arguments import (
    GROUP_OF,
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
from miles.parallel.layout import ParallelLayout
from miles_plugins.optimizers.streaming.config import StreamConfig

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
    def trainer_offload(self) -> bool:
        """Trainer offload on: ``--offload-train`` / ``--no-offload-train`` when given, else on under
        ``--colocate`` or with ``--offload-train-target=disk`` (validation's draft has it unresolved; the
        resolved config carries the value this gives)."""
        if self.offload.offload_train is not None:
            return self.offload.offload_train
        return self.cluster.colocate or self.offload.target_is_disk

    @property
    def trainer_offload_to_disk(self) -> bool:
        """Trainer offload is on and puts the trainer's memory on disk (in the rank's directory)."""
        return self.trainer_offload and self.offload.target_is_disk

    @property
    def uses_rank_dirs(self) -> bool:
        """True when a disk mechanism is on, i.e. each train actor needs its ``cell<i>_rank<j>`` directory."""
        return self.trainer_offload_to_disk or self.optimizer.stream_optimizer_state_to_disk


    @property
    def parallel_layout(self) -> ParallelLayout:
        """The ranks' Megatron layout (miles/parallel/layout.py): world = --num-train-ranks, the parallel flags."""
        t = self.training
        return ParallelLayout(world=self.cluster.num_train_ranks, tp=t.tensor_model_parallel_size,
                              pp=t.pipeline_model_parallel_size, ep=t.expert_model_parallel_size,
                              etp=t.expert_tensor_parallel_size,
                              first_stage_layers=t.decoder_first_pipeline_num_layers,
                              last_stage_layers=t.decoder_last_pipeline_num_layers)


def field_value(config: RunConfig, name: str) -> Any:
    """The value of the config field ``name`` (a flag's field name), for rules written over field names."""
    return getattr(getattr(config, GROUP_OF[name]), name)


# The --stream-optimizer-state-* fields that are StreamConfig fields, by StreamConfig field: the one map
# from the flags to the store's settings (validation words a StoreConfigError with it, for the flag).
STORE_FIELD_FLAGS = {"chunk_mb": "stream_optimizer_state_chunk_mb",
                     "moment_dtype": "stream_optimizer_state_moment_dtype",
                     "bucket_numel": "stream_optimizer_state_bucket_numel",
                     "device_budget_mb": "stream_optimizer_state_device_budget_mb",
                     "host_cache_mb": "stream_optimizer_state_host_cache_mb",
                     "verify": "stream_optimizer_state_verify"}


def store_config(config: RunConfig, rank: int, ranks_on_node: int, directory: Optional[str] = None) -> StreamConfig:
    """The store's :class:`StreamConfig` for train rank ``rank`` (the store's own defaults for the rest);
    building it checks it by the store's rules (StoreConfigError). Flags not given (None) leave the choice
    to the store: the bucket size and depth it fits to the device budget, the budget one default bucket's
    worth. ``directory``: the store's ``dir``, by default ``config.paths.optimizer_state``.

    A host tier of "auto" is shared by the ranks of a node: ``ranks_on_node``, the train ranks the actor
    factory placed on this rank's node (rank_nodes of the placement group). No rank reserve: streaming requires
    --offload-train-target=disk (validation), so a sleeping trainer keeps no cpu backup in host RAM (its
    disk offload stages through chunk buffers, which the node reserve covers). No run reserve either: the
    colocated rollout engines keep no host copy of their weights while released (the loop pushes new ones)."""
    opt = config.optimizer
    settings = {store_field: getattr(opt, name) for store_field, name in STORE_FIELD_FLAGS.items()}
    return StreamConfig(dir=directory or config.paths.optimizer_state, host_cache_ranks_per_node=ranks_on_node,
                        rank=rank, **settings)
