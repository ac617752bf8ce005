"""Pure helpers for the Ray layout: per-actor environments, bundle specs and which rank sits on which
bundle (and so on which node), from the :class:`RunConfig`.

Nothing here imports Ray or torch, so all of it is unit-tested without a cluster. The directories
themselves come from ``cfg.paths`` (:class:`miles.config.paths.RunPaths`); each train actor receives
its ``cell<i>_rank<j>`` directory as a constructor argument.
"""

from __future__ import annotations

import glob
import os
from typing import Optional, Sequence

from miles.config import RunConfig
from miles_plugins.optimizers.streaming.config import HOST_CACHE_AUTO

# Train actor vs. rollout engine share of one bundle when they are colocated. They never run at the
# same time (one sleeps while the other works), so the split only has to let both fit.
COLOCATED_TRAIN_SHARE = 0.75
COLOCATED_ROLLOUT_SHARE = 0.25


def rank_dir(cfg: RunConfig, cell: int, rank: int) -> Optional[str]:
    """The train actor's private directory, or None when no disk mechanism needs one."""
    return cfg.paths.rank_dir(cell, rank) if cfg.uses_rank_dirs else None


def tms_preload_library() -> Optional[str]:
    """Path of torch_memory_saver's LD_PRELOAD hook, or None when the package (or a GPU torch) is missing."""
    try:
        import torch_memory_saver  # noqa: F401
    except Exception:  # not installed, or it failed to import (no CUDA runtime)
        return None
    try:
        from torch_memory_saver.utils import get_binary_path_from_package

        return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    except Exception:
        pass
    package_dir = os.path.dirname(os.path.abspath(torch_memory_saver.__file__))
    for base in (package_dir, os.path.dirname(package_dir)):
        found = sorted(glob.glob(os.path.join(base, "torch_memory_saver_hook_mode_preload*.so")))
        if found:
            return found[0]
    return None


def rank_env(cfg: RunConfig, cell: int, rank: int, *, use_gpu: bool,
             tms_library: Optional[str] = None, single_node: bool = True) -> dict[str, str]:
    """Environment variables of one train actor (passed through Ray's ``runtime_env.env_vars``).

    Always: ``OMP_NUM_THREADS`` (the actor gets its cell and rank as constructor arguments); when every rank is on one node, gloo and
    NCCL kept on loopback (across nodes they use the interfaces the node's environment names, e.g.
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set before ``ray start``). With a disk
    mechanism on: ``TMS_DISK_BACKUP_DIR`` = the rank's directory (torch_memory_saver reads it from the
    environment). On GPU with trainer offload and torch_memory_saver available: ``LD_PRELOAD`` of its
    hook, ``TMS_INIT_ENABLE=1`` and either ``TMS_INIT_ENABLE_DISK_BACKUP=1`` + ``TMS_DISK_BACKUP_CHUNK_MB``
    (target disk) or ``TMS_INIT_ENABLE_CPU_BACKUP=1`` (target cpu).
    """
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(cfg.cluster.num_cpus_per_rank),
    }
    if single_node:  # the collectives' traffic never leaves the machine
        env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    directory = rank_dir(cfg, cell, rank)
    if directory is not None:
        env["TMS_DISK_BACKUP_DIR"] = directory
    offload = cfg.offload
    if use_gpu and offload.offload_train and tms_library:
        env["LD_PRELOAD"] = tms_library
        env["TMS_INIT_ENABLE"] = "1"
        if cfg.trainer_offload_to_disk:
            env["TMS_INIT_ENABLE_DISK_BACKUP"] = "1"
            env["TMS_DISK_BACKUP_CHUNK_MB"] = str(offload.offload_train_disk_chunk_mb)
        else:
            env["TMS_INIT_ENABLE_CPU_BACKUP"] = "1"
    return env


