"""The pipelined engine's host cache: whole-file images in host RAM under a byte budget.

A write to a file with an image fills the image (write-through; the device buffer is free as soon as the
copy lands, at PCIe speed) and writes the file from it in the background, on the write-behind threads,
only while no disk read is in flight (the step's reads come first; the writes land during the next
forward/backward). A read of a range the image holds is served from RAM. Files get images at their
first write while the budget lasts and keep them: a fixed set of hot buckets skips the disk read every
step and has its disk write hidden behind the next forward/backward. The engine (engine.py) does the
copies and the I/O; this module only decides which file has which image and what it holds.
"""

from __future__ import annotations

import threading

import torch

from .hostio import HostMemory, align_up
from .tickets import Ticket


class _Slot:
    def __init__(self, image: torch.Tensor):
        self.image = image
        self.capacity = image.numel()
        self.owner: FileState | None = None
        self.valid: list[tuple[int, int]] = []  # sorted, disjoint byte ranges the image holds
        self.pins = 0  # tasks in flight that use the image

    def covers(self, start: int, stop: int) -> bool:
        return any(a <= start and stop <= b for a, b in self.valid)

    def mark_valid(self, start: int, stop: int) -> None:
        spans = sorted(self.valid + [(start, stop)])
        merged = [spans[0]]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.valid = merged


class HostCache:
    """Whole-file images under a byte budget. A file gets an image at a write while the budget lasts
    and keeps it (images are never taken from one file for another: every bucket is read once per step,
    so evicting one image for another only trades a hit for a hit and adds a read; with the order
    alternating every step, a fixed set of hot buckets is served from RAM every step). drop() frees them
    all (the files changed behind the engine's back)."""

    def __init__(self, budget: int, memory: HostMemory):
        self.budget = max(0, int(budget))
        self.memory = memory
        self.slots: list[_Slot] = []
        self.used = 0
        self._lock = threading.Lock()

    def slot_for_write(self, state: "FileState", nbytes: int) -> _Slot | None:
        if self.budget <= 0:
            return None
        slot = state.slot
        if slot is None:
            with self._lock:
                free = [s for s in self.slots if s.owner is None and s.capacity >= nbytes and s.pins == 0]
            if free:
                slot = min(free, key=lambda s: s.capacity)
            elif self.used + align_up(nbytes) <= self.budget:
                slot = _Slot(self.memory.empty(nbytes))
                self.used += slot.capacity
                self.slots.append(slot)
            else:
                return None
            slot.owner, slot.valid = state, []
            state.slot = slot
        return slot

    def pin(self, slot: _Slot) -> None:
        with self._lock:
            slot.pins += 1

    def unpin(self, slot: _Slot) -> None:
        with self._lock:
            slot.pins -= 1

    def release(self, state: "FileState") -> None:
        """The file is going away: its image (no task may still use it) becomes free for another file."""
        slot = state.slot
        if slot is not None:
            with self._lock:
                slot.owner, slot.valid = None, []
            state.slot = None

    def drop(self) -> None:
        """Forget every image's contents (the files changed behind the engine's back); keep the memory."""
        for slot in self.slots:
            if slot.owner is not None:
                slot.owner.slot = None
            slot.owner, slot.valid = None, []


class FileState:
    """Requests in flight on one file, and its host-cache image. It holds the file object itself: the
    engine finds states by id(file), and an id cannot be reused while its object is alive."""

    __slots__ = ("file", "reads", "writes", "slot")

    def __init__(self, file):
        self.file = file
        self.reads: list[Ticket] = []
        self.writes: list[Ticket] = []
        self.slot: _Slot | None = None

    def prune(self) -> None:
        self.reads = [t for t in self.reads if not t.done()]
        self.writes = [t for t in self.writes if not t.done()]
