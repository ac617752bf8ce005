"""The I/O engines behind the stager: how bucket bytes move between the files, host memory and the device.

stager.py owns an engine and is its only user; together they are the only code that touches files and
host memory. Both engines take the same requests, "put the bytes at file offset `o` into these tensors"
(read) and "put these tensors' bytes, back to back, at file offset `o`" (write), and hand back a
`Ticket` per request.

sync       The seed's path, kept as the in-run baseline: the calling thread does every pread/pwrite,
           buffered, through one staging buffer (device tensors) or straight from the tensor's memory
           (CPU tensors). Tickets come back finished.

pipelined  Requests are cut into chunk-sized tasks (small shards of one request are packed into the same
           chunk) and run by worker threads: `threads` readers, `threads` writers, and `threads` more
           for write-behind from the host cache, so reads of the buckets ahead, writes of the buckets
           behind and the update of the current bucket all overlap. Worker threads spend their time in
           preadv/pwritev, torch copies and CUDA event waits, all of which release the GIL. Host side:
             staging    2 x (threads + 1) buffers of chunk_bytes, 4 KiB aligned, pinned where CUDA is
                        (cudaHostRegister'ed, so sizes are exact). A read task: file -> staging -> device
                        (H2D on its own CUDA stream after an event recorded on the compute stream when the
                        destination was allocated; the worker waits for the copy's event); a write task:
                        device -> staging (D2H on its own stream, after an event recorded on the compute
                        stream once the bucket's update and publish were queued) -> file.
                        CPU tensors with buffered I/O skip staging (preadv/pwritev into/from their memory).
             O_DIRECT   where the filesystem supports it (`direct=None` probes, one log line on
                        fallback): offsets are 4 KiB aligned (layout.py), staging is aligned, and tail
                        lengths are padded within the segment's reserved aligned space (reads always,
                        writes when the caller says the tail is reserved: `pad_tail`). Anything else
                        unaligned goes through the buffered descriptor of the same file.
             host cache optional budget (`host_cache_bytes`) of whole-file images. A write to a file
                        with an image fills the image (write-through; the device buffer is free as soon as
                        the copy lands, at PCIe speed) and writes the file from it in the background, on
                        the write-behind threads, only while no disk read is in flight (the step's reads
                        come first; the writes land during the next forward/backward). A read of a range
                        the image holds is served from RAM. Files get images at their first write while
                        the budget lasts and keep them: a fixed set of hot buckets skips the disk read
                        every step and has its disk write hidden behind the next forward/backward.

Ordering: a read of a file waits (in the worker, not the caller) for that file's earlier writes of the
same bytes: until they are in the file, or only until they are in the host image when the read is
served from it. A write waits for the file's earlier reads and writes of the same bytes. Every write calls `file.before_write()` first (a
background checkpoint copies the file's bytes before they change). Errors raised in a worker are kept
on the ticket and raised by whoever waits on it; tasks that depend on a failed ticket fail too.

Ticket levels: `consumed` (a write no longer needs its source tensors: their storage may be released)
and `finished` (the bytes are in the file / in the destination tensors). Whoever waits for a write to
be finished runs its not-yet-started background part itself, so no wait depends on idle threads.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ALIGN = 4096
ENGINES = ("pipelined", "sync")
_IOV_MAX_BYTES = 1 << 30  # one preadv/pwrite moves at most this much (Linux caps a call near 2 GiB)
_NO_DIRECT = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


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


@dataclass
class IOCounters:
    bytes_read: int = 0        # requested by reads (from the files or the host cache)
    bytes_written: int = 0     # requested by writes
    cache_bytes_read: int = 0  # of bytes_read, served from the host cache
    read_seconds: float = 0.0  # time spent in read tasks (summed over worker threads)
    write_seconds: float = 0.0


# ---- tickets --------------------------------------------------------------------------------------
class Ticket:
    """One request, cut into `chunks` tasks. See the module docstring for the two levels."""

    def __init__(self, kind: str, chunks: int, holds: list):
        self.kind = kind
        self.consumed = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._unconsumed = chunks
        self._unfinished = chunks
        self._holds = holds  # tensors kept alive until the request is finished
        self._deferred: list[_Deferred] = []  # background parts not started yet (stealable by waiters)
        self.span = (0, 0)  # file bytes the request touches (padded to 4 KiB)
        if chunks == 0:
            self.consumed.set()
            self.finished.set()
            self._holds = None

    def _consume(self) -> None:
        with self._lock:
            self._unconsumed -= 1
            if self._unconsumed == 0:
                self.consumed.set()

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._unfinished -= 1
            done = self._unfinished == 0
        if done:
            self._holds = None
            self.finished.set()

    def _run_deferred(self) -> None:
        """Whoever needs this request finished runs its background parts now instead of waiting for
        the writer threads to get to them (they yield to reads): no wait can depend on idle threads."""
        for task in list(self._deferred):
            task.run()

    def wait(self, level: str = "finished") -> None:
        """Block until `level`; raise the error of any failed task. A finished read's bytes are in its
        destination tensors (on CUDA: the H2D copies have completed)."""
        if level == "finished":
            self._run_deferred()
        (self.consumed if level == "consumed" else self.finished).wait()
        if self.error is not None and (level == "finished" or self.finished.is_set()):
            raise self.error

    def done(self, level: str = "finished") -> bool:
        return (self.consumed if level == "consumed" else self.finished).is_set()

    def _wait_dependency(self, level: str) -> None:
        """Used by worker tasks: a failed dependency fails the task."""
        if level == "finished":
            self._run_deferred()
        (self.consumed if level == "consumed" else self.finished).wait()
        if self.error is not None:
            raise IOError(f"an earlier I/O request on the same file failed: {self.error!r}") from self.error


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _finished_ticket(kind: str) -> Ticket:
    return Ticket(kind, 0, [])


class _Deferred:
    """A background task that runs exactly once: by a writer thread when the disk has no reads to
    serve, or by whoever waits for its request first."""

    __slots__ = ("_fn", "_lock", "_started")

    def __init__(self, fn):
        self._fn, self._lock, self._started = fn, threading.Lock(), False

    def run(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        self._fn()


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
        self.nbytes = 0

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
        self.nbytes += nbytes
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


class _StagingPool:
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


# ---- host cache -----------------------------------------------------------------------------------
class _Slot:
    def __init__(self, image: torch.Tensor):
        self.image = image
        self.capacity = image.numel()
        self.owner: _FileState | None = None
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

    def slot_for_write(self, state: "_FileState", nbytes: int) -> _Slot | None:
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

    def drop(self) -> None:
        """Forget every image's contents (the files changed behind the engine's back); keep the memory."""
        for slot in self.slots:
            if slot.owner is not None:
                slot.owner.slot = None
            slot.owner, slot.valid = None, []


class _FileState:
    """Requests in flight on one file, and its host-cache image."""

    __slots__ = ("reads", "writes", "slot")

    def __init__(self):
        self.reads: list[Ticket] = []
        self.writes: list[Ticket] = []
        self.slot: _Slot | None = None

    def prune(self) -> None:
        self.reads = [t for t in self.reads if not t.done()]
        self.writes = [t for t in self.writes if not t.done()]


# ---- raw I/O --------------------------------------------------------------------------------------
def pread_into(fd: int, buffers, offset: int) -> None:
    """Fill the memoryviews `buffers` (back to back) from `offset`."""
    views = [b for b in buffers if len(b)]
    while views:
        batch, size = [], 0
        for v in views:
            if size + len(v) > _IOV_MAX_BYTES and batch:
                break
            batch.append(v[:_IOV_MAX_BYTES - size])
            size += len(batch[-1])
        n = os.preadv(fd, batch, offset)
        if n == 0:
            raise IOError(f"unexpected end of file reading fd {fd} at byte {offset}")
        offset += n
        while n:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def pwrite_all(fd: int, buffers, offset: int) -> None:
    """Write the memoryviews `buffers` back to back at `offset`."""
    views = [b for b in buffers if len(b)]
    while views:
        batch, size = [], 0
        for v in views:
            if size + len(v) > _IOV_MAX_BYTES and batch:
                break
            batch.append(v[:_IOV_MAX_BYTES - size])
            size += len(batch[-1])
        n = os.pwritev(fd, batch, offset)
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


def _chunks(offset: int, tensors: list[torch.Tensor], chunk_bytes: int):
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


# ---- the synchronous engine (the seed's path) -----------------------------------------------------
class SyncEngine:
    """Synchronous chunked I/O through one staging buffer (pinned only where CUDA exists), buffered.

    CPU tensors are read into and written from their own memory directly: staging would only add a
    copy. Device tensors move in chunk_bytes pieces: disk <-> staging <-> device, always as same-dtype
    bytes (a copy into a differently typed host view takes no DMA path).
    """

    name = "sync"
    direct = False

    def __init__(self, device: torch.device, chunk_bytes: int):
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.counters = IOCounters()
        self._staging = None
        if self.device.type != "cpu":
            self._staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    @property
    def staging_bytes(self) -> int:
        return 0 if self._staging is None else self.chunk_bytes

    def expect_files(self, max_nbytes: int) -> None:
        self._expected_file_bytes = max_nbytes

    def read(self, file, offset: int, dsts: list[torch.Tensor]) -> Ticket:
        start = time.perf_counter()
        for dst in dsts:
            dst_bytes = as_bytes(dst)
            total = dst_bytes.numel()
            if self._staging is None:
                pread_into(file.fd, [host_buffer(dst_bytes)], offset)
            else:
                for pos in range(0, total, self.chunk_bytes):
                    n = min(self.chunk_bytes, total - pos)
                    pread_into(file.fd, [host_buffer(self._staging[:n])], offset + pos)
                    dst_bytes[pos:pos + n].copy_(self._staging[:n])
            offset += total
            self.counters.bytes_read += total
        self.counters.read_seconds += time.perf_counter() - start
        return _finished_ticket("read")

    def write(self, file, offset: int, srcs: list[torch.Tensor], pad_tail: bool = False) -> Ticket:
        if file.before_write is not None:
            file.before_write()
        start = time.perf_counter()
        views = [as_bytes(t) for t in srcs]
        total = sum(v.numel() for v in views)
        if self._staging is None:
            pwrite_all(file.fd, [host_buffer(v) for v in views], offset)
        else:
            filled, written = 0, 0
            for view in views:
                pos = 0
                while pos < view.numel():
                    n = min(self.chunk_bytes - filled, view.numel() - pos)
                    self._staging[filled:filled + n].copy_(view[pos:pos + n])
                    filled, pos = filled + n, pos + n
                    if filled == self.chunk_bytes:
                        pwrite_all(file.fd, [host_buffer(self._staging)], offset + written)
                        written, filled = written + filled, 0
            if filled:
                pwrite_all(file.fd, [host_buffer(self._staging[:filled])], offset + written)
        self.counters.bytes_written += total
        self.counters.write_seconds += time.perf_counter() - start
        return _finished_ticket("write")

    # Nothing is ever in flight; errors raise in the caller.
    def check(self) -> None:
        pass

    def pending(self, file, kind: str) -> list[Ticket]:
        return []

    def is_cached(self, file, offset: int, nbytes: int) -> bool:
        return False

    def wait_all(self, raise_errors: bool = True) -> None:
        pass

    def drop_cache(self) -> None:
        pass

    def forget(self, file) -> None:
        pass

    def close(self) -> None:
        self._staging = None


# ---- the pipelined engine -------------------------------------------------------------------------
class _Workers:
    """Threads over a FIFO of urgent tasks and a FIFO of background tasks; a background task starts
    only when no urgent one is queued and `idle()` says the disk has no reads to serve."""

    def __init__(self, name: str, count: int, device: torch.device, idle=lambda: True):
        self._cv = threading.Condition()
        self._urgent: collections.deque = collections.deque()
        self._background: collections.deque = collections.deque()
        self._idle = idle
        self._closing = False
        self._device = device
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for t in self._threads:
            t.start()

    def _next(self):
        with self._cv:
            while True:
                if self._urgent:
                    return self._urgent.popleft()
                if self._background and (self._closing or self._idle()):
                    return self._background.popleft()
                if self._closing:
                    return None
                self._cv.wait(timeout=0.1 if self._background else None)

    def _loop(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            task = self._next()
            if task is None:
                return
            task()

    def submit(self, task, background: bool = False) -> None:
        with self._cv:
            (self._background if background else self._urgent).append(task)
            self._cv.notify()

    def poke(self) -> None:
        """The disk may be idle now: background tasks may start."""
        with self._cv:
            if self._background:
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=60)


class PipelinedEngine:
    name = "pipelined"

    def __init__(self, device: torch.device, chunk_bytes: int, threads: int = 2, direct: bool | None = None,
                 host_cache_bytes: int = 0):
        if threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {threads}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.chunk_bytes = chunk_bytes
        self.threads = threads
        self.counters = IOCounters()
        self.error: BaseException | None = None  # the first error of any task: the engine is broken after it
        self._want_direct = direct
        self.direct = direct is not False  # until a probe says otherwise
        self._direct_reported = False
        self._lock = threading.Lock()
        self._files: dict[int, _FileState] = {}
        self._memory = HostMemory(pinned=self.cuda)
        self._read_staging = _StagingPool(threads + 1, chunk_bytes, self._memory)
        self._write_staging = _StagingPool(threads + 1, chunk_bytes, self._memory)
        self.cache = HostCache(host_cache_bytes, self._memory)
        if self.cuda:
            self._h2d = torch.cuda.Stream(self.device)
            self._d2h = torch.cuda.Stream(self.device)
        self._disk_reads = 0  # disk read tasks submitted and not finished: write-behind yields to them
        self._readers = _Workers("miles-io-read", threads, self.device)
        self._writers = _Workers("miles-io-write", threads, self.device)
        # Write-behind of host images to the files runs on its own threads (a fill never waits behind a
        # long background pwrite) and only while the disk has no reads to serve.
        self._behind = _Workers("miles-io-behind", threads, self.device, idle=lambda: self._disk_reads == 0)
        self._closed = False

    @property
    def staging_bytes(self) -> int:
        """Host staging this engine may allocate (pinned where CUDA is), not counting the host cache."""
        return self._read_staging.count * self._read_staging.nbytes + self._write_staging.count * self._write_staging.nbytes

    def expect_files(self, max_nbytes: int) -> None:
        """No request is larger than the largest file: staging buffers need not exceed it."""
        self._expected_file_bytes = max_nbytes
        nbytes = min(self.chunk_bytes, align_up(max(max_nbytes, 1)))
        self._read_staging.nbytes = self._write_staging.nbytes = nbytes

    # ---- files ------------------------------------------------------------------------------------
    def _state(self, file) -> _FileState:
        state = self._files.get(id(file))
        if state is None:
            state = self._files[id(file)] = _FileState()
        state.prune()
        return state

    def _dfd(self, file) -> int:
        """The file's O_DIRECT descriptor (opened on first use), or -1 where direct I/O is off."""
        if not self.direct:
            return -1
        if getattr(file, "dfd", -1) >= 0:
            return file.dfd
        try:
            file.dfd = open_direct(file.path)
        except OSError as e:
            if e.errno not in _NO_DIRECT:
                raise
            self._direct_unsupported(file.path, e)
            return -1
        if not self._direct_reported:
            self._direct_reported = True
            logger.info("optimizer-state I/O uses O_DIRECT (%s)", os.path.dirname(file.path))
        return file.dfd

    def _direct_unsupported(self, path: str, error: OSError) -> None:
        with self._lock:
            if not self.direct:
                return
            self.direct = False
        level = logging.WARNING if self._want_direct else logging.INFO
        logger.log(level, "O_DIRECT is not supported for %s (%s): falling back to buffered I/O",
                   os.path.dirname(path), os.strerror(error.errno) if error.errno else error)

    def forget(self, file) -> None:
        self._files.pop(id(file), None)

    # ---- requests ---------------------------------------------------------------------------------
    def read(self, file, offset: int, dsts: list[torch.Tensor]) -> Ticket:
        self._check_open()
        state = self._state(file)
        chunks = _chunks(offset, dsts, self.chunk_bytes)
        total = sum(c[1] for c in chunks)
        slot = state.slot if state.slot is not None and state.slot.covers(offset, offset + total) else None
        level = "consumed" if slot is not None else "finished"
        span = (offset, align_up(offset + total))
        deps = [(t, level) for t in state.writes if _overlap(t.span, span)]
        ready = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        dfd = self._dfd(file) if slot is None else -1
        ticket = Ticket("read", len(chunks), list(dsts))
        ticket.span = span
        for chunk in chunks:
            if slot is not None:
                self.cache.pin(slot)
            else:
                with self._lock:
                    self._disk_reads += 1
            self._readers.submit(lambda c=chunk: self._read_task(file, dfd, ticket, c, deps, ready, slot))
        state.reads.append(ticket)
        self.counters.bytes_read += total
        if slot is not None:
            self.counters.cache_bytes_read += total
        return ticket

    def write(self, file, offset: int, srcs: list[torch.Tensor], pad_tail: bool = False) -> Ticket:
        self._check_open()
        if file.before_write is not None:
            file.before_write()
        state = self._state(file)
        chunks = _chunks(offset, srcs, self.chunk_bytes)
        total = sum(c[1] for c in chunks)
        span = (offset, align_up(offset + total))
        deps = [(t, "finished") for t in state.writes + state.reads if _overlap(t.span, span)]
        slot = self.cache.slot_for_write(state, file.nbytes) if chunks else None
        if slot is not None:
            slot.mark_valid(offset, offset + total)
        ready = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        dfd = self._dfd(file)
        ticket = Ticket("write", len(chunks), list(srcs))
        ticket.span = span
        last = len(chunks) - 1
        for i, chunk in enumerate(chunks):
            if slot is not None:
                self.cache.pin(slot)
            pad = pad_tail and i == last
            self._writers.submit(lambda c=chunk, p=pad: self._write_task(file, dfd, ticket, c, deps, ready, slot, p))
        state.writes.append(ticket)
        self.counters.bytes_written += total
        return ticket

    def pending(self, file, kind: str) -> list[Ticket]:
        state = self._files.get(id(file))
        if state is None:
            return []
        state.prune()
        return list(state.reads if kind == "read" else state.writes)

    def is_cached(self, file, offset: int, nbytes: int) -> bool:
        state = self._files.get(id(file))
        return state is not None and state.slot is not None and state.slot.covers(offset, offset + nbytes)

    def wait_all(self, raise_errors: bool = True) -> None:
        """Wait for every request in flight; raise the first error (after all have ended)."""
        first = None
        for state in list(self._files.values()):
            for t in state.reads + state.writes:
                try:
                    t.wait()
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    first = first or e
            state.prune()
        if first is not None and raise_errors:
            raise first

    def drop_cache(self) -> None:
        self.cache.drop()

    def close(self) -> None:
        if self._closed:
            return
        self.wait_all(raise_errors=False)
        self._closed = True
        self._readers.close()
        self._writers.close()
        self._behind.close()
        self._memory.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the I/O engine is closed")
        self.check()

    def check(self) -> None:
        """Raise if any task has failed (a write that failed after its caller stopped waiting, say)."""
        if self.error is not None:
            raise IOError(f"optimizer-state I/O failed earlier: {self.error!r}") from self.error

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    # ---- tasks (worker threads) -------------------------------------------------------------------
    def _read_task(self, file, dfd, ticket, chunk, deps, ready, slot) -> None:
        file_off, n, pieces = chunk
        error = None
        try:
            for dep, level in deps:
                dep._wait_dependency(level)
            t0 = time.perf_counter()
            if slot is not None:
                self._copy_in(slot.image[file_off:file_off + n], pieces, ready)
            elif not self.cuda and dfd < 0:
                pread_into(file.fd, [host_buffer(v[s:s + k]) for v, s, k in pieces], file_off)
            else:
                buf = self._read_staging.acquire()
                try:
                    self._transfer("read", file, dfd, buf.tensor, file_off, n, pad=True)
                    self._copy_in(buf.tensor[:n], pieces, ready)
                finally:
                    self._read_staging.release(buf)
            with self._lock:
                self.counters.read_seconds += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised by whoever waits on the ticket
            error = e
            self._failed(e)
        finally:
            if slot is not None:
                self.cache.unpin(slot)
            else:
                with self._lock:
                    self._disk_reads -= 1
                    idle = self._disk_reads == 0
                if idle:
                    self._behind.poke()
            ticket._consume()
            ticket._finish(error)

    def _write_task(self, file, dfd, ticket, chunk, deps, ready, slot, pad) -> None:
        file_off, n, pieces = chunk
        consumed, error, deferred = False, None, False
        try:
            for dep, level in deps:
                dep._wait_dependency(level)
            t0 = time.perf_counter()
            if slot is not None:
                # write-behind: the bytes are in host RAM now (the source may be released); the disk
                # write runs in the background, when the disk has no reads to serve
                self._copy_out(pieces, slot.image[file_off:file_off + n], ready)
                ticket._consume()
                consumed = True
                task = _Deferred(lambda: self._slot_write(file, dfd, ticket, slot, file_off, n, pad))
                ticket._deferred.append(task)
                deferred = True
                self._behind.submit(task.run, background=True)
            elif not self.cuda and dfd < 0:
                pwrite_all(file.fd, [host_buffer(v[s:s + k]) for v, s, k in pieces], file_off)
            else:
                buf = self._write_staging.acquire()
                try:
                    self._copy_out(pieces, buf.tensor[:n], ready)
                    ticket._consume()
                    consumed = True
                    self._transfer("write", file, dfd, buf.tensor, file_off, n, pad)
                finally:
                    self._write_staging.release(buf)
            with self._lock:
                self.counters.write_seconds += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001
            error = e
            self._failed(e)
        finally:
            if not consumed:
                ticket._consume()
            if not deferred:
                if slot is not None:
                    self.cache.unpin(slot)
                ticket._finish(error)

    def _slot_write(self, file, dfd, ticket, slot, file_off, n, pad) -> None:
        """The background half of a write-through to a host image: image -> file."""
        error = None
        try:
            t0 = time.perf_counter()
            self._transfer("write", file, dfd, slot.image[file_off:], file_off, n, pad)
            with self._lock:
                self.counters.write_seconds += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001
            error = e
            self._failed(e)
        finally:
            self.cache.unpin(slot)
            ticket._finish(error)

    def _copy_in(self, src: torch.Tensor, pieces, ready) -> None:
        """Host bytes -> destination pieces; returns once the destination holds them. On CUDA the copy
        runs on the H2D stream and this worker waits for its event (GIL released), so a finished read
        is on the device and its host buffer may be reused."""
        if not self.cuda:
            pos = 0
            for view, start, k in pieces:
                view[start:start + k].copy_(src[pos:pos + k])
                pos += k
            return
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(ready)  # the destination's allocation is ordered on the compute stream
            pos = 0
            for view, start, k in pieces:
                view[start:start + k].copy_(src[pos:pos + k], non_blocking=True)
                pos += k
            event = self._h2d.record_event()
        event.synchronize()

    def _copy_out(self, pieces, dst: torch.Tensor, ready) -> None:
        """Source pieces -> host bytes `dst`; returns once `dst` holds them."""
        if not self.cuda:
            pos = 0
            for view, start, k in pieces:
                dst[pos:pos + k].copy_(view[start:start + k])
                pos += k
            return
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_event(ready)  # the update and publish of this bucket ran on the compute stream
            pos = 0
            for view, start, k in pieces:
                dst[pos:pos + k].copy_(view[start:start + k], non_blocking=True)
                pos += k
            event = self._d2h.record_event()
        event.synchronize()

    def _transfer(self, op: str, file, dfd: int, buf: torch.Tensor, off: int, n: int, pad: bool) -> None:
        """Move n bytes between host bytes `buf` (aligned) and the file at `off`.

        O_DIRECT when the descriptor, offset and buffer allow; the length is padded to 4 KiB when `pad`
        and the padded range lies inside the file (reads: the segment's reserved tail; writes: zeros into
        the reserved tail). Otherwise the aligned head goes direct and the tail through the buffered fd.
        """
        direct = dfd >= 0 and self.direct and off % ALIGN == 0 and buf.data_ptr() % ALIGN == 0
        head, tail = (n, 0)
        if direct:
            padded = align_up(n)
            if padded != n and pad and off + padded <= file.nbytes and buf.numel() >= padded:
                if op == "write":
                    buf[n:padded].zero_()
                head, tail = padded, 0
            else:
                head, tail = n - n % ALIGN, n % ALIGN
        else:
            head, tail = 0, n
        try:
            if head:
                io = pread_into if op == "read" else pwrite_all
                io(dfd, [host_buffer(buf[:head])], off)
        except OSError as e:
            if e.errno not in _NO_DIRECT:
                raise
            self._direct_unsupported(file.path, e)
            head, tail = 0, n
        if tail:
            io = pread_into if op == "read" else pwrite_all
            io(file.fd, [host_buffer(buf[head:head + tail])], off + head)


def make_engine(name: str, device: torch.device, chunk_bytes: int, threads: int = 2, direct: bool | None = None,
                host_cache_bytes: int = 0):
    if name == "sync":
        return SyncEngine(device, chunk_bytes)
    if name == "pipelined":
        return PipelinedEngine(device, chunk_bytes, threads=threads, direct=direct, host_cache_bytes=host_cache_bytes)
    raise ValueError(f"io_engine must be one of {ENGINES}, got {name!r}")


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
                    if e.errno not in _NO_DIRECT:
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
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
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
