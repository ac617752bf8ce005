"""File and host-memory primitives under the I/O engines: positional vectored reads and writes,
O_DIRECT descriptors, tensor bytes as buffers, aligned (pinned) host buffers. No policy: what to move
when is the engines' business (engine.py, sync.py); only io/ uses this module (others through the stager).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import queue
import threading

import torch

from ..layout import ALIGN_BYTES, align_up

logger = logging.getLogger(__name__)

_IOV_MAX_BYTES = 1 << 30  # one preadv/pwrite moves at most this much (Linux caps a call near 2 GiB)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024  # buffers per call (EINVAL beyond)
NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}  # errnos that mean "no O_DIRECT here"


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def host_buffer(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes.

    Not `tensor.numpy()`: exporting to numpy marks the storage non-resizable, and releasing bucket
    storage relies on resizing it to 0.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


# ---- raw I/O --------------------------------------------------------------------------------------
def pread_into(fd: int, buffers, offset: int) -> None:
    """Fill the memoryviews `buffers` (back to back) from `offset`."""
    _vectored(_preadv, fd, buffers, offset)


def pwrite_all(fd: int, buffers, offset: int) -> None:
    """Write the memoryviews `buffers` back to back at `offset`."""
    _vectored(os.pwritev, fd, buffers, offset)


def _preadv(fd: int, batch, offset: int) -> int:
    n = os.preadv(fd, batch, offset)
    if n == 0:  # a short read resumes; no bytes at all means the file ends before the buffers do
        raise IOError(f"unexpected end of file reading fd {fd} at byte {offset}")
    return n


def _vectored(call, fd: int, buffers, offset: int) -> None:
    """Run `call` (preadv/pwritev) over `buffers` until all their bytes have moved: at most
    _IOV_MAX_BYTES and _IOV_MAX buffers per call, resuming after a short transfer where it stopped."""
    views = [b for b in buffers if len(b)]
    while views:
        batch, size = [], 0
        for v in views:
            if batch and (size + len(v) > _IOV_MAX_BYTES or len(batch) == _IOV_MAX):
                break
            batch.append(v[:_IOV_MAX_BYTES - size])
            size += len(batch[-1])
        n = call(fd, batch, offset)
        offset += n
        while n:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def open_direct(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)


def drop_page_cache(fd: int) -> None:
    """Flush the file's dirty pages and drop its cached ones (benchmarks: the next read is cold)."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def cut_into_chunks(offset: int, tensors: list[torch.Tensor], chunk_bytes: int):
    """Cut the back-to-back bytes of `tensors` at `offset` into chunk-aligned tasks.

    Returns [(file_offset, nbytes, [(uint8 view, start, length), ...])]: several small tensors share one
    chunk (one transfer), a large one spans several chunks. Chunk boundaries fall on multiples of
    chunk_bytes from `offset`, so every chunk of an aligned request starts aligned.
    """
    out, pieces, filled, pos = [], [], 0, offset
    for t in tensors:
        view = as_bytes(t)
        start, total = 0, view.numel()
        while start < total:
            take = min(chunk_bytes - filled, total - start)
            pieces.append((view, start, take))
            filled, start = filled + take, start + take
            if filled == chunk_bytes:
                out.append((pos, filled, pieces))
                pos, pieces, filled = pos + filled, [], 0
    if filled:
        out.append((pos, filled, pieces))
    return out


# ---- host memory ----------------------------------------------------------------------------------
def _cudart():
    try:
        return torch.cuda.cudart()
    except Exception:  # pragma: no cover - builds without the binding
        return None


class HostMemory:
    """Aligned host buffers, pinned where CUDA is: page-locked in place (cudaHostRegister), so a
    buffer is exactly the size asked for (the pinned caching allocator rounds up to a power of two)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._registered: list[int] = []

    def empty(self, nbytes: int) -> torch.Tensor:
        nbytes = align_up(max(nbytes, 1))
        raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
        off = (-raw.data_ptr()) % ALIGN_BYTES
        buf = raw[off:off + nbytes]
        if self.pinned:
            rt = _cudart()
            ok = False
            if rt is not None and hasattr(rt, "cudaHostRegister"):
                ok = int(rt.cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0
            if ok:
                self._registered.append(buf.data_ptr())
            else:
                raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8, pin_memory=True)
                off = (-raw.data_ptr()) % ALIGN_BYTES
                buf = raw[off:off + nbytes]
        return buf

    def map_file(self, fd: int, nbytes: int) -> torch.Tensor:
        """The `nbytes` of the file `fd` as a host tensor (a shared mapping: the tensor and positional I/O
        on `fd` see the same bytes), page-locked in place where CUDA is (left pageable, and logged, where
        the driver refuses to register it)."""
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        buf = torch.frombuffer(mapping, dtype=torch.uint8)
        if self.pinned:
            rt = _cudart()
            if rt is not None and hasattr(rt, "cudaHostRegister") and int(rt.cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0:
                self._registered.append(buf.data_ptr())
            else:
                logger.warning("could not page-lock %d bytes of host RAM for a bucket: its copies to and from the "
                               "device run at pageable speed", nbytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Unregister one buffer `map_file` page-locked (before its memory goes)."""
        ptr = buf.data_ptr()
        if ptr in self._registered:
            self._registered.remove(ptr)
            try:
                _cudart().cudaHostUnregister(ptr)
            except Exception:  # pragma: no cover
                pass

    def close(self) -> None:
        rt = _cudart() if self._registered else None
        for ptr in self._registered:
            try:
                rt.cudaHostUnregister(ptr)
            except Exception:  # pragma: no cover
                pass
        self._registered = []


class _Buffer:
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class StagingPool:
    """`count` chunk buffers, created on first use (a task releases its buffer only after its copies
    to/from the device have completed)."""

    def __init__(self, count: int, nbytes: int, memory: HostMemory):
        self.count, self.nbytes, self.memory = count, nbytes, memory
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._created = 0
        self._lock = threading.Lock()

    def acquire(self) -> _Buffer:
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                create = self._created < self.count
                if create:
                    self._created += 1
            buf = _Buffer(self.memory.empty(self.nbytes)) if create else self._free.get()
        return buf

    def release(self, buf: _Buffer) -> None:
        self._free.put(buf)
