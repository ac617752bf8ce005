"""The sleep/wake plan of one train rank: for each group of the trainer's tensors, the cheapest exact
way back at wake, decided from measured numbers (DESIGN.md 4c). Pure: no torch, no I/O.

A sleeping trainer must leave the device room for the rollout engine (its weights, resident at sleep,
and the KV pool it allocates after). Everything the trainer holds comes back at wake by one of:

    keep                  stays on the device (free at sleep and wake): when it fits beside the engine
    rebuild_from_engine   the engine holds a bit-equal copy on this device after the handoff (read back
                          through the inverse of the handoff's layout conversion)
    rebuild_from_masters  the store's fp32 masters cast down, read from host RAM (the store's host tier)
    discard               nothing comes back but zeros: grads, which the next step rebuilds anyway
    to_ram / to_disk      written out at sleep and read back at wake: host RAM while the host has room
                          (the budget the caller measured, by the store's 'auto' accounting), disk for the
                          rest under --offload-train-target=disk; all to RAM under target cpu

Order of preference, cheapest first: keep > engine copy (device) > masters in host RAM (PCIe) > host
RAM > disk. The plan releases only what the engine needs: grads always (free), then groups in that
order, largest first, until the device has room; the rest stays. ``offload-all`` (--offload-train-plan
offload-all) is not a plan: the rank's offloader writes every tensor to the target (miles.backends.sleep).

On a CPU 'device' (the torch backend on CPU) device memory is host memory: a copy to host RAM frees
nothing, so only rebuilds and the disk free anything there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

KEEP = "keep"
FROM_ENGINE = "rebuild_from_engine"
FROM_MASTERS = "rebuild_from_masters"
DISCARD = "discard"
TO_RAM = "to_ram"
TO_DISK = "to_disk"
WAYS = (KEEP, FROM_ENGINE, FROM_MASTERS, DISCARD, TO_RAM, TO_DISK)
RELEASED = (FROM_ENGINE, FROM_MASTERS, DISCARD, TO_RAM, TO_DISK)  # ways that free the device at sleep

# kinds of trainer tensors
WEIGHTS = "weights"
GRADS = "grads"
OPTIMIZER_STATE = "optimizer_state"
OTHER = "other"  # buffers and what no other source holds

# Device memory left free beyond the engine's KV pool: the caching allocator's fragmentation, the engine's
# decode buffers and CUDA graphs. 1 GiB: measured residue of a released embedded engine is far below it.
DEVICE_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class Group:
    """Tensors of one kind that share a way back (the backend builds them with disjoint storages).

    ``engine_copy``: the engine holds a bit-equal copy after the handoff. ``from_masters``: they equal
    the store's fp32 masters cast to their dtype (every element is covered by a master)."""

    name: str
    kind: str
    nbytes: int
    engine_copy: bool = False
    from_masters: bool = False


@dataclass(frozen=True)
class MemoryFacts:
    """What the rank measured at sleep (bytes).

    device_total / device_free: the device now (the trainer awake, the engine's weights resident after
    the handoff). engine_kv: what the engine allocates after the trainer sleeps (its KV pool, decode
    buffers). engine_weights: the engine's weights on this device (released before the trainer wakes).
    host_ram_budget: what this rank may put in host RAM (the store's 'auto' accounting: its share of
    MemAvailable after the node reserve, less what its tier may still grow into). masters_in_host_ram:
    every store's masters live in host RAM. engine_copy_readable: the engine's weights on this device
    can be read by the trainer at wake (None: why not). device_is_host: the 'device' is host memory.
    engine_kv_measured: False when the engine has not said what it allocates (before its first release,
    or sglang): engine_kv is then the whole device."""

    device_total: int
    device_free: int
    engine_kv: int
    engine_weights: int = 0
    host_ram_budget: int = 0
    masters_in_host_ram: bool = False
    engine_copy_unreadable_because: Optional[str] = "no engine copy is readable from the trainer"
    device_is_host: bool = False
    reserve: int = DEVICE_RESERVE_BYTES
    engine_kv_measured: bool = True  # False: engine_kv is the whole device, the engine not having said


