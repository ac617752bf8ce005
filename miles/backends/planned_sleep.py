"""A train rank's planned sleep and wake (``--offload-train-plan auto``): measure, plan, execute, report.

:class:`miles.backends.sleep.PlannedSleep` calls :func:`sleep_by_plan`; it measures the rank's
:class:`~miles.offload.plan.MemoryFacts`, asks the engine for its tensor groups (``sleep_groups``), plans
with :func:`miles.offload.plan.plan_sleep` and hands the plan and the rebuilders to the
:class:`~miles.offload.planned.PlannedOffloader`. What each call moved comes back in keys the rollout
record sums (:mod:`miles.metrics`):

    sleep: moved_bytes (written to RAM or disk), kept_bytes, discarded_bytes, to_ram_bytes, to_disk_bytes,
           released_for_engine_bytes, released_for_masters_bytes, plan_need_bytes, plan_shortfall_bytes, plan_notes
    wake:  moved_bytes (copied back), from_ram_bytes, from_disk_bytes, rebuilt_from_engine_bytes,
           rebuilt_from_masters_bytes, masters_read_bytes (the fp32 masters read for them)
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch

from miles.offload.plan import (DISCARD, FROM_ENGINE, FROM_MASTERS, EngineNeeds, Group, MemoryFacts, SleepPlan,
                                host_ram_budget, plan_sleep)
from miles.offload.planned import stats_of
from miles.offload.storage import unique_storages
from miles_plugins.optimizers.nvme_stream import StoreGroup
from miles_plugins.optimizers.streaming.config import DEFAULT_HOST_CACHE_RESERVE_MB
from miles_plugins.host.memory import available_host_memory
from miles_plugins.optimizers.streaming.units import GB, MiB

from .sleep_mode import AUTO

logger = logging.getLogger(__name__)

# Why the trainer cannot read the engine's copy, by --rollout-engine: both engines keep their weights in
# their own process (a Ray actor, or sglang's scheduler), and nothing maps them into the trainer's.
ENGINE_COPY_UNREADABLE = {
    "embedded": "the loop reads the embedded engine's weights back (CUDA IPC) only on GPU, with an engine on "
                "every train rank's GPU",
    "sglang": "sglang's weights live in its own processes, in its own layout",
}


def make_groups(specs: list[tuple[str, str, list, dict]]) -> list[tuple[Group, list[torch.Tensor]]]:
    """``[(name, kind, tensors, sources)]`` -> plan groups, each sized by the distinct storages it is the
    first to name (a storage behind two groups belongs to the first, as in the executor); ``sources``:
    Group's ``engine_copy`` / ``from_masters``."""
    seen: set[int] = set()
    out = []
    for name, kind, tensors, sources in specs:
        tensors = [t for t in tensors if t is not None]
        nbytes = 0
        for storage in unique_storages(tensors):
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                nbytes += storage.nbytes()
        out.append((Group(name, kind, nbytes, **sources), tensors))
    return out


def copy_from_engine(named: Iterable[tuple[str, torch.Tensor]], targets: dict[str, torch.Tensor]) -> int:
    """Copy the engine's weights (``named``, in the trainer's layout already) into ``targets`` (name ->
    the trainer's tensor), each bit for bit: a name, shape or dtype that differs raises, and so does a
    target no name reached (the rebuild must rewrite every byte the sleep dropped). Names of ``named``
    that are not targets are skipped (the caller rebuilds only the group the plan released). Returns
    the bytes copied."""
    done, nbytes = set(), 0
    for name, src in named:
        dst = targets.get(name)
        if dst is None:
            continue
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
            raise RuntimeError(f"rebuilding {name} from the rollout engine's copy: it holds {src.dtype} "
                               f"{tuple(src.shape)}, the trainer {dst.dtype} {tuple(dst.shape)}; an exact rebuild "
                               "needs both equal (run the engine in the trainer's dtype, or "
                               "--offload-train-plan offload-all)")
        dst.copy_(src)
        done.add(name)
        nbytes += dst.numel() * dst.element_size()
    missing = [n for n in targets if n not in done]
    if missing:
        raise RuntimeError(f"rebuilding from the rollout engine's copy: it did not hold {missing[:5]}"
                           f"{' and more' if len(missing) > 5 else ''}; those bytes are lost. Use "
                           "--offload-train-plan offload-all, and report this")
    return nbytes


def engine_weights_or_fail(engine_weights: Optional[list], rank: int) -> list:
    """The engine's shared weights handed to this wake; a plan that released the weights for them cannot
    wake without them."""
    if engine_weights is None:
        raise RuntimeError(f"rank {rank}: the sleep released the weights to rebuild them from the "
                           "rollout engine's copy, but this wake was not handed it (wake(engine_weights=...)); "
                           "the driver promised it with EngineNeeds(copy_at_wake=True)")
    return engine_weights


