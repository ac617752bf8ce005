"""The pipelined engine's host tier: whole-file images in host RAM under a byte budget, write-back.

A write to a file with an image lands in the image only (a host copy at PCIe speed; the device buffer
is free once it lands) and marks the chunks it wrote dirty; the disk is not touched. A read of a range
the image holds is served from RAM. So when the budget holds every bucket, a step reads and writes no
disk at all. Dirty chunks reach the file only when someone needs the file to hold them
(engine.write_back_images: store.flush, store.save_to), when the image is dropped or its file closed
with its contents kept (drop_cache, set_engine, forget; a load drops them unwritten: it rewrites the
files), and when a read or a partial write needs the file's bytes under them. Files get images at
their first write while the budget lasts (or from engine.fill_image, after a load) and keep them.
A bucket that lives in host RAM only (the store places the buckets its tier can hold there when it is
built: BucketFile.home, an anonymous memory file, never on disk) has a home slot instead: its whole
image is always valid, nothing of it is ever dirty or dropped, and it takes nothing from the pool.
The engine (engine.py) does the copies and the I/O; this module only decides which file has which
image, what it holds and which of its chunks the file lacks.
"""

from __future__ import annotations

import threading

import torch

from .hostio import HostMemory, align_up
from .tickets import Ticket, overlap


class _Slot:
    def __init__(self, image: torch.Tensor, home: bool = False):
        self.image = image
        self.capacity = image.numel()
        # home: the image is the bucket's own storage (a bucket that lives in host RAM only, its BucketFile's
        # `home`), not a copy of a file: never dirty, since there is no disk to write back to, and never
        # dropped or given to another file; it is not part of the tier's pool (HostCache.slots)
        self.home = home
        self.owner: FileState | None = None
        self.valid: list[tuple[int, int]] = []  # sorted, disjoint byte ranges the image holds
        # Chunks written into the image and not yet to the file: offset -> (nbytes, pad). Kept in the
        # engine's transfer chunks (cut_into_chunks of the write), so the write-back moves, and verify
        # checksums, exactly the chunks a read of the same segment cuts.
        self.dirty: dict[int, tuple[int, bool]] = {}
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

    def dirty_in(self, span: tuple[int, int] | None = None) -> list[tuple[int, int, bool]]:
        """Dirty chunks (offset, nbytes, pad) overlapping `span` (None: all of them)."""
        return [(o, n, p) for o, (n, p) in sorted(self.dirty.items())
                if span is None or overlap((o, o + n), span)]

    def take_dirty(self, span: tuple[int, int] | None = None) -> list[tuple[int, int, bool]]:
        """Dirty chunks overlapping `span` (None: all), now marked clean: the caller writes them back."""
        chunks = self.dirty_in(span)
        for o, _, _ in chunks:
            del self.dirty[o]
        return chunks

    def mark_dirty(self, offset: int, nbytes: int, pad: bool) -> None:
        """A write puts these bytes into the image. Dirty chunks it covers whole are replaced; the engine
        writes back any it overlaps only in part before the write (their other bytes are still dirty)."""
        if self.home:
            return
        for o, n, _ in self.dirty_in((offset, offset + nbytes)):
            del self.dirty[o]
        self.dirty[offset] = (nbytes, pad)


class HostCache:
    """Whole-file images under a byte budget. A file gets an image at a write while the budget lasts
    and keeps it (images are never taken from one file for another: every bucket is read once per step,
    so evicting one image for another only trades a hit for a hit and adds a read and a write; with the
    order alternating every step, a fixed set of hot buckets is served from RAM every step). drop()
    forgets them all; the engine writes their dirty chunks back first (drop_cache)."""

    def __init__(self, budget: int, memory: HostMemory):
        self.budget = max(0, int(budget))
        self.memory = memory
        self.slots: list[_Slot] = []
        self.used = 0
        self._lock = threading.Lock()

    def slot_for_write(self, state: "FileState", nbytes: int) -> _Slot | None:
        slot = state.slot
        if slot is not None and slot.home:  # a RAM bucket's own memory takes nothing from the pool's budget
            return slot
        if self.budget <= 0:
            return None
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
            slot.owner, slot.valid, slot.dirty = state, [], {}
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
                slot.owner, slot.valid, slot.dirty = None, [], {}
            state.slot = None

    def drop(self) -> None:
        """Forget every image's contents, dirty chunks included (written back first, or discarded on
        purpose); keep the memory."""
        for slot in self.slots:
            if slot.owner is not None:
                slot.owner.slot = None
            slot.owner, slot.valid, slot.dirty = None, [], {}


class FileState:
    """Requests in flight on one file, and its host-cache image. It holds the file object itself: the
    engine finds states by id(file), and an id cannot be reused while its object is alive."""

    __slots__ = ("file", "reads", "writes", "slot")

    def __init__(self, file):
        self.file = file
        self.reads: list[Ticket] = []
        self.writes: list[Ticket] = []
        self.slot: _Slot | None = None
        if file.home is not None:  # a bucket in host RAM only: every byte of it is in its image, always
            self.slot = _Slot(file.home, home=True)
            self.slot.owner, self.slot.valid = self, [(0, file.nbytes)]

    def prune(self) -> None:
        self.reads = [t for t in self.reads if not t.done()]
        self.writes = [t for t in self.writes if not t.done()]
