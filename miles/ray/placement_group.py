"""The placement group: one bundle per train rank (plus one per rollout engine when not colocated).

GPU bundles (``{"CPU": c, "GPU": 1}``) where the cluster has GPUs, CPU bundles (``{"CPU": c}``)
otherwise. Bundles are packed onto as few nodes as possible (``PACK``): on a cluster of several nodes
each node takes as many bundles as its GPUs (or CPUs) hold. Which node got which bundle is read back
from Ray (:func:`bundle_nodes`); the train ranks follow it (:func:`miles.ray.layout.rank_bundles`), so
the ranks of one node are consecutive, and each rank's ``cell<i>_rank<j>`` directory is made by its
actor on its own node's disk.
"""

from __future__ import annotations

import logging
from typing import Optional

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from miles.config import RunConfig

from . import layout

logger = logging.getLogger(__name__)


def cluster_has_gpus() -> bool:
    return float(ray.cluster_resources().get("GPU", 0)) > 0


def create_placement_group(config: RunConfig, use_gpu: Optional[bool] = None, timeout_s: float = 120.0):
    """Create and wait for the placement group. Returns ``(pg, use_gpu, bundles)``."""
    if use_gpu is None:
        use_gpu = cluster_has_gpus()
    bundles = layout.bundle_specs(config, use_gpu)
    pg = placement_group(bundles, strategy="PACK", name="")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        have = ray.available_resources()
        remove_placement_group(pg)
        raise RuntimeError(
            f"the placement group of {len(bundles)} bundles {bundles[0]} did not fit within {timeout_s:.0f} s "
            f"(available: CPU={have.get('CPU', 0):g}, GPU={have.get('GPU', 0):g}); lower --num-train-ranks, "
            f"--num-rollout-engines or --num-cpus-per-rank, or use --colocate")
    logger.info("placement group ready: %d %s bundles %s", len(bundles), "GPU" if use_gpu else "CPU", bundles[0])
    return pg, use_gpu, bundles


def bundle_nodes(pg) -> list[str]:
    """Node id of each bundle of a ready placement group (``result[b]``)."""
    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[b] for b in range(len(table))]


def rank_bundles(pg, num_train_ranks: int) -> list[int]:
    """Bundle index of each train rank: the ranks of one node are consecutive (see ``layout.rank_bundles``)."""
    return layout.rank_bundles(bundle_nodes(pg), num_train_ranks)


def remove(pg) -> None:
    try:
        remove_placement_group(pg)
    except Exception:  # the cluster may be going down already
        pass
