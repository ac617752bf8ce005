"""The train group: the train actors of one cell, driven together.

Every call broadcasts to all ranks and waits with :func:`miles.ray.errors.wait_all`, so the first
failing rank stops the run with its traceback instead of leaving the driver waiting on ranks that
hang in a collective.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from miles.config import RunConfig

from . import actor_factory
from .errors import close_then_kill, wait_all

logger = logging.getLogger(__name__)


class RayTrainGroup:
    def __init__(self, config: RunConfig, pg, use_gpu: bool, cell: int = 0):
        self.config = config
        self.cell = cell
        self.use_gpu = use_gpu
        self.actors = actor_factory.make_train_actors(config, pg, use_gpu, cell)
        self.labels = [f"train actor cell{cell} rank {r}" for r in range(len(self.actors))]
        self.rank_dirs = actor_factory.rank_dirs(config, cell)
        self.asleep = False

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def _all(self, method: str, *args, **kwargs) -> list[Any]:
        refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        return wait_all(refs, method, self.labels)

    # ---- lifecycle ----------------------------------------------------------------------------
    def init(self) -> list[dict[str, Any]]:
        """Every rank joins the process group at an address on rank 0's node (not the driver's: on a
        cluster the driver may run elsewhere)."""
        rendezvous = wait_all([self.actors[0].rendezvous.remote()], "rendezvous", self.labels[:1])[0]
        return self._all("init", rendezvous)

    def load(self, base: str, load_optimizer: bool) -> list[dict[str, Any]]:
        return self._all("load", base, load_optimizer)

    def train(self, rollout_id: int, shards: list[tuple[list, list[float]]]) -> list[dict[str, Any]]:
        """``shards[r] = (samples, advantages)`` of rank r; returns each rank's metrics."""
        if len(shards) != self.world_size:
            raise ValueError(f"{len(shards)} data shards for {self.world_size} train ranks")
        refs = [a.train.remote(rollout_id, samples, adv) for a, (samples, adv) in zip(self.actors, shards)]
        return wait_all(refs, f"train (rollout {rollout_id})", self.labels)

    def push_weights(self, routes, engines: list, payload: str, tp_size: int,
                     peers: Optional[dict[int, Any]] = None) -> list[dict[str, Any]]:
        """Every rank hands its weights, as the ``payload`` the engines consume (each ``tp_size`` ranks), to the
        engines ``routes`` give it (:mod:`miles.ray.weight_sync`): by reference to ``routes.ipc[rank]`` (with
        the other ranks of ``peers[engine]``, a :class:`miles.weights.push.PayloadPeers`, when the rank is among
        them), and rank 0 by broadcast to ``routes.broadcast``. Every rank is called: with expert parallelism
        the weights' iteration gathers experts (a collective)."""
        peers_of = {r: p for p in (peers or {}).values() for r in p.ranks}
        refs = [a.push_weights.remote([engines[i] for i in routes.ipc.get(r, ())],
                                      [engines[i] for i in routes.broadcast] if r == 0 else [], payload, tp_size,
                                      peers_of.get(r))
                for r, a in enumerate(self.actors)]
        return wait_all(refs, "push_weights", self.labels)

    def join_payload_groups(self, groups: list[tuple[int, ...]]) -> None:
        """Every rank makes the process group of each engine's feeding ranks (weight_sync.payload_peer_ranks)."""
        self._all("join_payload_groups", groups)

    def join_weight_group(self, spec: dict[str, Any]):
        """The ref of rank 0 joining the weight-update group as its source (waited for with the engines')."""
        return self.actors[0].join_weight_group.remote(spec)

    def save(self, base: str, wait: bool = True) -> list[dict[str, Any]]:
        return self._all("save", base, wait)

    def finish_save(self) -> list[Any]:
        return self._all("finish_save")

    def sleep(self, engine=None) -> list[dict[str, Any]]:
        """``engine``: what the driver measured of the colocated engine (:class:`miles.offload.plan.EngineNeeds`;
        see :meth:`miles.backends.rank.TrainRank.sleep`)."""
        out = self._all("sleep", engine)
        self.asleep = True
        return out

    def wake(self, engine_weights: Optional[list] = None) -> list[dict[str, Any]]:
        """``engine_weights[r]``: the engine weights rank r rebuilds from (``share_weights()`` of the engine
        on its GPU), or None."""
        if engine_weights is None:
            out = self._all("wake")
        else:
            refs = [a.wake.remote(w) for a, w in zip(self.actors, engine_weights)]
            out = wait_all(refs, "wake", self.labels)
        self.asleep = False
        return out

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Ask every live actor to close its store and remove its directory, then kill them all."""
        close_then_kill(self.actors, "shutdown", timeout_s)
