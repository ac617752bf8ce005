"""Trainer offload for sleep, by tensor storage: the torch backend's own torch_memory_saver.

``sleep(tensors)`` copies the bytes of every distinct storage behind ``tensors`` to host memory
(target ``cpu``) or to one file in a directory (target ``disk``), then frees the storage with
``untyped_storage().resize_(0)``. ``wake()`` re-allocates each storage at its old size and copies the
bytes back. Target ``none`` keeps no backup: wake re-allocates the storages with undefined contents,
for a caller that rewrites them all next (a rollout engine whose weights the loop pushes after wake). Every tensor and view keeps pointing at the same storage object, so parameters, optimizer
state and views into them (e.g. a sharded optimizer's ``model_view``) are valid again after wake, with
bit-identical contents.

The disk target owns its directory while it exists: it makes the directory if missing (marked as this
run's), holds :class:`~miles_plugins.host.ownership.DirectoryLock` on it, and
``close(remove_directory=True)`` removes it only if this run made it. A second offloader on the same
directory is refused: two of them would each truncate the other's file and wake with its bytes.

Target ``cpu`` on a GPU copies into page-locked host memory in pieces of :data:`HOST_PIECE_BYTES`, kept
from one sleep to the next (:class:`HostArena`): torch's pinned allocator rounds each allocation up to a
power of two, so a copy per storage would hold up to twice its bytes, and would page-lock anew whenever
the sizes change. The pieces stay until :meth:`StorageOffloader.close` (``host_bytes_held`` says how much).

Storages that are already empty are skipped: the streamed optimizer state (its mains and moments live
in the store's bucket files, their storage resized to 0 between steps) needs no backup. Both calls are
idempotent: sleeping while asleep or waking while awake does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from miles_plugins.optimizers.streaming.config import DEFAULT_CHUNK_MB
from miles_plugins.host.ownership import (
    DirectoryLock,
    claim_directory,
    process_run_id,
    remove_created,
)
from miles_plugins.optimizers.streaming.units import GB

logger = logging.getLogger(__name__)

TARGETS = ("cpu", "disk", "none")
OFFLOAD_FILENAME = "offload.bin"
HOST_PIECE_BYTES = 256 << 20  # a power of two: torch's pinned allocator rounds every allocation up to one


@dataclass
class OffloadStats:
    action: str = ""             # "sleep" or "wake"
    target: str = ""
    skipped: bool = False        # True when the call was a no-op (already asleep / awake)
    storages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    path: Optional[str] = None   # file of the disk target

    @property
    def gbps(self) -> float:
        return self.bytes / GB / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int = 0                          # disk: where its bytes start in the file; cpu on a GPU: in the arena
    host: Optional[torch.Tensor] = None      # cpu, a host storage: its copy (uint8)


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def unique_storages(tensors: Iterable[Optional[torch.Tensor]]) -> list[torch.UntypedStorage]:
    """Distinct non-empty storages behind ``tensors`` (views and tied weights count once), in order."""
    seen: set[int] = set()
    out: list[torch.UntypedStorage] = []
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage._cdata
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out.append(storage)
    return out


def make_resizable(module: torch.nn.Module) -> int:
    """Give every parameter and buffer of ``module`` a resizable storage (sleep frees memory by resizing
    storages to 0 bytes; a tensor backed by an mmap'ed checkpoint or a numpy array cannot be resized).

    Each non-resizable storage is copied ONCE into a fresh storage, and every tensor that viewed it is
    re-pointed at the copy with its old offset, shape and stride, so tied weights (one storage behind
    ``embed_tokens.weight`` and ``lm_head.weight``) stay tied. Call before building the optimizer.
    Returns how many storages were copied.
    """
    tensors = [t for _, t in module.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in module.named_buffers(remove_duplicate=False)]
    replacements: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        old = t.untyped_storage()
        if old.resizable() or old.nbytes() == 0:
            continue
        key = old._cdata
        if key not in replacements:
            replacements[key] = old.clone()  # a plain allocation: resizable
        new = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            replacements[key], t.storage_offset(), t.size(), t.stride())
        t.data = new
    return len(replacements)


class HostArena:
    """Host memory in pieces of ``piece_bytes``, addressed as one range of bytes; grown on demand, never
    shrunk (``pinned``: page-locked, for copies to and from a GPU)."""

    def __init__(self, pinned: bool, piece_bytes: int = HOST_PIECE_BYTES):
        self.pinned = pinned
        self.piece_bytes = piece_bytes
        self.pieces: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return len(self.pieces) * self.piece_bytes

    def reserve(self, nbytes: int) -> None:
        while self.nbytes < nbytes:
            self.pieces.append(torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=self.pinned))

    def _spans(self, offset: int, nbytes: int):
        """(piece, lo, hi, done): bytes [lo, hi) of a piece hold bytes [done, done + hi - lo) of the range."""
        done = 0
        while done < nbytes:
            index, lo = divmod(offset + done, self.piece_bytes)
            hi = min(self.piece_bytes, lo + nbytes - done)
            yield self.pieces[index], lo, hi, done
            done += hi - lo

    def write(self, offset: int, src: torch.Tensor) -> None:
        """Copy the 1-D uint8 ``src`` (any device) to bytes [offset, offset + len) of the arena."""
        for piece, lo, hi, done in self._spans(offset, src.numel()):
            piece[lo:hi].copy_(src[done:done + hi - lo])

    def read(self, offset: int, dst: torch.Tensor) -> None:
        """Copy bytes [offset, offset + len) of the arena into the 1-D uint8 ``dst`` (any device)."""
        for piece, lo, hi, done in self._spans(offset, dst.numel()):
            dst[done:done + hi - lo].copy_(piece[lo:hi])


class StorageOffloader:
    """Sleep/wake a set of tensors by storage. See the module docstring.

    ``run_id`` names the run in the directory's lock and marker (default: this process). ``lock``: a
    lock the caller already holds on ``directory`` (a train actor's on its rank directory), used instead
    of taking one; the caller releases it."""

    def __init__(self, target: str, directory: Optional[str] = None, chunk_mb: int = DEFAULT_CHUNK_MB, *,
                 run_id: Optional[str] = None, lock: Optional[DirectoryLock] = None):
        if target not in TARGETS:
            raise ValueError(f"offload target must be one of {TARGETS}, got {target!r}")
        if target == "disk" and not directory:
            raise ValueError("the disk offload target needs a directory")
        self.target = target
        self.directory = directory
        self.run_id = run_id or process_run_id()
        self._own_lock: Optional[DirectoryLock] = None
        if target == "disk":
            if lock is None:
                self._own_lock = claim_directory(directory, self.run_id, "offload directory")
            elif not lock.held or os.path.abspath(lock.directory) != os.path.abspath(directory):
                raise ValueError(f"the lock passed for offload directory {directory} is "
                                 f"{'on ' + lock.directory if lock.held else 'released'}: pass a held lock on "
                                 "that directory, or none to let the offloader take one")
        self.chunk_bytes = max(1, int(chunk_mb)) * 2**20
        self._saved: list[_Saved] = []
        self._asleep = False
        self._staging: Optional[torch.Tensor] = None
        self._arena: Optional[HostArena] = None  # target cpu, device storages: their pinned copies

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def host_bytes_held(self) -> int:
        """Page-locked host memory this offloader keeps for its copies, asleep or awake."""
        return self._arena.nbytes if self._arena is not None else 0

    @property
    def path(self) -> Optional[str]:
        return os.path.join(self.directory, OFFLOAD_FILENAME) if self.target == "disk" else None

    # ---- sleep --------------------------------------------------------------------------------
    @torch.no_grad()
    def sleep(self, tensors: Iterable[Optional[torch.Tensor]]) -> OffloadStats:
        if self._asleep:
            return OffloadStats("sleep", self.target, skipped=True, path=self.path)
        start = time.perf_counter()
        storages = unique_storages(tensors)
        for s in storages:
            if not s.resizable():
                raise RuntimeError(f"cannot offload a non-resizable storage of {s.nbytes()} bytes (mmap'ed from a "
                                   "checkpoint or backed by numpy): call miles.offload.make_resizable(model) "
                                   "after loading the model and before building the optimizer")
        saved = [_Saved(s, s.nbytes()) for s in storages]
        if self.target == "disk":
            self._write_all(saved)
        elif self.target == "cpu":
            self._copy_to_host(saved)
        for item in saved:
            item.storage.resize_(0)
        self._saved = saved
        self._asleep = True
        return OffloadStats("sleep", self.target, storages=len(saved), bytes=sum(i.nbytes for i in saved),
                            seconds=time.perf_counter() - start, path=self.path)

    def _copy_to_host(self, saved: list[_Saved]) -> None:
        """Host storages: a copy each, freed at wake. Device storages: one after another in the arena."""
        on_device = [item for item in saved if item.storage.device.type != "cpu"]
        if on_device:
            if self._arena is None:
                self._arena = HostArena(pinned=torch.cuda.is_available())
            self._arena.reserve(sum(item.nbytes for item in on_device))
        offset = 0
        for item in saved:
            if item.storage.device.type == "cpu":
                item.host = _byte_view(item.storage).clone()
                continue
            item.offset = offset
            self._arena.write(offset, _byte_view(item.storage))
            offset += item.nbytes

    def _stage(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        return self._staging[:nbytes]

    def _write_all(self, saved: list[_Saved]) -> None:
        path = self.path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                offset = 0
                for item in saved:
                    item.offset = offset
                    src = _byte_view(item.storage)
                    for lo in range(0, item.nbytes, self.chunk_bytes):
                        hi = min(item.nbytes, lo + self.chunk_bytes)
                        if src.device.type == "cpu":
                            chunk = _host_bytes(item.storage, lo, hi)
                        else:
                            stage = self._stage(hi - lo, src.device)
                            stage.copy_(src[lo:hi])
                            chunk = _host_bytes(stage.untyped_storage(), 0, hi - lo)
                        _write_fully(f, chunk)
                    offset += item.nbytes
        except BaseException:
            _unlink(path)
            raise

    # ---- wake ---------------------------------------------------------------------------------
    @torch.no_grad()
    def wake(self) -> OffloadStats:
        if not self._asleep:
            return OffloadStats("wake", self.target, skipped=True, path=self.path)
        start = time.perf_counter()
        saved = self._saved
        for item in saved:
            item.storage.resize_(item.nbytes)
        if self.target == "disk":
            self._read_all(saved)
        elif self.target == "cpu":
            for item in saved:
                if item.host is not None:
                    _byte_view(item.storage).copy_(item.host)
                    item.host = None
                else:
                    self._arena.read(item.offset, _byte_view(item.storage))
        stats = OffloadStats("wake", self.target, storages=len(saved), bytes=sum(i.nbytes for i in saved),
                             seconds=time.perf_counter() - start, path=self.path)
        self._saved = []
        self._asleep = False
        return stats

    def _read_all(self, saved: list[_Saved]) -> None:
        path = self.path
        with open(path, "rb", buffering=0) as f:
            for item in saved:
                dst = _byte_view(item.storage)
                f.seek(item.offset)
                for lo in range(0, item.nbytes, self.chunk_bytes):
                    hi = min(item.nbytes, lo + self.chunk_bytes)
                    if dst.device.type == "cpu":
                        _read_fully(f, _host_bytes(item.storage, lo, hi), path)
                    else:
                        stage = self._stage(hi - lo, dst.device)
                        _read_fully(f, _host_bytes(stage.untyped_storage(), 0, hi - lo), path)
                        dst[lo:hi].copy_(stage)
        _unlink(path)  # disk use is bounded: the file only exists while asleep

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self, remove_directory: bool = False) -> None:
        """Drop any backup (a trainer being torn down while asleep does not wake) and the directory lock
        this offloader took; ``remove_directory``: also remove the directory if this run made it."""
        self._saved = []
        self._asleep = False
        self._staging = None
        self._arena = None
        if self.target != "disk":
            return
        _unlink(self.path)
        if remove_directory:
            left = remove_created(self.directory, self.run_id)
            if left:
                logger.info("offload directory left in place: %s", left)
        if self._own_lock is not None:
            self._own_lock.release()


def _host_bytes(storage: torch.UntypedStorage, lo: int, hi: int) -> memoryview:
    """A writable memoryview of bytes [lo, hi) of a host storage. Not through ``.numpy()``: exporting a
    storage to numpy marks it non-resizable for good, and sleep has to resize it."""
    if hi <= lo:
        return memoryview(b"")
    return memoryview((ctypes.c_char * (hi - lo)).from_address(storage.data_ptr() + lo)).cast("B")


def _write_fully(f, view: memoryview) -> None:
    view = view.cast("B")
    while len(view):
        n = f.write(view)
        view = view[n:]


def _read_fully(f, view: memoryview, path: str) -> None:
    view = view.cast("B")
    while len(view):
        n = f.readinto(view)
        if not n:
            raise IOError(f"offload file {path} ended early: it was truncated or removed while the trainer slept")
        view = view[n:]


def _unlink(path: Optional[str]) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