def bundle_specs(cfg: RunConfig, use_gpu: bool) -> list[dict[str, float]]:
    """One bundle per train rank; with ``--colocate`` the engines share the train bundles, otherwise
    each engine gets a bundle of its own after the train bundles. GPU bundles hold one GPU each."""
    n_train, n_engines = cfg.cluster.num_train_ranks, cfg.cluster.num_rollout_engines
    if cfg.cluster.colocate and n_engines > n_train:
        raise ValueError(f"--colocate places each rollout engine on a train rank's bundle: "
                         f"--num-rollout-engines ({n_engines}) must be <= --num-train-ranks ({n_train})")
    n_bundles = n_train if cfg.cluster.colocate else n_train + n_engines
    bundle: dict[str, float] = {"CPU": float(cfg.cluster.num_cpus_per_rank)}
    if use_gpu:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(n_bundles)]


def _resources(cfg: RunConfig, use_gpu: bool, colocated_share: float) -> dict[str, float]:
    share = colocated_share if cfg.cluster.colocate else 1.0
    return {"num_cpus": cfg.cluster.num_cpus_per_rank * share, "num_gpus": share if use_gpu else 0.0}


def train_actor_resources(cfg: RunConfig, use_gpu: bool) -> dict[str, float]:
    return _resources(cfg, use_gpu, COLOCATED_TRAIN_SHARE)


def rollout_engine_resources(cfg: RunConfig, use_gpu: bool) -> dict[str, float]:
    return _resources(cfg, use_gpu, COLOCATED_ROLLOUT_SHARE)


def rank_bundles(bundle_nodes: Sequence[str], num_train_ranks: int) -> list[int]:
    """Bundle index of each train rank (``result[rank]``), so that the ranks of one node are consecutive.

    ``bundle_nodes[b]`` is the node Ray placed bundle ``b`` on. ``PACK`` fills nodes but does not promise
    that bundles 0..k-1 land on one node; ranks follow the nodes instead (nodes in the order of their
    first train bundle, bundles of a node in index order), as Megatron expects consecutive ranks to share
    a node (its tensor- and expert-parallel groups are consecutive ranks)."""
    train = list(bundle_nodes[:num_train_ranks])
    if len(train) != num_train_ranks:
        raise ValueError(f"{num_train_ranks} train ranks but the placement group has {len(train)} train bundles")
    node_order = {node: i for i, node in reversed(list(enumerate(train)))}
    return sorted(range(num_train_ranks), key=lambda b: (node_order[train[b]], b))


def ranks_by_node(bundle_nodes: Sequence[str], ranks_to_bundles: Sequence[int]) -> dict[str, list[int]]:
    """``{node: [train ranks on it]}``, nodes in rank order."""
    out: dict[str, list[int]] = {}
    for rank, bundle in enumerate(ranks_to_bundles):
        out.setdefault(bundle_nodes[bundle], []).append(rank)
    return out


def colocated_rank(cfg: RunConfig, engine: int) -> int:
    """The train rank whose bundle colocated rollout engine ``engine`` shares: engines spread evenly over
    the ranks (with one engine per node, each lands on a node's first rank), not all on the first ones."""
    return engine * cfg.cluster.num_train_ranks // cfg.cluster.num_rollout_engines


def rollout_engine_placement(cfg: RunConfig, engine: int, ranks_to_bundles: Optional[Sequence[int]] = None) -> int:
    """Bundle index of rollout engine ``engine``. ``ranks_to_bundles``: :func:`rank_bundles` of the placement
    group (default: rank r on bundle r)."""
    if cfg.cluster.colocate:
        rank = colocated_rank(cfg, engine)
        return ranks_to_bundles[rank] if ranks_to_bundles is not None else rank
    return cfg.cluster.num_train_ranks + engine


def engines_load_first(config: RunConfig) -> bool:
    """An "auto" host tier is sized once, from the memory free when the store is built, and an embedded
    engine loads its checkpoint through host RAM (a copy as large as the bf16 weights, gone once they are on
    its device): the engines load first so the tier does not come out smaller by that copy (llama-9.2b on
    one H200, loading side by side: a 92 GB tier in one run, 17.6 GB of every step on disk; the whole
    110 GB state in the next). Otherwise both load at once."""
    return (config.optimizer.stream_optimizer_state_to_disk
            and config.optimizer.stream_optimizer_state_host_cache_mb == HOST_CACHE_AUTO
            and config.rollout.rollout_engine == "embedded")
