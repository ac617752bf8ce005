"""The synchronous engine: the seed's path, kept as the in-run baseline.

The calling thread does every pread/pwrite, buffered, in the same chunks as the pipelined engine
(hostio.cut_into_chunks; so verify's per-chunk checksums hold across engines), through one staging
buffer (device tensors) or straight from the tensor's memory (CPU tensors). Tickets come back
finished. It takes the same requests as the pipelined engine (engine.py, where `make_engine` picks
between them).
"""

from __future__ import annotations

import time

import torch

from .hostio import as_bytes, cut_into_chunks, host_buffer, pread_into, pwrite_all
from .tickets import IOCounters, Ticket, finished_ticket


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
        self.expected_file_bytes = chunk_bytes  # the largest file (expect_files): set_engine hands it on
        self._staging = None
        if self.device.type != "cpu":
            self._staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    @property
    def staging_bytes(self) -> int:
        return 0 if self._staging is None else self.chunk_bytes

    def expect_files(self, max_nbytes: int) -> None:
        self.expected_file_bytes = max_nbytes

    def read(self, file, offset: int, dsts: list[torch.Tensor]) -> Ticket:
        return self._move("read", file, offset, dsts)

    def write(self, file, offset: int, srcs: list[torch.Tensor], pad_tail: bool = False) -> Ticket:
        if file.before_write is not None:
            file.before_write()
        return self._move("write", file, offset, srcs)

    def _move(self, op: str, file, offset: int, tensors: list[torch.Tensor]) -> Ticket:
        """The bytes of the file at `offset` -> `tensors` ("read"), or `tensors` -> the file ("write")."""
        io = pread_into if op == "read" else pwrite_all
        checksum = file.checksums.read if op == "read" else file.checksums.written
        start = time.perf_counter()
        for file_off, n, pieces in cut_into_chunks(offset, tensors, self.chunk_bytes):
            views = [v[s:s + k] for v, s, k in pieces]
            if self._staging is None:
                io(file.fd, [host_buffer(v) for v in views], file_off)
                checksum(file_off, views)
                continue
            staged = self._staging[:n]
            if op == "write":
                _copy(op, views, staged)
            io(file.fd, [host_buffer(staged)], file_off)
            checksum(file_off, [staged])
            if op == "read":
                _copy(op, views, staged)
        nbytes = sum(as_bytes(t).numel() for t in tensors)
        if op == "read":
            self.counters.bytes_read += nbytes
            self.counters.read_seconds += time.perf_counter() - start
        else:
            self.counters.bytes_written += nbytes
            self.counters.disk_bytes_written += nbytes
            self.counters.write_seconds += time.perf_counter() - start
        return finished_ticket()

    # Nothing is ever in flight; errors raise in the caller.
    def check(self) -> None:
        """Nothing to check: no request outlives its call."""

    def pending(self, file, kind: str) -> list[Ticket]:
        return []

    def is_cached(self, file, offset: int, nbytes: int) -> bool:
        return False

    def fill_image(self, file, spans: list[tuple[int, int]]) -> int:
        """No host tier: nothing to read ahead into."""
        return 0

    def wait_all(self, raise_errors: bool = True) -> None:
        pass

    def forget(self, file, write_back: bool = True) -> None:
        """Nothing to drop: every request ended before it returned."""

    def write_back_images(self) -> None:
        """No host images: every write is in its file when it returns."""

    def wait_device(self) -> None:
        """Nothing in flight."""

    def drop_cache(self, write_back: bool = True) -> None:
        """No host images to drop."""

    def close(self) -> None:
        self._staging = None


def _copy(op: str, views: list[torch.Tensor], staged: torch.Tensor) -> None:
    """Staging -> the views ("read") or the views -> staging ("write"), back to back."""
    pos = 0
    for view in views:
        part = staged[pos:pos + view.numel()]
        if op == "read":
            view.copy_(part)
        else:
            part.copy_(view)
        pos += view.numel()
