"""Trained weights to the rollout engines, by reference: the routes (planned by the driver) and the push
(run inside each train actor). Nothing of the weights travels through Ray's object store.

    routes = plan_routes(config.rollout.weight_sync, engine_ranks=[...], engine_shares_rank=[...], num_ranks=n)
    # driver: opens each engine's session (begin_weight_update), asks every train rank to push, closes it
    stats = push_weights(trainer.hf_weights(), ipc_engines=[...], group=..., group_engines=[...], ...)

Two paths (:mod:`miles.weights`):

- **ipc**: a train rank hands the engines that share its GPU (``--colocate``; on CPU, its node) each
  flattened bucket by reference (a CUDA IPC handle, or a shared-memory file on CPU); the engine copies the
  weights into its own parameters and answers; only then does the rank drop the bucket.
- **distributed**: train rank 0 broadcasts each bucket over a weight-update process group that the
  engines joined (NCCL on GPU, gloo on CPU); each engine receives it while its Ray call waits.

Every train rank iterates its weights (with expert parallelism the iteration gathers each layer's experts
over the expert-parallel group, a collective), so every rank is called even when it feeds no engine.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

logger = logging.getLogger(__name__)

WEIGHT_SYNC_MODES = ("auto", "ipc", "distributed")
GROUP_NAME = "miles-weights"


@dataclass(frozen=True)
class WeightRoutes:
    """Who feeds whom: ``ipc[rank]`` the engine ids train rank ``rank`` hands buckets to by reference;
    ``broadcast`` the engine ids fed through the weight-update group, whose source is train rank 0."""

    ipc: dict[int, tuple[int, ...]] = field(default_factory=dict)
    broadcast: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.ipc:
            parts.append("by reference (" + ", ".join(f"rank {r} -> engine{'s' if len(e) > 1 else ''} "
                                                      f"{','.join(map(str, e))}" for r, e in sorted(self.ipc.items())) + ")")
        if self.broadcast:
            parts.append(f"broadcast from rank 0 to engine(s) {','.join(map(str, self.broadcast))}")
        return "; ".join(parts) or "no engines"


def plan_routes(mode: str, *, num_ranks: int, engine_ranks: Sequence[Optional[int]]) -> WeightRoutes:
    """Routes for ``--weight-sync mode`` (pure). ``engine_ranks[i]``: the train rank engine ``i`` can take
    buckets from by reference (it shares that rank's GPU, or on CPU its node), or None.

    ``auto``: by reference where possible, the rest by broadcast. ``ipc`` with an engine that has no such
    rank raises ValueError naming it; ``distributed``: every engine by broadcast."""
    if mode not in WEIGHT_SYNC_MODES:
        raise ValueError(f"weight sync mode must be one of {WEIGHT_SYNC_MODES}, got {mode!r}")
    for i, r in enumerate(engine_ranks):
        if r is not None and not 0 <= r < num_ranks:
            raise ValueError(f"engine {i}: train rank {r} is not in [0, {num_ranks})")
    if mode == "distributed":
        return WeightRoutes(broadcast=tuple(range(len(engine_ranks))))
    orphans = [i for i, r in enumerate(engine_ranks) if r is None]
    if mode == "ipc" and orphans:
        raise ValueError(f"--weight-sync ipc: rollout engine(s) {orphans} share no GPU (or node, on CPU) with a "
                         "train rank; use --colocate, or --weight-sync distributed")
    ipc: dict[int, list[int]] = {}
    for i, r in enumerate(engine_ranks):
        if r is not None:
            ipc.setdefault(r, []).append(i)
    return WeightRoutes(ipc={r: tuple(e) for r, e in ipc.items()}, broadcast=tuple(orphans))


@contextlib.contextmanager
def bucket_allocation():
    """Buckets must come from a plain cudaMalloc to be shared through CUDA IPC: under torch_memory_saver
    (the trainer's sleep/wake) every allocation is a virtual-memory mapping CUDA IPC cannot export, so
    the handoff allocates outside it (``torch_memory_saver.disable()``: a private pool of plain
    allocations, dropped at its end). Emptying torch's cache after it returns that pool's memory to CUDA:
    torch_memory_saver does not pause it, so it would otherwise stay on the GPU while the trainer sleeps."""
    from miles.offload.tms import preloaded_memory_saver, tms_active

    if not tms_active():
        yield
        return
    import torch

    try:
        with preloaded_memory_saver().disable():
            yield
    finally:
        torch.cuda.empty_cache()


class _Sharer:
    """``share_bucket``, with one fallback: when CUDA refuses to export a bucket (memory CUDA IPC cannot
    share), this and every later bucket of the handoff go through host shared memory instead (a device to
    host copy and a file in /dev/shm: slower, still outside Ray's object store), with one warning."""

    def __init__(self):
        self.through_host = False

    def share(self, spec, flat):
        from miles.weights import share_bucket

        if self.through_host:
            return share_bucket(spec, flat.cpu())
        try:
            return share_bucket(spec, flat)
        except RuntimeError as e:  # torch.AcceleratorError: cudaIpcGetMemHandle refused the allocation
            if not flat.is_cuda:
                raise
            logger.warning("CUDA IPC refused weight bucket %d (%s); handing the weights over through host "
                           "shared memory instead (slower)", spec.index, str(e).splitlines()[0])
            self.through_host = True
            return share_bucket(spec, flat.cpu())


def push_weights(named_tensors: Iterable, *, ipc_engines: Sequence[Any] = (), group=None,
                 group_engines: Sequence[Any] = (), max_bucket_bytes: int) -> dict[str, Any]:
    """Hand ``named_tensors`` (HF-layout ``(name, tensor)`` pairs on this rank's device) to the engines, one
    flattened bucket at a time: each bucket is shared with ``ipc_engines`` (Ray actor handles) and, with a
    ``group`` (this rank its source), broadcast to ``group_engines``; the next bucket is built once every
    engine acknowledged the last. Returns the handoff's stats for the metrics."""
    import ray

    from miles.weights import iter_buckets

    start = time.perf_counter()
    sharer = _Sharer()
    buckets = nbytes = largest = 0
    feeds = bool(ipc_engines) or (group is not None and bool(group_engines))
    with bucket_allocation():
        for spec, flat in iter_buckets(named_tensors, max_bucket_bytes):
            if not feeds:  # a rank whose iteration only takes part in the expert gathers
                continue
            shared = sharer.share(spec, flat) if ipc_engines else None
            try:
                refs = [e.update_weights_from_tensor.remote([shared], load_format="flattened_bucket")
                        for e in ipc_engines]
                if group is not None and group_engines:
                    refs += [e.update_weights_from_distributed.remote([spec.to_dict()], GROUP_NAME)
                             for e in group_engines]
                    group.broadcast(flat)
                ray.get(refs)
            finally:  # an engine that failed or died, or this actor interrupted: the file goes all the same
                if shared is not None:
                    shared.release()
            del flat
            buckets += 1
            nbytes += spec.nbytes
            largest = max(largest, spec.nbytes)
    return {"weight_handoff_seconds": time.perf_counter() - start, "weight_handoff_bytes": nbytes,
            "weight_handoff_buckets": buckets, "weight_handoff_largest_bucket_bytes": largest,
            "weight_handoff_through_host": sharer.through_host}


def engine_feed_ranks(train_infos: Sequence[dict], engine_infos: Sequence[dict], *, use_gpu: bool,
                      colocated_rank: Optional[Sequence[int]]) -> list[Optional[int]]:
    """For each engine, the train rank that can hand it buckets by reference (pure, from the actors' infos:
    ``node_id``, ``cuda_visible_devices``): on GPU its colocated rank when both see the same GPU; on CPU its
    colocated rank, else the first rank on its node. ``colocated_rank[i]``: engine i's rank under --colocate."""
    out: list[Optional[int]] = []
    for i, engine in enumerate(engine_infos):
        candidates = [colocated_rank[i]] if colocated_rank is not None else []
        if not use_gpu:
            candidates += range(len(train_infos))
        same = [r for r in candidates if train_infos[r]["node_id"] == engine["node_id"]
                and (not use_gpu or train_infos[r]["cuda_visible_devices"] == engine["cuda_visible_devices"])]
        out.append(same[0] if same else None)
    return out


class WeightSync:
    """The driver's side of the handoff: plans the routes once, makes the weight-update group when an engine
    needs it, and runs one versioned update: every engine's session opened, every rank pushing, closed."""

    def __init__(self, config, train_group, rollout, train_infos: Sequence[dict], engine_infos: Sequence[dict],
                 use_gpu: bool):
        from miles.ray.errors import wait_all

        from . import layout

        colocated = ([layout.colocated_rank(config, i) for i in range(len(engine_infos))]
                     if config.cluster.colocate else None)
        self.routes = plan_routes(config.rollout.weight_sync, num_ranks=len(train_infos),
                                  engine_ranks=engine_feed_ranks(train_infos, engine_infos, use_gpu=use_gpu,
                                                                 colocated_rank=colocated))
        self.train_group, self.rollout = train_group, rollout
        if self.routes.broadcast:
            address = wait_all([train_group.actors[0].rendezvous.remote()], "rendezvous", train_group.labels[:1])[0]
            host, port = address.rsplit(":", 1)
            spec = {"master_address": host, "master_port": int(port), "world_size": 1 + len(self.routes.broadcast),
                    "backend": "nccl" if use_gpu else "gloo"}
            refs = [train_group.join_weight_group(spec)] + rollout.join_weight_group(spec, self.routes.broadcast)
            wait_all(refs, "joining the weight-update group",
                     train_group.labels[:1] + [rollout.labels[i] for i in self.routes.broadcast])
        logger.info("weight handoff: %s", self.routes.describe())

    def push(self, version: int) -> list[dict[str, Any]]:
        """Weights of the train ranks into every engine as ``version``; each rank's stats."""
        self.rollout.begin_weight_update(version)
        stats = self.train_group.push_weights(self.routes, self.rollout.engines)
        self.rollout.end_weight_update(version)
        return stats