@dataclass(frozen=True)
class EngineNeeds:
    """What the driver measured of the colocated rollout engine and promises for the next wake (picklable:
    it travels to every train rank's sleep). ``kv_bytes``: the KV pool it allocates after the trainer sleeps
    (None: not measured, taken as the whole device). ``weight_bytes``: its weights on the device.
    ``copy_at_wake``: the driver hands each rank the engine's weights by reference at the next wake,
    before releasing them (only then may the plan rebuild from them)."""

    kv_bytes: Optional[int] = None
    weight_bytes: int = 0
    copy_at_wake: bool = False


@dataclass(frozen=True)
class Decision:
    group: str
    kind: str
    way: str
    nbytes: int


@dataclass(frozen=True)
class SleepPlan:
    target: str
    decisions: tuple[Decision, ...]
    need_bytes: int = 0       # device bytes the engine needed freed at sleep (0: it fit already)
    shortfall_bytes: int = 0  # of them, what no way could free (the plan released everything it could)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def bytes_by_way(self) -> dict[str, int]:
        out = {way: 0 for way in WAYS}
        for d in self.decisions:
            out[d.way] += d.nbytes
        return out

    def way_of(self, group: str) -> str:
        for d in self.decisions:
            if d.group == group:
                return d.way
        raise KeyError(f"the plan has no group {group!r}: it has {[d.group for d in self.decisions]}")

    @property
    def sleep_moved_bytes(self) -> int:
        """Bytes written out at sleep (to host RAM or disk)."""
        ways = self.bytes_by_way()
        return ways[TO_RAM] + ways[TO_DISK]

    @property
    def wake_moved_bytes(self) -> int:
        """Bytes copied back at wake: rebuilt from the engine or the masters, read from RAM or disk."""
        ways = self.bytes_by_way()
        return ways[FROM_ENGINE] + ways[FROM_MASTERS] + ways[TO_RAM] + ways[TO_DISK]


def check_target(target: str) -> None:
    if target not in ("cpu", "disk"):
        raise ValueError(f"--offload-train-target must be cpu or disk, got {target!r}")


def plan_sleep(groups: list[Group], facts: MemoryFacts, target: str) -> SleepPlan:
    """Each group's way back (see the module docstring): the grads discarded, then the fewest,
    cheapest-to-restore groups released until the engine's KV pool and the reserve fit; a shortfall left
    after releasing everything releasable is reported (``shortfall_bytes``), never hidden. (``offload-all``
    plans nothing: :class:`miles.backends.sleep.OffloadAllSleep` writes every tensor to the target.)"""
    check_target(target)
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"group names must be unique, got {names}")
    return _plan_auto(groups, facts, target)


def _wake_fits_beside_engine(groups: list[Group], facts: MemoryFacts) -> bool:
    """A rebuild from the engine's copy needs the engine's weights resident while the trainer's come
    back: both, plus the reserve, must fit the device at wake."""
    trainer = sum(g.nbytes for g in groups)
    return trainer + facts.engine_weights + facts.reserve <= facts.device_total


def _release_ways(group: Group, facts: MemoryFacts, engine_ok: bool) -> list[str]:
    """The ways that free ``group``'s device bytes, cheapest first."""
    ways = []
    if group.kind == GRADS:
        return [DISCARD]
    if group.engine_copy and engine_ok:
        ways.append(FROM_ENGINE)
    if group.from_masters and facts.masters_in_host_ram:
        ways.append(FROM_MASTERS)
    if not facts.device_is_host:
        ways.append(TO_RAM)
    ways.append(TO_DISK)
    return ways


