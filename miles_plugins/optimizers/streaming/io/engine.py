"""The I/O engines behind the stager: how bucket bytes move between the files, host memory and the device.

stager.py owns an engine and is its only user; together with this module's helpers (hostio.py,
tickets.py, hostcache.py, sync.py) they are the only code that touches files and host memory. Both
engines take the same requests, "put the bytes at file offset `o` into these tensors" (read) and "put
these tensors' bytes, back to back, at file offset `o`" (write), and hand back a `Ticket` per request
(tickets.py: its two levels).

sync       The seed's path, kept as the in-run baseline (sync.py).

pipelined  This module. Requests are cut into chunk-sized tasks (small shards of one request are packed
           into the same chunk) and run by worker threads: `threads` readers and `threads` writers, so
           reads of the buckets ahead, writes of the buckets behind and the update of the current bucket
           all overlap. Worker threads spend their time in preadv/pwritev, torch copies and CUDA event
           waits, all of which release the GIL.
           Host side:
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
             host cache optional budget (`host_cache_bytes`) of whole-file images, write-back: a write
                        to a file with an image lands in the image only, and its dirty chunks go to the
                        file when the file must hold them (write_back_images, drop_cache, forget, or a
                        read/partial write that needs the file's bytes under them; hostcache.py).
                        fill_image reads a file into a new image ahead of need (read-ahead into the
                        tier's free space, after a load dropped the images).

Ordering: a read of a file waits (in the worker, not the caller) for that file's earlier writes of the
same bytes: until they are in the file, or only until they are in the host image when the read is
served from it (a read from the file of bytes an image holds dirty first writes them back). A write
waits for the file's earlier reads and writes of the same bytes, write-backs of its image included.
Every write to a file or an image calls `file.before_write()` first, and so does every write-back (a
background checkpoint copies the file's bytes before they change).
With verify (io/verify.py) every chunk a task moves between a file and host bytes is checksummed there:
recorded after a write, checked after a read from the file (StateCorruptionError on a mismatch).
Errors raised in a worker are kept on the ticket and raised by whoever waits on it; tasks that depend
on a failed ticket fail too.

The file primitives are called through this module's names (pread_into, pwrite_all): tests replace
them here to inject I/O errors. O_DIRECT descriptors are opened with the file (stager.create_file), never
here: tests replace `stager.open_direct` to refuse O_DIRECT.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from ..config import IO_ENGINES
from ..errors import StateCorruptionError
from ..layout import ALIGN_BYTES, align_up
from .hostcache import FileState, HostCache
from .hostio import NO_DIRECT, HostMemory, StagingPool, cut_into_chunks, host_buffer, pread_into, pwrite_all
from .sync import SyncEngine
from .tickets import IOCounters, Ticket, Workers, overlap

logger = logging.getLogger(__name__)
WORKER_THREAD_PREFIX = "miles-io-"


def on_a_worker_thread() -> bool:
    """Whether the calling thread is an I/O worker of some engine: code there must not wait for the
    engine's requests nor close it (the requests may be queued behind the caller itself)."""
    return threading.current_thread().name.startswith(WORKER_THREAD_PREFIX)


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
        self.expected_file_bytes = chunk_bytes  # the largest file (expect_files): set_engine hands it on
        self.counters = IOCounters()
        self.error: BaseException | None = None  # the first error of any task: the engine is broken after it
        self._want_direct = direct
        self.direct = direct is not False  # until a probe says otherwise
        self._direct_reported = False
        self._lock = threading.Lock()
        self._files: dict[int, FileState] = {}
        self._memory = HostMemory(pinned=self.cuda)
        self._read_staging = StagingPool(threads + 1, chunk_bytes, self._memory)
        self._write_staging = StagingPool(threads + 1, chunk_bytes, self._memory)
        self.cache = HostCache(host_cache_bytes, self._memory)
        if self.cuda:
            self._h2d = torch.cuda.Stream(self.device)
            self._d2h = torch.cuda.Stream(self.device)
        self._readers = Workers(f"{WORKER_THREAD_PREFIX}read", threads, self.device)
        self._writers = Workers(f"{WORKER_THREAD_PREFIX}write", threads, self.device)
        self._closed = False

    @property
    def staging_bytes(self) -> int:
        """Host staging this engine may allocate (pinned where CUDA is), not counting the host cache."""
        return self._read_staging.count * self._read_staging.nbytes + self._write_staging.count * self._write_staging.nbytes

    def expect_files(self, max_nbytes: int) -> None:
        """No request is larger than the largest file: staging buffers need not exceed it."""
        self.expected_file_bytes = max_nbytes
        nbytes = min(self.chunk_bytes, align_up(max(max_nbytes, 1)))
        self._read_staging.nbytes = self._write_staging.nbytes = nbytes

    # ---- files ------------------------------------------------------------------------------------
    def _state(self, file) -> FileState:
        state = self._files.get(id(file))
        if state is None:
            state = self._files[id(file)] = FileState(file)
        state.prune()
        return state

    def forget(self, file, write_back: bool = True) -> None:
        """The file is being closed: write its image's dirty chunks back (unless `write_back` is False:
        the file is removed next), wait for its requests, then drop its state and free its image. Raises
        the error of a failed write-back (after the state is dropped)."""
        state = self._files.get(id(file))
        if state is None:
            return
        if write_back and self.error is None and not self._closed:
            self._write_back(state)
        del self._files[id(file)]
        error = None
        for t in state.reads + state.writes:
            try:
                t.wait()
            except BaseException as e:  # noqa: BLE001 - kept in self.error too
                error = error or e
        self.cache.release(state)
        if write_back and error is not None:
            raise error

    def _dfd(self, file) -> int:
        """The file's O_DIRECT descriptor (opened with the file, never by path here), or -1 where direct
        I/O is off or the filesystem refused it (logged once)."""
        if not self.direct or file.home is not None:  # a bucket in host RAM only has no disk file
            return -1
        if file.dfd < 0:
            refusal = file.direct_refusal or OSError(0, "the file has no O_DIRECT descriptor")
            self._direct_unsupported(file.path, refusal)
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

    # ---- requests ---------------------------------------------------------------------------------
    def read(self, file, offset: int, dsts: list[torch.Tensor]) -> Ticket:
        self._check_open()
        state = self._state(file)
        chunks = cut_into_chunks(offset, dsts, self.chunk_bytes)
        total = sum(c[1] for c in chunks)
        span = (offset, align_up(offset + total))
        slot = state.slot if state.slot is not None and state.slot.covers(offset, offset + total) else None
        if slot is None and state.slot is not None:
            self._write_back(state, span)  # the file lacks what the image holds dirty here: a dependency
        level = "consumed" if slot is not None else "finished"
        deps = [(t, level) for t in state.writes if overlap(t.span, span)]
        dfd = self._dfd(file) if slot is None else -1
        ticket = self._submit("read", file, dfd, chunks, dsts, span, deps, slot)
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
        chunks = cut_into_chunks(offset, srcs, self.chunk_bytes)
        total = sum(c[1] for c in chunks)
        span = (offset, align_up(offset + total))
        slot = self.cache.slot_for_write(state, file.nbytes) if chunks else None
        if slot is not None:
            self._write_back_partly_covered(state, offset, offset + total)
        deps = [(t, "finished") for t in state.writes + state.reads if overlap(t.span, span)]
        if slot is not None:
            slot.mark_valid(offset, offset + total)
            for i, (file_off, n, _) in enumerate(chunks):
                slot.mark_dirty(file_off, n, pad_tail and i == len(chunks) - 1)
        dfd = self._dfd(file)
        ticket = self._submit("write", file, dfd, chunks, srcs, span, deps, slot, pad_tail)
        state.writes.append(ticket)
        self.counters.bytes_written += total
        if slot is None:
            self.counters.disk_bytes_written += total
        return ticket

    def _submit(self, op: str, file, dfd: int, chunks, tensors, span, deps, slot, pad_tail: bool = False) -> Ticket:
        """The request's ticket, and a task per chunk on the readers ("read") or the writers ("write")."""
        ready = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        ticket = Ticket(len(chunks), list(tensors))
        ticket.span = span
        workers = self._readers if op == "read" else self._writers
        last = len(chunks) - 1
        for i, chunk in enumerate(chunks):
            if slot is not None:
                self.cache.pin(slot)
            # a read may fill any chunk's padding from the segment's reserved tail; a write pads only its
            # last chunk, and only when the caller says the tail is reserved
            pad = op == "read" or (pad_tail and i == last)
            workers.submit(lambda c=chunk, p=pad: self._chunk_task(op, file, dfd, ticket, c, deps, ready, slot, p))
        return ticket

    def fill_image(self, file, spans: list[tuple[int, int]]) -> int:
        """Read-ahead into the host tier: when `file` has no image and the tier has room for one, give
        it one and start reading the byte ranges `spans` [(offset, nbytes)] of the file into it, on the
        reader threads. Reads of those bytes are served from the image from now on (they wait for the
        fill's chunks); nothing waits for the fill otherwise, wait_device included. Returns the bytes
        started: 0 when the file has an image already or the tier has no room left."""
        self._check_open()
        state = self._state(file)
        if state.slot is not None or not spans:
            return 0
        slot = self.cache.slot_for_write(state, file.nbytes)
        if slot is None:
            return 0
        dfd = self._dfd(file)
        total = 0
        for offset, nbytes in spans:
            chunks = cut_into_chunks(offset, [slot.image[offset:offset + nbytes]], self.chunk_bytes)
            ticket = Ticket(len(chunks), [])
            ticket.span, ticket.host_only = (offset, align_up(offset + nbytes)), True
            deps = [(t, "finished") for t in state.writes + state.reads if overlap(t.span, ticket.span)]
            slot.mark_valid(offset, offset + nbytes)
            for file_off, n, _ in chunks:
                self.cache.pin(slot)
                self._readers.submit(lambda t=ticket, o=file_off, k=n, d=deps:
                                     self._image_task("read", file, dfd, t, slot, o, k, True, d))
            state.writes.append(ticket)  # the image's writer: reads from the image order after it
            total += nbytes
        self.counters.fill_bytes_read += total
        return total

    def _write_back_partly_covered(self, state: FileState, start: int, stop: int) -> None:
        """Before a write into the image: write back the dirty chunks it overlaps only in part (their
        other bytes are still the file's to receive; the ones it covers whole it replaces)."""
        partial = [(o, n) for o, n, _ in state.slot.dirty_in((start, stop)) if o < start or o + n > stop]
        for o, n in partial:
            self._write_back(state, (o, o + n))

    def _write_back(self, state: FileState, span: tuple[int, int] | None = None) -> None:
        """Submit writes of the image's dirty chunks (those overlapping `span`, or all) to the file: the
        only way bytes written into an image reach the disk. Later requests of the file order after
        them (they are the file's writes); the chunks count as clean from now on."""
        slot = state.slot
        chunks = slot.take_dirty(span) if slot is not None else []
        if not chunks:
            return
        file = state.file
        if file.before_write is not None:
            file.before_write()
        dfd = self._dfd(file)
        for file_off, n, pad in chunks:
            ticket = Ticket(1, [])
            ticket.span = (file_off, align_up(file_off + n))
            deps = [(t, "finished") for t in state.writes + state.reads if overlap(t.span, ticket.span)]
            self.cache.pin(slot)
            self._writers.submit(lambda t=ticket, o=file_off, k=n, p=pad, d=deps:
                                 self._image_task("write", file, dfd, t, slot, o, k, p, d))
            state.writes.append(ticket)
            self.counters.disk_bytes_written += n

    def write_back_images(self) -> None:
        """Return once every request has ended and every file holds its image's dirty chunks (the
        images stay, clean). Raises the first error (after all have ended)."""
        self.wait_all()
        self._check_open()
        for state in list(self._files.values()):
            self._write_back(state)
        self.wait_all()

    def wait_device(self) -> None:
        """Return once no request uses device memory any more: every read has finished and every write
        has consumed its sources (into a host image, or into staging: a staged write's last chunks are
        consumed only once its earlier ones are on disk, the staging being bounded). Writes of staging
        and of dirty images to the disk may still be in flight; later requests order after them."""
        for state in list(self._files.values()):
            for t in state.reads:
                t.wait()
            for t in state.writes:
                if not t.host_only:
                    t.wait("consumed")

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

    def drop_cache(self, write_back: bool = True) -> None:
        """Write the images' dirty chunks back, then forget every image (whoever drops them may change
        the files behind the engine's back). After a failure the dirty chunks are lost with the images:
        the store is poisoned then, and only a checkpoint load rebuilds its state. write_back=False:
        wait for every request, then forget the images with their dirty chunks unwritten (the caller
        rewrites every file next)."""
        try:
            if write_back:
                self.write_back_images()
            else:
                self.wait_all()
        finally:
            self.cache.drop()

    def close(self) -> None:
        if self._closed:
            return
        self.wait_all(raise_errors=False)
        self._closed = True
        self._readers.close()
        self._writers.close()
        self._memory.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the I/O engine is closed")
        self.check()

    def check(self) -> None:
        """Raise if any task has failed (a write that failed after its caller stopped waiting, say)."""
        if isinstance(self.error, StateCorruptionError):
            raise self.error  # found by a read ahead: its message (which file changed, what to do) as is
        if self.error is not None:
            raise IOError(f"optimizer-state I/O failed earlier: {self.error!r}") from self.error

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    # ---- tasks (worker threads) -------------------------------------------------------------------
    def _chunk_task(self, op: str, file, dfd, ticket, chunk, deps, ready, slot, pad) -> None:
        """One chunk of a request: "read", file or image -> destination pieces; "write", source pieces ->
        image or file. Without an image, CPU tensors with buffered I/O move straight between their memory
        and the file; anything else goes through a staging buffer."""
        file_off, n, pieces = chunk
        consumed, error = False, None
        try:
            for dep, level in deps:
                dep.wait_dependency(level)
            t0 = time.perf_counter()
            if slot is not None:
                # a write is write-back: the image holds the bytes now and the chunk is dirty (marked when
                # the write was submitted); the file gets them when it must hold them (_write_back)
                self._copy(op, pieces, slot.image[file_off:file_off + n], ready)
            elif not self.cuda and dfd < 0:
                views = [v[s:s + k] for v, s, k in pieces]
                io = pread_into if op == "read" else pwrite_all
                io(file.fd, [host_buffer(v) for v in views], file_off)
                self._checksum(op, file, file_off, views)
            else:
                staging = self._read_staging if op == "read" else self._write_staging
                buf = staging.acquire()
                try:
                    staged = buf.tensor[:n]
                    if op == "write":
                        self._copy(op, pieces, staged, ready)
                        # the sources are in staging: the caller may release them before the disk write
                        ticket.consume_chunk()
                        consumed = True
                    self._transfer(op, file, dfd, buf.tensor, file_off, n, pad)
                    self._checksum(op, file, file_off, [staged])
                    if op == "read":
                        self._copy(op, pieces, staged, ready)
                finally:
                    staging.release(buf)
            with self._lock:
                if op == "read":
                    self.counters.read_seconds += time.perf_counter() - t0
                else:
                    self.counters.write_seconds += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised by whoever waits on the ticket
            error = e
            self._failed(e)
        finally:
            if slot is not None:
                self.cache.unpin(slot)
            if not consumed:
                ticket.consume_chunk()
            ticket.finish_chunk(error)

    def _image_task(self, op: str, file, dfd, ticket, slot, file_off, n, pad, deps) -> None:
        """A chunk between a host image and its file: "write", a write-back of a dirty chunk (verify
        records it as it lands); "read", a fill (verify checks it as it arrives)."""
        error = None
        try:
            for dep, level in deps:
                dep.wait_dependency(level)
            t0 = time.perf_counter()
            self._transfer(op, file, dfd, slot.image[file_off:], file_off, n, pad)
            self._checksum(op, file, file_off, [slot.image[file_off:file_off + n]])
            with self._lock:
                if op == "write":
                    self.counters.write_seconds += time.perf_counter() - t0
                else:
                    self.counters.fill_seconds += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001
            error = e
            self._failed(e)
        finally:
            self.cache.unpin(slot)
            ticket.consume_chunk()
            ticket.finish_chunk(error)

    @staticmethod
    def _checksum(op: str, file, off: int, chunk: list[torch.Tensor]) -> None:
        """verify (io/verify.py): check the bytes a read brought from the file, record those a write sent."""
        if op == "read":
            file.checksums.read(off, chunk)
        else:
            file.checksums.written(off, chunk)

    def _copy(self, op: str, pieces, host: torch.Tensor, ready) -> None:
        """Host bytes `host` -> the pieces ("read") or the pieces -> `host` ("write"), back to back;
        returns once every destination holds its bytes. On CUDA the copies run on the H2D or D2H stream
        after the event `ready`, recorded on the compute stream when the request was made (a read's
        destination was allocated there; a write's bucket update and publish were queued there), and
        this worker waits for their event (GIL released), so the host buffer of a finished read or
        write may be reused."""
        pairs, pos = [], 0
        for view, start, k in pieces:
            piece, host_bytes = view[start:start + k], host[pos:pos + k]
            pairs.append((piece, host_bytes) if op == "read" else (host_bytes, piece))
            pos += k
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        stream = self._h2d if op == "read" else self._d2h
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = stream.record_event()
        event.synchronize()

    def _transfer(self, op: str, file, dfd: int, buf: torch.Tensor, off: int, n: int, pad: bool) -> None:
        """Move n bytes between host bytes `buf` (aligned) and the file at `off`.

        O_DIRECT when the descriptor, offset and buffer allow; the length is padded to 4 KiB when `pad`
        and the padded range lies inside the file (reads: the segment's reserved tail; writes: zeros into
        the reserved tail). Otherwise the aligned head goes direct and the tail through the buffered fd.
        """
        direct = dfd >= 0 and self.direct and off % ALIGN_BYTES == 0 and buf.data_ptr() % ALIGN_BYTES == 0
        head, tail = (n, 0)
        if direct:
            padded = align_up(n)
            if padded != n and pad and off + padded <= file.nbytes and buf.numel() >= padded:
                if op == "write":
                    buf[n:padded].zero_()
                head, tail = padded, 0
            else:
                head, tail = n - n % ALIGN_BYTES, n % ALIGN_BYTES
        else:
            head, tail = 0, n
        try:
            if head:
                io = pread_into if op == "read" else pwrite_all
                io(dfd, [host_buffer(buf[:head])], off)
        except OSError as e:
            if e.errno not in NO_DIRECT:
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
    raise ValueError(f"io_engine must be one of {IO_ENGINES}, got {name!r}")
