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
import time
from typing import Optional

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from miles.config import RunConfig
from miles.progress import waiting

from . import layout
from .errors import wait_until

logger = logging.getLogger(__name__)


def cluster_has_gpus() -> bool:
    return float(ray.cluster_resources().get("GPU", 0)) > 0


PLACEMENT_TIMEOUT_S = 120.0  # resources the cluster has but other jobs hold: how long the run waits for them
_FIX = "lower --num-train-ranks, --num-rollout-engines or --num-cpus-per-rank, or use --colocate"


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's placement group (one line: what the run asks for, what the cluster has)."""


def create_placement_group(config: RunConfig, use_gpu: Optional[bool] = None,
                           timeout_s: float = PLACEMENT_TIMEOUT_S):
    """Create and wait for the placement group. Returns ``(pg, use_gpu, bundles)``. Raises
    :class:`PlacementError` at once when the cluster's resources, all of them, cannot hold the bundles, and
    after ``timeout_s`` when they can but other jobs hold them."""
    if use_gpu is None:
        use_gpu = cluster_has_gpus()
    bundles = layout.bundle_specs(config, use_gpu)
    asked = f"{len(bundles)} bundles of {_resources(bundles[0])} ({_resources(_summed(bundles))} in all)"
    cluster = f"the Ray cluster at {ray.get_runtime_context().gcs_address}"
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not _can_hold(nodes, bundles):
        raise PlacementError(f"the run asks for {asked}, and {cluster} has {_resources(_summed(nodes))} in all "
                             f"({len(nodes)} node(s), the largest {_resources(_largest(nodes, bundles[0]))}): {_FIX}, "
                             "or add nodes to the cluster")
    pg = placement_group(bundles, strategy="PACK", name="")
    with waiting(f"placing {asked}"):
        ready, _ = wait_until([pg.ready()], 1, time.monotonic() + timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(f"the run asks for {asked}, and {cluster} has {_resources(ray.cluster_resources())}, of "
                             f"which {_resources(ray.available_resources())} stayed free for {timeout_s:.0f} s (other "
                             f"jobs hold the rest): wait for them to finish, or {_FIX}")
    logger.info("placement group ready: %d %s bundles %s", len(bundles), "GPU" if use_gpu else "CPU", bundles[0])
    return pg, use_gpu, bundles


_SHOWN = ("CPU", "GPU")  # the resources a bundle asks for


def _resources(amounts: dict) -> str:
    return ", ".join(f"{key}={float(amounts.get(key, 0)):g}" for key in _SHOWN)


def _summed(resource_dicts: list[dict]) -> dict[str, float]:
    return {key: sum(float(r.get(key, 0)) for r in resource_dicts) for key in _SHOWN}


def _largest(nodes: list[dict], bundle: dict) -> dict:
    """The node with the most of what a bundle asks for (GPUs first)."""
    return max(nodes, key=lambda n: tuple(float(n.get(k, 0)) for k in ("GPU", "CPU") if k in bundle), default={})


def _can_hold(nodes: list[dict], bundles: list[dict]) -> bool:
    """False when the bundles can never fit, whatever else runs: more than the nodes have in all, or a bundle
    larger than every node (what the cluster frees later cannot help then)."""
    def fits(bundle: dict, have: dict) -> bool:
        return all(float(have.get(k, 0)) >= float(v) for k, v in bundle.items() if k in _SHOWN)

    return fits(_summed(bundles), _summed(nodes)) and all(any(fits(b, n) for n in nodes) for b in bundles)


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
