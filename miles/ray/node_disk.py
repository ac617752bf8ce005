"""Every node's disk, checked against `miles plan`'s per-rank need before any train actor starts.

`miles train`'s validation can only look at the driver's filesystem. On a cluster each node writes its
own ranks' directories under the same root path on its own disk, so once the placement group says which
ranks landed on which node, a tiny probe task on each node reports the free space
under the run root there, and a node short of space stops the run with one line naming it and the numbers.

The need per node is ``ranks on the node x`` what one rank writes there
(:func:`miles.preflight.disk_budget.rank_disk_need`: `miles plan`'s estimate of the streamed optimizer state's
files and the trainer offload, for this run's model and layout). A host tier keeps its buckets in RAM with
no file; for ``--stream-optimizer-state-host-cache-mb auto`` the probe reports the node's available memory,
so each node is asked only for what its ranks' tiers will not hold.
Rollout engines write nothing there (their released weights are not backed up: the loop pushes new ones).
Checkpoints go to ``--save``, which validation checks; they are not counted here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from miles.config import RunConfig
from miles.preflight.disk_budget import model_tensors_of_run, rank_disk_need
from miles.sizing.estimate import GB, SizingError
from miles.sizing.sharding import LayoutError
from miles.sizing.tensors import ModelTensors

from . import layout

logger = logging.getLogger(__name__)


def readable_bytes(n: int) -> str:
    """``3.04 TB``, ``2.01 MB``, ``1.00 kB``: large disks and tiny test runs both print legible figures."""
    for unit, scale in (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


class NodeDiskError(RuntimeError):
    """A node's disk cannot hold what the run writes there; the message is one line naming the node."""


@dataclass(frozen=True)
class NodeDisk:
    node_id: str
    address: str
    ranks: tuple[int, ...]
    need_bytes: int
    free_bytes: int
    checked_path: str  # the run root, or its nearest existing parent on that node

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.free_bytes

    def describe(self) -> str:
        return (f"node {self.node_id[:12]} ({self.address}): {len(self.ranks)} train rank(s) {list(self.ranks)}"
                f" need {readable_bytes(self.need_bytes)} under {self.checked_path}, "
                f"{readable_bytes(self.free_bytes)} free")


def per_rank_disk_bytes(cfg: RunConfig, model: ModelTensors, ranks_on_node: int = 1,
                        memory_available: Optional[int] = None) -> int:
    """What one train rank writes to its node's disk, of ``ranks_on_node`` ranks sharing the node's
    ``memory_available`` (for an ``auto`` host tier; None: unknown, no tier counted)."""
    if not cfg.uses_rank_dirs:
        return 0
    return rank_disk_need(cfg, model, ranks_on_node, memory_available).total


def node_needs(ranks: dict[str, list[int]], per_rank: Callable[[str, int], int]) -> dict[str, int]:
    """Bytes each node's disk must hold, nodes in rank order (pure): ``per_rank(node, ranks_on_node)`` is
    what one of its ranks writes."""
    return {node: len(node_ranks) * per_rank(node, len(node_ranks)) for node, node_ranks in ranks.items()}


def shortfall_line(nodes: Sequence[NodeDisk]) -> Optional[str]:
    """One line naming every node whose disk is short, with the numbers and the fix; None when all fit."""
    short = [n for n in nodes if not n.fits]
    if not short:
        return None
    return ("not enough node-local disk for the run under --offload-train-disk-dir: "
            + "; ".join(n.describe() for n in short)
            + ". Free space there, pass a directory on a larger disk, or shrink the run "
              "(--stream-optimizer-state-moment-dtype bf16 or fp8e4m3, fewer ranks per node); `miles plan` sizes it")


def nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def free_bytes_on_node(path: str) -> tuple[str, int, str, Optional[int]]:
    """Runs on the probed node: its address, the free bytes under ``path`` (or its nearest existing parent),
    and its available memory (None where it cannot be read)."""
    import ray

    from miles_plugins.host.memory import available_host_memory  # the reading the store sizes its tier by

    existing = nearest_existing(path)
    return ray.util.get_node_ip_address(), shutil.disk_usage(existing).free, existing, available_host_memory()


PROBE_TIMEOUT_S = 120.0  # a node's probe task: a worker to start there, then one disk_usage


def pinned_task(fn, node: str):
    """``fn`` as a Ray task that runs on ``node`` and nowhere else, reserving no CPU (the placement group
    may hold all of them), never retried."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(fn).options(num_cpus=0, max_retries=0,
                                  scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))


def probe_nodes(node_ids: Sequence[str], path: str,
                timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, tuple[str, int, str, Optional[int]]]:
    """``{node: (address, free bytes, checked path, available memory)}`` from one task pinned to each node.
    Raises :class:`NodeDiskError` naming the nodes that did not answer within ``timeout_s``."""
    import ray

    from miles.progress import waiting

    from .errors import wait_until

    refs = {node: pinned_task(free_bytes_on_node, node).remote(path) for node in node_ids}
    with waiting(f"checking the disk under {path} on {len(refs)} node(s)"):
        _, pending = wait_until(list(refs.values()), len(refs), time.monotonic() + timeout_s)
    if pending:
        silent = [node[:12] for node, ref in refs.items() if ref in pending]
        for ref in pending:
            ray.cancel(ref)
        raise NodeDiskError(f"the disk check under --offload-train-disk-dir got no answer within {timeout_s:.0f} s "
                            f"from node(s) {', '.join(silent)}: check that Ray runs there (`ray status` on the head "
                            "node) and that the node can start a worker")
    return {node: ray.get(ref) for node, ref in refs.items()}


def _hf_config(cfg: RunConfig) -> Optional[dict]:
    if cfg.model_source != "hf_checkpoint":
        return None
    try:
        with open(os.path.join(cfg.model.hf_checkpoint, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def check_node_disks(cfg: RunConfig, pg) -> list[NodeDisk]:
    """Probe every node of the placement group and compare with what the run writes there. Returns the
    nodes (logged); raises :class:`NodeDiskError` with one line when any is short. Nothing to check (an
    empty list) when no disk mechanism is on or the model cannot be sized."""
    from .placement_group import bundle_nodes

    if not cfg.uses_rank_dirs:
        return []
    model = model_tensors_of_run(cfg.model_source, _hf_config(cfg), tp=cfg.training.tensor_model_parallel_size,
                                 backend=cfg.training.train_backend)
    if model is None:  # as in validation: skipped, not guessed
        logger.warning("per-node disk check skipped: the model's architecture is unknown to `miles plan`")
        return []
    nodes_of = bundle_nodes(pg)
    ranks_to_bundles = layout.rank_bundles(nodes_of, cfg.cluster.num_train_ranks)
    ranks = layout.ranks_by_node(nodes_of, ranks_to_bundles)
    probed = probe_nodes(sorted(ranks), cfg.paths.root)
    try:
        needs = node_needs(ranks, lambda node, count: per_rank_disk_bytes(cfg, model, count, probed[node][3]))
    except (SizingError, LayoutError) as exc:
        logger.warning("per-node disk check skipped: `miles plan` cannot size this run (%s)", exc)
        return []
    nodes = [NodeDisk(node, probed[node][0], tuple(ranks.get(node, [])), need, probed[node][1], probed[node][2])
             for node, need in needs.items()]
    for n in nodes:
        logger.info("disk per node: %s", n.describe())
    line = shortfall_line(nodes)
    if line:
        raise NodeDiskError(line)
    return nodes