def memory_facts(device: torch.device, engine: EngineNeeds, store, ranks_on_node: int,
                 rollout_engine: str, host_bytes_held: int = 0) -> MemoryFacts:
    """What the rank measures at sleep, with what the driver measured of the engine (``engine``). A KV
    pool not measured (the engine does not say what it allocates) is taken as the whole device: the plan
    then releases everything releasable. ``host_bytes_held``: host memory the offloader keeps for its copies
    to RAM between sleeps, in use for the host but free for this sleep's copies."""
    available = available_host_memory()
    if available is not None:
        available += host_bytes_held
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:  # the device is host memory
        free = total = available if available is not None else 0
    stores = StoreGroup.of(store).stores if store is not None else []
    reserve_mb = stores[0].config.host_cache_reserve_mb if stores else DEFAULT_HOST_CACHE_RESERVE_MB
    tier_growth = sum(max(0, s.stats.host_cache_bytes - s.stats.ram_state_bytes) for s in stores)
    return MemoryFacts(
        device_total=int(total), device_free=int(free),
        engine_kv=int(total) if engine.kv_bytes is None else int(engine.kv_bytes),
        engine_kv_measured=engine.kv_bytes is not None,
        engine_weights=int(engine.weight_bytes),
        host_ram_budget=host_ram_budget(available, reserve_mb * MiB, ranks_on_node, tier_growth),
        masters_in_host_ram=bool(stores) and all(s.mains_in_host_ram for s in stores),
        engine_copy_unreadable_because=None if engine.copy_at_wake else ENGINE_COPY_UNREADABLE.get(
            rollout_engine, f"engine {rollout_engine!r}"),
        device_is_host=device.type != "cuda")


def sleep_by_plan(engine, offloader, needs: EngineNeeds, rebuilders: dict, ranks_on_node: int) -> dict[str, Any]:
    """Plan and execute the sleep of ``engine``'s tensors; returns the report (module docstring)."""
    config = engine.config
    groups = engine.sleep_groups()
    facts = memory_facts(engine.device, needs, engine.store, ranks_on_node, config.rollout.rollout_engine,
                         offloader.host_bytes_held)
    plan = plan_sleep([g for g, _ in groups], facts, config.offload.target)
    report = offloader.sleep({g.name: tensors for g, tensors in groups}, plan, rebuilders)
    if plan.shortfall_bytes and needs.kv_bytes is not None:  # unmeasured, the need is the whole device
        logger.warning("rank %d: sleep plan: the engine needs %.3f GB more than the trainer can release "
                       "(%s)", engine.rank, plan.shortfall_bytes / GB, "; ".join(plan.notes))
    return {**_as_offload_stats(report, "sleep", plan), **sleep_split(plan, report)}


def wake_by_plan(offloader) -> dict[str, Any]:
    report = offloader.wake()
    return {**_as_offload_stats(report, "wake", offloader.plan), **wake_split(report)}


def _as_offload_stats(report: dict, action: str, plan: Optional[SleepPlan]) -> dict[str, Any]:
    stats = stats_of(report, action, plan.target if plan else "")
    return {"action": action, "target": stats.target, "skipped": stats.skipped, "storages": 0,
            "bytes": stats.bytes, "seconds": stats.seconds, "path": None, "plan": AUTO if plan else None}


def sleep_split(plan: SleepPlan, report: dict) -> dict[str, Any]:
    if report.get("skipped"):
        return {"moved_bytes": 0}
    return {"moved_bytes": report["sleep_to_ram"] + report["sleep_to_disk"], "kept_bytes": report["sleep_kept"],
            "discarded_bytes": report[f"sleep_{DISCARD}"], "to_ram_bytes": report["sleep_to_ram"],
            "to_disk_bytes": report["sleep_to_disk"], "released_for_engine_bytes": report[f"sleep_{FROM_ENGINE}"],
            "released_for_masters_bytes": report[f"sleep_{FROM_MASTERS}"], "plan_need_bytes": plan.need_bytes,
            "plan_shortfall_bytes": plan.shortfall_bytes, "plan_notes": list(plan.notes)}


def wake_split(report: dict) -> dict[str, Any]:
    if report.get("skipped"):
        return {"moved_bytes": 0}
    rebuilt = report[f"wake_{FROM_ENGINE}"] + report[f"wake_{FROM_MASTERS}"]
    return {"moved_bytes": report["wake_from_ram"] + report["wake_from_disk"] + rebuilt,
            "from_ram_bytes": report["wake_from_ram"], "from_disk_bytes": report["wake_from_disk"],
            "rebuilt_from_engine_bytes": report[f"wake_{FROM_ENGINE}"],
            "rebuilt_from_masters_bytes": report[f"wake_{FROM_MASTERS}"],
            # what crossed host->device to rebuild them: the fp32 masters (twice the bf16 weights' bytes)
            "masters_read_bytes": report[f"wake_{FROM_MASTERS}_read"]}

