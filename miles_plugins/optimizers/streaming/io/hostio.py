"""File and host-memory primitives under the I/O engines: positional vectored reads and writes,
O_DIRECT descriptors, tensor bytes as buffers, aligned (pinned) host buffers, and the raw disk floor
the engines are measured against. No policy: what to move when is the engines' business (engine.py,
sync.py); only the stager and the engines use this module.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
import time

import torch

ALIGN = 4096
_IOV_MAX_BYTES = 1 << 30  # one preadv/pwrite moves at most this much (Linux caps a call near 2 GiB)
NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}  # errnos that mean "no O_DIRECT here"


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
    _IOV_MAX_BYTES per call, resuming after a short transfer where it stopped."""
    views = [b for b in buffers if len(b)]
    while views:
        batch, size = [], 0
        for v in views:
            if size + len(v) > _IOV_MAX_BYTES and batch:
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
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        off = (-raw.data_ptr()) % ALIGN
        buf = raw[off:off + nbytes]
        if self.pinned:
            rt = _cudart()
            ok = False
            if rt is not None and hasattr(rt, "cudaHostRegister"):
                ok = int(rt.cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0
            if ok:
                self._registered.append(buf.data_ptr())
            else:
                raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
                off = (-raw.data_ptr()) % ALIGN
                buf = raw[off:off + nbytes]
        return buf

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


# ---- raw floor (benchmarks) -----------------------------------------------------------------------
def raw_floor(paths_and_ranges: list[tuple[str, int, int]], write_path: str, write_bytes: int, chunk_bytes: int,
              threads: int = 2, direct: bool = True, concurrent: bool = True) -> dict:
    """Time the disk alone: read the given (path, offset, nbytes) ranges and write `write_bytes` to
    `write_path` (preallocated by the caller), in chunk_bytes requests from aligned buffers, `threads`
    readers and `threads` writers, O_DIRECT where allowed (buffered writes end with fdatasync, buffered
    reads are preceded by dropping those pages from the page cache). concurrent: reads and writes at
    once (as the pipelined step does); otherwise all reads, then all writes. No compute, no device."""
    memory = HostMemory(pinned=False)
    fds: dict[str, tuple[int, bool]] = {}

    def fd_for(path):
        if path not in fds:
            fd, is_direct = -1, False
            if direct:
                try:
                    fd, is_direct = open_direct(path), True
                except OSError as e:
                    if e.errno not in NO_DIRECT:
                        raise
            if fd < 0:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            fds[path] = (fd, is_direct)
        return fds[path]

    read_tasks = []
    for path, off, n in paths_and_ranges:
        for pos in range(0, n, chunk_bytes):
            read_tasks.append((path, off + pos, min(chunk_bytes, n - pos)))
    write_tasks = [(write_path, pos, min(chunk_bytes, write_bytes - pos)) for pos in range(0, write_bytes, chunk_bytes)]
    for path in {p for p, _, _ in read_tasks} | ({write_path} if write_tasks else set()):
        fd, is_direct = fd_for(path)
        if not is_direct:
            drop_page_cache(fd)
    errors: list[BaseException] = []
    largest = max([n for _, _, n in read_tasks + write_tasks], default=1)
    buffers = [memory.empty(largest) for _ in range(2 * threads)]  # allocated and touched before the clock
    for buf in buffers:
        buf.fill_(7)

    def worker(tasks, op, lock, buf):
        try:
            while True:
                with lock:
                    if not tasks:
                        return
                    path, off, n = tasks.pop()
                fd, is_direct = fd_for(path)
                m = align_up(n) if is_direct else n
                (pread_into if op == "read" else pwrite_all)(fd, [host_buffer(buf[:m])], off)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def run(groups):
        threads_ = []
        for g, (tasks, op) in enumerate(groups):
            lock = threading.Lock()
            threads_ += [threading.Thread(target=worker, args=(tasks, op, lock, buffers[g * threads + i]))
                         for i in range(threads)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()

    read_list, write_list = list(reversed(read_tasks)), list(reversed(write_tasks))
    t0 = time.perf_counter()
    if concurrent:
        run([(read_list, "read"), (write_list, "write")])
        t_read = t_write = None
    else:
        run([(read_list, "read")])
        t_read = time.perf_counter() - t0
        run([(write_list, "write")])
        t_write = time.perf_counter() - t0 - t_read
    for fd, is_direct in fds.values():
        if not is_direct:
            os.fdatasync(fd)
    seconds = time.perf_counter() - t0
    any_direct = any(d for _, d in fds.values())
    for fd, _ in fds.values():
        os.close(fd)
    if errors:
        raise errors[0]
    return {"seconds": seconds, "read_seconds": t_read, "write_seconds": t_write, "direct": any_direct,
            "bytes_read": sum(n for _, _, n in read_tasks), "bytes_written": write_bytes}
