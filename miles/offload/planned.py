"""The executor of a sleep plan (:mod:`miles.offload.plan`): sleep releases each group the way the plan
chose, wake brings every group back, bit-exactly.

    off = PlannedOffloader(target, directory, chunk_mb, run_id=..., lock=...)
    off.sleep(tensors_by_group, plan, rebuilders)   # {"group": [tensors]}, a SleepPlan, {way: callable}
    off.wake()                                      # re-allocates, reads back, then calls the rebuilders

keep: nothing happens. discard / rebuild_from_engine / rebuild_from_masters: the storages are freed
(``resize_(0)``) without a copy; wake re-allocates them at their old size, zero-filled, and calls
``rebuilders[way]()``, which must rewrite every byte of its groups (the backend's: the store's masters
published, or the engine's copy converted back) and returns the bytes it read to do so. to_ram /
to_disk: a :class:`~miles.offload.storage.StorageOffloader` of target ``cpu`` / ``disk`` each. A storage
behind two groups belongs to the first (the backend lists weights first). Both calls are idempotent, as
the other offloaders'.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from .plan import DISCARD, FROM_ENGINE, FROM_MASTERS, KEEP, TO_DISK, TO_RAM, SleepPlan
from .storage import OffloadStats, StorageOffloader, unique_storages

logger = logging.getLogger(__name__)

_REBUILT = (FROM_ENGINE, FROM_MASTERS)


class PlannedOffloader:
    """Sleep/wake by plan. ``target``/``directory``/``chunk_mb``/``run_id``/``lock``: as
    :class:`StorageOffloader` (the disk one is made only when a plan sends a group to disk)."""

    def __init__(self, target: str, directory: Optional[str] = None, chunk_mb: int = 256, *,
                 run_id: Optional[str] = None, lock=None):
        self.target = target
        self.directory = directory
        self._chunk_mb = chunk_mb
        self._run_id = run_id
        self._lock = lock
        self._ram = StorageOffloader("cpu", chunk_mb=chunk_mb)
        self._disk: Optional[StorageOffloader] = None
        self._freed: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        self._rebuilders: dict[str, Callable[[], None]] = {}
        self._plan: Optional[SleepPlan] = None
        self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def host_bytes_held(self) -> int:
        """Page-locked host memory kept for the copies to RAM, asleep or awake (reused by the next sleep)."""
        return self._ram.host_bytes_held

    @property
    def plan(self) -> Optional[SleepPlan]:
        """The plan of the current (or last) sleep."""
        return self._plan

    def _disk_offloader(self) -> StorageOffloader:
        if self._disk is None:
            self._disk = StorageOffloader("disk", self.directory, self._chunk_mb, run_id=self._run_id, lock=self._lock)
        return self._disk

    @torch.no_grad()
    def sleep(self, tensors_by_group: dict[str, list], plan: SleepPlan,
              rebuilders: dict[str, Callable[[], None]]) -> dict:
        """Release every group as ``plan`` says; returns what moved, by way (bytes and seconds)."""
        if self._asleep:
            return {"skipped": True}
        missing = [w for w in _REBUILT if plan.bytes_by_way()[w] and w not in rebuilders]
        if missing:
            raise ValueError(f"the plan rebuilds groups {missing} at wake but no rebuilder was given for them")
        start = time.perf_counter()
        by_way = self._storages_by_way(tensors_by_group, plan)
        report = {"sleep_to_ram": self._ram.sleep(_as_tensors(by_way[TO_RAM])).bytes if by_way[TO_RAM] else 0,
                  "sleep_to_disk": self._disk_offloader().sleep(_as_tensors(by_way[TO_DISK])).bytes
                  if by_way[TO_DISK] else 0}
        self._freed = {}
        for way in (DISCARD,) + _REBUILT:
            self._freed[way] = [(s, s.nbytes()) for s in by_way[way]]
            for s, _ in self._freed[way]:
                s.resize_(0)
        self._rebuilders = dict(rebuilders)
        self._plan = plan
        self._asleep = True
        report.update({f"sleep_{w}": sum(n for _, n in self._freed[w]) for w in (DISCARD,) + _REBUILT})
        report["sleep_kept"] = sum(s.nbytes() for s in by_way[KEEP])
        report["sleep_seconds"] = time.perf_counter() - start
        return report

    def _storages_by_way(self, tensors_by_group: dict[str, list], plan: SleepPlan) -> dict[str, list]:
        """Each distinct storage under the way of the first group that names it."""
        seen: set[int] = set()
        out: dict[str, list] = {w: [] for w in (KEEP, DISCARD, TO_RAM, TO_DISK) + _REBUILT}
        for decision in plan.decisions:
            for s in unique_storages(tensors_by_group.get(decision.group, [])):
                if s._cdata in seen:
                    continue
                seen.add(s._cdata)
                out[decision.way].append(s)
        return out

    @torch.no_grad()
    def wake(self) -> dict:
        """Bring every group back: re-allocate, read back RAM and disk, zero the discarded, then rebuild."""
        if not self._asleep:
            return {"skipped": True}
        start = time.perf_counter()
        for freed in self._freed.values():
            for s, nbytes in freed:
                s.resize_(nbytes)
                # defined bytes where a rebuild writes none (a param buffer's alignment padding, zeros
                # when it was made) and the discarded grads' zeros
                s.fill_(0)
        report = {"wake_from_ram": self._ram.wake().bytes,
                  "wake_from_disk": self._disk.wake().bytes if self._disk is not None else 0}
        for way in _REBUILT:
            nbytes = sum(n for _, n in self._freed.get(way, []))
            read = self._rebuilders[way]() if nbytes else 0
            report[f"wake_{way}"] = nbytes
            report[f"wake_{way}_read"] = int(read or 0)  # what the rebuild read to write them (fp32 masters)
        report["wake_discarded_zeroed"] = sum(n for _, n in self._freed.get(DISCARD, []))
        report["wake_seconds"] = time.perf_counter() - start
        self._freed, self._rebuilders, self._asleep = {}, {}, False
        return report

    def close(self, remove_directory: bool = False) -> None:
        """Drop any backup and the disk offloader's directory lock (see StorageOffloader.close)."""
        self._ram.close()
        if self._disk is not None:
            self._disk.close(remove_directory=remove_directory)
        self._freed, self._rebuilders, self._asleep = {}, {}, False


def _as_tensors(storages: list) -> list[torch.Tensor]:
    """Byte tensors over whole storages: what StorageOffloader takes (it dedupes by storage)."""
    return [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),), (1,)) for s in storages]


def stats_of(report: dict, action: str, target: str) -> OffloadStats:
    """The plan's sleep/wake report as the OffloadStats every offloader returns (bytes: what moved)."""
    if report.get("skipped"):
        return OffloadStats(action, target, skipped=True)
    if action == "sleep":
        moved = report["sleep_to_ram"] + report["sleep_to_disk"]
    else:
        moved = (report["wake_from_ram"] + report["wake_from_disk"] + report[f"wake_{FROM_ENGINE}"]
                 + report[f"wake_{FROM_MASTERS}"])
    return OffloadStats(action, target, bytes=moved, seconds=report[f"{action}_seconds"])
