"""The actor factory: one train actor per rank, each with its own environment, plus the rollout engines.

Every train actor gets a ``runtime_env`` of its own (:func:`miles.ray.layout.rank_env`: on GPU with
trainer offload, torch_memory_saver's ``LD_PRELOAD`` hook and ``TMS_*`` variables) and its
``cell<i>_rank<j>`` directory as a constructor argument. The actor makes and locks its directory when
it starts and removes it when it exits, if this run made it; the driver's backstop
(``miles.run_lifecycle``) removes what an actor that died left, and only what this run made.
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.backends.sleep_mode import OFFLOAD_ALL, sleep_mode
from miles.config import RunConfig
from miles.config.backends import BACKENDS

from . import layout, placement_group
from .train_actor import TrainActor

logger = logging.getLogger(__name__)

_FORWARDED_ENV = ("MILES_CACHE_DIR", "HF_HOME", "TRANSFORMERS_OFFLINE", "HF_HUB_OFFLINE")


def _project_root() -> str:
    import miles

    return os.path.dirname(os.path.dirname(os.path.abspath(miles.__file__)))


def base_env() -> dict[str, str]:
    """What every actor needs besides its rank's variables: the project (and the driver's PYTHONPATH)
    on PYTHONPATH, and the few driver variables that matter in actors (model cache, offline mode)."""
    root = _project_root()
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": root + (os.pathsep + path if path else ""), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in _FORWARDED_ENV:
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def make_train_actors(cfg: RunConfig, pg, use_gpu: bool, cell: int = 0) -> list:
    n = cfg.cluster.num_train_ranks
    # torch_memory_saver pauses the whole process at sleep: what --offload-train-plan offload-all does; the
    # sleep plan moves tensors one by one (miles.offload.planned) and needs no hook
    pauses = use_gpu and sleep_mode(cfg) == OFFLOAD_ALL
    tms = layout.tms_preload_library() if pauses else None
    if pauses and tms is None:
        logger.warning("torch_memory_saver is not installed: GPU trainer offload falls back to the storage "
                       "offloader (pip install 'miles[gpu]' for torch_memory_saver)")
    res = layout.train_actor_resources(cfg, use_gpu)
    backend = BACKENDS[cfg.training.train_backend]  # resolved here so the actor imports what the driver chose
    remote_cls = ray.remote(TrainActor)
    bundles = placement_group.rank_bundles(pg, n)
    nodes = placement_group.bundle_nodes(pg)
    single_node = len(set(nodes)) == 1
    rank_nodes = [nodes[b] for b in bundles]
    actors = []
    for rank in range(n):
        env = {**base_env(), **layout.rank_env(cfg, cell, rank, use_gpu=use_gpu, tms_library=tms,
                                                single_node=single_node)}
        actor = remote_cls.options(
            num_cpus=res["num_cpus"], num_gpus=res["num_gpus"], max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                 placement_group_bundle_index=bundles[rank]),
            runtime_env={"env_vars": env},
        ).remote(cfg, cell, rank, n, backend=backend, rank_dir=layout.rank_dir(cfg, cell, rank),
                 ranks_on_node=rank_nodes.count(rank_nodes[rank]))
        actors.append(actor)
    if cfg.uses_rank_dirs:
        logger.info("train ranks: per-rank directories %s (locked while in use, removed at exit if this run "
                    "made them)",
                    ", ".join(rank_dirs(cfg, cell)))
    return actors


def rank_dirs(cfg: RunConfig, cell: int = 0) -> list[str]:
    if not cfg.uses_rank_dirs:
        return []
    return [cfg.paths.rank_dir(cell, r) for r in range(cfg.cluster.num_train_ranks)]


def make_rollout_engines(cfg: RunConfig, pg, use_gpu: bool, engine_cls) -> list:
    """One actor per rollout engine; with --colocate an engine shares a train rank's bundle
    (``layout.colocated_rank``: spread over the ranks, and so over the nodes)."""
    res = layout.rollout_engine_resources(cfg, use_gpu)
    bundles = placement_group.rank_bundles(pg, cfg.cluster.num_train_ranks)
    remote_cls = ray.remote(engine_cls)
    engines = []
    for i in range(cfg.cluster.num_rollout_engines):
        env = {**base_env(), "OMP_NUM_THREADS": str(cfg.cluster.num_cpus_per_rank)}
        engines.append(remote_cls.options(
            num_cpus=res["num_cpus"], num_gpus=res["num_gpus"], max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=layout.rollout_engine_placement(cfg, i, bundles)),
            runtime_env={"env_vars": env},
        ).remote(cfg, i))
    return engines
