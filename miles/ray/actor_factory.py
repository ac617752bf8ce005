"""The actor factory: one train actor per rank, each with its own environment, plus the rollout engines.

Every train actor gets a ``runtime_env`` of its own (:func:`miles.ray.layout.rank_env`): its
``cell<i>_rank<j>`` directory (``MILES_RANK_DIR`` = ``TMS_DISK_BACKUP_DIR``) and, on GPU with trainer
offload, torch_memory_saver's ``LD_PRELOAD`` hook and ``TMS_INIT_*`` variables. The actor wipes its
directory when it starts and removes it when it exits; the driver removes any left behind by an actor
that died (:func:`remove_rank_dirs`).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from . import layout
from .train_actor import FAULT_ENV, TrainActor

logger = logging.getLogger(__name__)

_FORWARDED_ENV = (FAULT_ENV, "MILES_CACHE_DIR", "HF_HOME", "TRANSFORMERS_OFFLINE", "HF_HUB_OFFLINE")


def _project_root() -> str:
    import miles

    return os.path.dirname(os.path.dirname(os.path.abspath(miles.__file__)))


def base_env() -> dict[str, str]:
    """What every actor needs besides its rank's variables: the project on PYTHONPATH, and the few
    driver variables that matter in actors (model cache, test fault injection)."""
    root = _project_root()
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": root + (os.pathsep + path if path else ""), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in _FORWARDED_ENV:
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def make_train_actors(args: Any, pg, use_gpu: bool, cell: int = 0) -> list:
    n = layout.num_train_ranks(args)
    tms = layout.tms_preload_library() if use_gpu and layout.offload_enabled(args) else None
    if use_gpu and layout.offload_enabled(args) and tms is None:
        logger.warning("torch_memory_saver is not installed: GPU trainer offload falls back to the storage "
                       "offloader (pip install 'miles[gpu]' for torch_memory_saver)")
    res = layout.train_actor_resources(args, use_gpu)
    remote_cls = ray.remote(TrainActor)
    actors = []
    for rank in range(n):
        env = {**base_env(), **layout.rank_env(args, cell, rank, use_gpu=use_gpu, tms_library=tms)}
        actor = remote_cls.options(
            num_cpus=res["num_cpus"], num_gpus=res["num_gpus"], max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank),
            runtime_env={"env_vars": env},
        ).remote(args, cell, rank, n)
        actors.append(actor)
    if layout.uses_rank_dirs(args):
        logger.info("train ranks: per-rank directories %s (wiped at start, removed at exit)",
                    ", ".join(rank_dirs(args, cell)))
    return actors


def rank_dirs(args: Any, cell: int = 0) -> list[str]:
    if not layout.uses_rank_dirs(args):
        return []
    return [layout.rank_dir(args, cell, r) for r in range(layout.num_train_ranks(args))]


def remove_rank_dirs(args: Any, cell: int = 0) -> list[str]:
    """Driver-side backstop: remove what an actor could not (it crashed or was killed): its per-rank
    directory and its streamed-state directory, then the empty parents. Returns what was removed."""
    removed = []
    targets = list(rank_dirs(args, cell))
    if getattr(args, "stream_optimizer_state_to_disk", False):
        targets += [os.path.join(layout.optimizer_state_root(args), f"rank{r:05d}")
                    for r in range(layout.num_train_ranks(args))]
    rollout_root = getattr(args, "rollout_offload_dir", None)
    if rollout_root:  # the embedded engines' release_memory backups (an engine that died keeps its file)
        targets += [os.path.join(rollout_root, f"engine{i}") for i in range(layout.num_rollout_engines(args))]
    for d in targets:
        if os.path.exists(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    # empty mechanism folders, then the root if this run chose it (validate_args' default root)
    parents = [layout.trainer_root(args), layout.optimizer_state_root(args)] + ([rollout_root] if rollout_root else [])
    if getattr(args, "offload_train_disk_dir_is_default", False):
        parents.append(layout.offload_root(args))
    for p in parents:
        try:
            os.rmdir(p)  # only if empty
        except OSError:
            pass
    return removed


def make_rollout_engines(args: Any, pg, use_gpu: bool, engine_cls) -> list:
    """One actor per rollout engine; with --colocate engine i shares train rank i's bundle."""
    res = layout.rollout_engine_resources(args, use_gpu)
    remote_cls = ray.remote(engine_cls)
    engines = []
    for i in range(layout.num_rollout_engines(args)):
        env = {**base_env(), "MILES_ENGINE": str(i), "OMP_NUM_THREADS": str(max(1, int(layout.cpus_per_rank(args))))}
        engines.append(remote_cls.options(
            num_cpus=res["num_cpus"], num_gpus=res["num_gpus"], max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=layout.rollout_engine_placement(args, i)),
            runtime_env={"env_vars": env},
        ).remote(args, i))
    return engines
