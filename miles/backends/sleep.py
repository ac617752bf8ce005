"""A train rank's two ways to sleep, one chosen at init by :func:`miles.backends.sleep_mode.sleep_mode`.

:class:`PlannedSleep` (``--offload-train-plan auto``) plans each sleep from measured numbers
(:mod:`miles.backends.planned_sleep`); :class:`OffloadAllSleep` (``offload-all``) hands every tensor the
engine names to the process's offloader (torch_memory_saver's pause on GPU when the actor has its hook,
else the storage offloader). Both answer the same three calls, so the rank never asks which it has:

    keeps_allocator_cache(device, needs, engine_weights_resident)   # may the caching allocator keep its blocks
    put_away(engine, needs, keep_cache) -> report                   # at sleep, after the engine's own drops
    bring_back(engine, engine_weights) -> report                    # at wake, before the engine's restores
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from miles.config import RunConfig
from miles.offload import make_offloader
from miles.offload.plan import FROM_ENGINE, FROM_MASTERS, EngineNeeds, allocator_cache_may_stay
from miles.offload.planned import PlannedOffloader

from .engine import TrainEngine
from .planned_sleep import engine_weights_or_fail, sleep_by_plan, wake_by_plan
from .sleep_mode import OFF, OFFLOAD_ALL, sleep_mode


class PlannedSleep:
    """``--offload-train-plan auto``: what moves is decided at each sleep (miles.offload.plan)."""

    def __init__(self, offloader: PlannedOffloader, ranks_on_node: int):
        self.offloader = offloader
        self.ranks_on_node = ranks_on_node
        self.engine_weights: Optional[list] = None  # during a wake: the rollout engine's weights by reference

    def keeps_allocator_cache(self, device: torch.device, needs: EngineNeeds, engine_weights_resident: bool) -> bool:
        """Whether the engine's last measured needs fit beside the caching allocator's free blocks
        (:func:`allocator_cache_may_stay`)."""
        if device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(device)
        return allocator_cache_may_stay(free, needs, engine_weights_resident)

    def put_away(self, engine: TrainEngine, needs: EngineNeeds, keep_cache: bool) -> dict[str, Any]:
        if engine.device.type == "cuda" and not keep_cache:
            torch.cuda.empty_cache()  # the plan measures free device memory: freed blocks count as free
        return sleep_by_plan(engine, self.offloader, needs, self.rebuilders(engine), self.ranks_on_node)

    def rebuilders(self, engine: TrainEngine) -> dict[str, Any]:
        """``{way: callable}`` that rewrites at wake the groups the plan rebuilt: from the rollout engine's
        copy handed to that wake, or from the store's masters (with a store)."""
        rebuilders = {FROM_ENGINE: lambda: engine.weights_from_engine(
            engine_weights_or_fail(self.engine_weights, engine.rank))}
        if engine.store is not None:
            rebuilders[FROM_MASTERS] = engine.weights_from_masters
        return rebuilders

    def bring_back(self, engine: TrainEngine, engine_weights: Optional[list]) -> dict[str, Any]:
        self.engine_weights = engine_weights
        try:
            return wake_by_plan(self.offloader)
        finally:
            self.engine_weights = None  # the references die with this wake: the engine releases them next


class OffloadAllSleep:
    """``--offload-train-plan offload-all``: every tensor the engine names goes to the target and comes back."""

    def __init__(self, offloader):
        self.offloader = offloader

    def keeps_allocator_cache(self, device: torch.device, needs: EngineNeeds, engine_weights_resident: bool) -> bool:
        return False  # emptied as always: torch_memory_saver's pause would back the free blocks up

    def put_away(self, engine: TrainEngine, needs: EngineNeeds, keep_cache: bool) -> dict[str, Any]:
        return offload_all_report(self.offloader.sleep(engine.offload_tensors()))

    def bring_back(self, engine: TrainEngine, engine_weights: Optional[list]) -> dict[str, Any]:
        return offload_all_report(self.offloader.wake())


def offload_all_report(stats) -> dict[str, Any]:
    """An :class:`~miles.offload.OffloadStats` as sleep/wake report it, with the keys the planned sleep
    reports too (every byte to or from the target)."""
    report = {"action": stats.action, "target": stats.target, "skipped": stats.skipped, "storages": stats.storages,
              "bytes": stats.bytes, "seconds": stats.seconds, "path": stats.path}
    if stats.skipped:
        return {**report, "moved_bytes": 0}
    where = "ram" if stats.target == "cpu" else "disk"
    key = f"to_{where}_bytes" if stats.action == "sleep" else f"from_{where}_bytes"
    return {**report, "moved_bytes": stats.bytes, key: stats.bytes, "plan": OFFLOAD_ALL}


def make_sleep(config: RunConfig, device: torch.device, rank_dir: Optional[str], lock, ranks_on_node: int):
    """The rank's way to sleep (None when --offload-train is off)."""
    mode = sleep_mode(config)
    if mode == OFF:
        return None
    offload = config.offload
    if config.trainer_offload_to_disk and rank_dir is None:
        raise RuntimeError("--offload-train-target=disk needs the rank directory: build the trainer with "
                           "rank_dir=config.paths.rank_dir(cell, rank)")
    if mode == OFFLOAD_ALL:
        return OffloadAllSleep(make_offloader(offload.offload_train_target, rank_dir,
                                              offload.offload_train_disk_chunk_mb, device.type,
                                              run_id=config.run_id, lock=lock))
    return PlannedSleep(PlannedOffloader(offload.target, rank_dir, offload.offload_train_disk_chunk_mb,
                                         run_id=config.run_id, lock=lock), ranks_on_node)


def settle_store_for_sleep(store, flush: bool) -> dict[str, Any]:
    """Before the rank sleeps: the streamed state's store gives back every device buffer it holds.
    ``flush`` (--stream-optimizer-state-flush-at-sleep) also waits until every write-back is on disk;
    otherwise the disk writes land while the rollout engine generates (the store's files live apart from
    the offload's, so sleep does not need them settled) and the next step waits for what is left.
    Returns the seconds the sleep waited, for the per-rollout exposed I/O."""
    if store is None:
        return {}
    start = time.perf_counter()
    if flush:
        store.flush()
    else:
        store.release_device()
    return {"store_wait_seconds": time.perf_counter() - start}