_COST = {DISCARD: 0, FROM_ENGINE: 1, FROM_MASTERS: 2, TO_RAM: 3, TO_DISK: 4}


def _plan_auto(groups: list[Group], facts: MemoryFacts, target: str) -> SleepPlan:
    notes = []
    engine_ok = facts.engine_copy_unreadable_because is None and _wake_fits_beside_engine(groups, facts)
    if facts.engine_copy_unreadable_because is not None:
        notes.append(f"engine copy not used: {facts.engine_copy_unreadable_because}")
    elif not engine_ok:
        notes.append("engine copy not used: the trainer's tensors and the engine's weights do not fit the device "
                     "together at wake")
    if not facts.masters_in_host_ram and any(g.from_masters for g in groups):
        notes.append("masters not used: not every master is in host RAM")
    if not facts.engine_kv_measured:
        notes.append("the engine's KV pool is not measured (before its first release, or an engine that does not "
                      "say): the engine may take the whole device")
    need = device_need(facts.engine_kv, facts.device_free, facts.reserve)
    ways = {g.name: KEEP for g in groups}
    left = need
    for g in groups:  # grads first: discarding them is free
        if g.kind == GRADS:
            ways[g.name] = DISCARD
            left -= g.nbytes
    ram_left = facts.host_ram_budget
    options = sorted((g for g in groups if g.kind != GRADS and g.nbytes > 0),
                     key=lambda g: (_COST[_release_ways(g, facts, engine_ok)[0]], -g.nbytes))
    for g in options:
        if left <= 0:
            break
        way = _release_ways(g, facts, engine_ok)[0]
        if way == TO_RAM and g.nbytes > ram_left:
            way = TO_DISK  # the host has no room left for it
        if way == TO_DISK and target == "cpu":
            way = TO_RAM  # target cpu: host RAM is where written bytes go, budget or not (today's meaning)
        if way == TO_RAM and facts.device_is_host:
            continue  # a host copy of host memory frees nothing: it stays
        if way == TO_RAM:
            ram_left -= g.nbytes
        ways[g.name] = way
        left -= g.nbytes
    decisions = tuple(Decision(g.name, g.kind, ways[g.name], g.nbytes) for g in groups)
    shortfall = max(0, left)
    if shortfall:
        notes.append(f"{shortfall} bytes short of the engine's need after releasing everything releasable")
    return SleepPlan(target, decisions, need_bytes=need, shortfall_bytes=shortfall, notes=tuple(notes))


def device_need(engine_bytes: int, device_free: int, reserve: int = DEVICE_RESERVE_BYTES) -> int:
    """Device bytes still to free for the engine to allocate ``engine_bytes`` beside ``reserve`` (0: it fits)."""
    return max(0, engine_bytes + reserve - device_free)


def allocator_cache_may_stay(device_free: int, engine: EngineNeeds, engine_weights_resident: bool) -> bool:
    """Whether the trainer's caching allocator may keep its free blocks through the engine's turn: only when
    the engine's measured needs (its KV pool, and its weights when they are still to come back) fit in
    ``device_free`` beside them, by the plan's own rule (:func:`device_need`). Kept, the next forward reuses
    them; emptied, it pays a cudaMalloc per segment again (llama-1b on an H200: forward/backward 0.16 s
    against 0.22 s)."""
    if engine.kv_bytes is None:  # not measured: the engine may take the whole device
        return False
    engine_bytes = engine.kv_bytes + (0 if engine_weights_resident else engine.weight_bytes)
    return device_need(engine_bytes, device_free) == 0


def host_ram_budget(available: Optional[int], reserve: int, ranks_on_node: int, tier_growth: int) -> int:
    """This rank's host RAM for written-out tensors, by the store's 'auto' accounting: its share of the
    node's available memory after the node reserve, less what its host tier may still grow into."""
    if available is None:
        return 0
    return max(0, (available - reserve) // max(1, ranks_on_node) - tier_growth)
