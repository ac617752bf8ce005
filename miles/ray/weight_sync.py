"""Trained weights to the rollout engines: the driver's side (routes, the weight-update group, versioned
sessions). The push itself runs inside each train actor (:mod:`miles.weights.push`). Nothing of the weights
travels through Ray's object store.

    routes = plan_routes(config.rollout.weight_sync, num_ranks=n, engine_ranks=[...])
    # driver: opens each engine's session (begin_weight_update), asks every train rank to push the payload the
    # engines' info() names (engine_payload), closes it

Two paths (:mod:`miles.weights`):

- **ipc**: a train rank hands the engines that share its GPU (``--colocate``; on CPU, its node) each
  flattened bucket by reference (a CUDA IPC handle, or a shared-memory file on CPU); the engine copies the
  weights into its own parameters and answers; only then does the rank drop the bucket. An sglang engine with
  tensor parallelism whose ranks run on the GPUs of train ranks ``r .. r + tp - 1`` (``r`` its colocated rank)
  gets each of its ranks' payloads from the train rank on that GPU (:func:`payload_peer_ranks`).
- **distributed**: train rank 0 broadcasts each bucket over a weight-update process group that the
  engines joined (NCCL on GPU, gloo on CPU); each engine receives it while its Ray call waits.

Every train rank iterates its weights (with expert parallelism the iteration gathers each layer's experts
over the expert-parallel group, a collective), so every rank is called even when it feeds no engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from miles.rollout.contract import SGLANG_FLATTENED_BUCKET
from miles.weights.push import PayloadPeers

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


@dataclass(frozen=True)
class EnginePayload:
    """What the engines' weight updates consume (their ``info()``'s ``weight_payload``) and how many
    tensor-parallel ranks each has (one payload, or one group rank, each)."""

    kind: str
    tp_size: int


def engine_payload(engine_infos: Sequence[dict]) -> EnginePayload:
    """The one payload every engine consumes (pure, from the engines' infos: ``weight_payload``, ``tp_size``);
    ValueError naming the engines that differ (one push builds one payload)."""
    if not engine_infos:
        raise ValueError("no rollout engines to hand the weights to")
    kinds = [EnginePayload(info["weight_payload"], info["tp_size"]) for info in engine_infos]
    if len(set(kinds)) > 1:
        raise ValueError("the rollout engines consume different weight payloads: " + "; ".join(
            f"engine {i}: {k.kind} x tp {k.tp_size}" for i, k in enumerate(kinds)) + "; run one kind of engine")
    return kinds[0]


def _gpu_order(device: str):
    return (0, int(device), "") if device.isdigit() else (1, 0, device)


def payload_peer_ranks(routes: WeightRoutes, payload: EnginePayload,
                       train_infos: Sequence[dict]) -> dict[int, PayloadPeers]:
    """For each sglang engine fed by reference with tensor parallelism: the train ranks whose GPUs its ranks use,
    in its rank order, and its colocated rank, which calls it (pure; each rank adds the process group). The
    engine's ranks are taken to run on the GPUs of its colocated rank ``r`` and the next ``tp - 1`` ranks (a
    node's ranks are consecutive), rank i on the i-th of those GPUs by number: an ``--sglang-url`` server with
    ``--tp-size`` the node's GPU count, started on them in order. Where those ranks are not on ``r``'s node with a
    GPU each, or ``r`` feeds other engines too, the engine is left out and ``r`` hands it all ``tp`` payloads of
    its own bucket (each sglang rank then reads ``r``'s GPU)."""
    if payload.kind != SGLANG_FLATTENED_BUCKET or payload.tp_size < 2:
        return {}
    peers = {}
    for rank, engines in sorted(routes.ipc.items()):
        block = range(rank, rank + payload.tp_size)
        if len(engines) != 1 or block[-1] >= len(train_infos):
            continue
        devices = {r: train_infos[r]["cuda_visible_devices"] for r in block}
        if (all(train_infos[r]["node_id"] == train_infos[rank]["node_id"] for r in block)
                and all(isinstance(d, str) and "," not in d for d in devices.values())
                and len(set(devices.values())) == len(block)):
            ranks = tuple(sorted(block, key=lambda r: _gpu_order(devices[r])))
            peers[engines[0]] = PayloadPeers(ranks=ranks, caller=rank)
    return peers


def group_ranks(engine_tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """``(world_size, rank_offsets)`` of the weight-update group (pure): the train source at rank 0, then each
    engine's tensor-parallel ranks in order (``rank_offsets[k]``: engine k's first rank)."""
    offsets = [1 + sum(engine_tp_sizes[:k]) for k in range(len(engine_tp_sizes))]
    return 1 + sum(engine_tp_sizes), offsets


class WeightSync:
    """The driver's side of the handoff: plans the routes once (an engine that shares no GPU with a train rank
    is broadcast to), makes the weight-update group when an engine needs it, and runs one versioned update:
    every engine's session opened, every rank pushing the engines' payload, closed."""

    def __init__(self, config, train_group, rollout, train_infos: Sequence[dict], engine_infos: Sequence[dict],
                 use_gpu: bool):
        from miles.ray.errors import wait_all

        from . import layout

        colocated = ([layout.colocated_rank(config, i) for i in range(len(engine_infos))]
                     if config.cluster.colocate else None)
        self.routes = plan_routes(config.rollout.weight_sync, num_ranks=len(train_infos),
                                  engine_ranks=engine_feed_ranks(train_infos, engine_infos, use_gpu=use_gpu,
                                                                 colocated_rank=colocated))
        self.payload = engine_payload(engine_infos)
        self.peers = payload_peer_ranks(self.routes, self.payload, train_infos)
        self.train_group, self.rollout = train_group, rollout
        if self.peers:  # a process group per engine's feeding ranks (made by every rank: a collective)
            train_group.join_payload_groups([p.ranks for p in self.peers.values()])
        # rank r's engine to read the weights back from at wake (the sleep plan's rebuild_from_engine): the
        # embedded engine on its GPU, by CUDA IPC; None unless every rank has one (on CPU it would be a copy)
        ipc = [self.routes.ipc.get(r, ()) for r in range(len(train_infos))]
        self.readback_engines = ([engines[0] for engines in ipc] if use_gpu and config.cluster.colocate
                                 and config.rollout.rollout_engine == "embedded" and all(ipc) else None)
        if self.routes.broadcast:
            address = wait_all([train_group.actors[0].rendezvous.remote()], "rendezvous", train_group.labels[:1])[0]
            host, port = address.rsplit(":", 1)
            world_size, offsets = group_ranks([self.payload.tp_size] * len(self.routes.broadcast))
            spec = {"master_address": host, "master_port": int(port), "world_size": world_size,
                    "backend": "nccl" if use_gpu else "gloo", "group_name": GROUP_NAME}
            refs = ([train_group.join_weight_group(spec)]
                    + rollout.join_weight_group(spec, self.routes.broadcast, offsets))
            wait_all(refs, "joining the weight-update group",
                     train_group.labels[:1] + [rollout.labels[i] for i in self.routes.broadcast])
        logger.info("weight handoff: %s; payload %s%s", self.routes.describe(), self.payload.kind,
                    "".join(f"; engine {e}'s tensor-parallel ranks fed by train ranks {list(p.ranks)}"
                            for e, p in sorted(self.peers.items())))

    def push(self, version: int) -> list[dict[str, Any]]:
        """Weights of the train ranks into every engine as ``version``; each rank's stats."""
        self.rollout.begin_weight_update(version)
        stats = self.train_group.push_weights(self.routes, self.rollout.engines, self.payload.kind,
                                              self.payload.tp_size, self.peers)
        self.rollout.end_weight_update(version)
        return stats
