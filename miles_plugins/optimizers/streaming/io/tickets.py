"""What an I/O request hands back and what runs it: `Ticket`s, the worker threads, and the byte
counters. Shared by the engines (engine.py, sync.py).

Ticket levels: `consumed` (a write no longer needs its source tensors: their storage may be released;
a read's bytes are in its destination) and `finished` (the bytes are in the file / in the destination
tensors; a write into a host-cache image is finished once it is in the image: hostcache.py).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch


@dataclass
class IOCounters:
    bytes_read: int = 0        # requested by reads (from the files or the host cache)
    bytes_written: int = 0     # requested by writes
    cache_bytes_read: int = 0  # of bytes_read, served from the host cache
    # bytes sent to the files: writes of files without a host image, and write-backs of images' dirty
    # chunks (a write into an image reaches the disk only then: hostcache.py)
    disk_bytes_written: int = 0
    read_seconds: float = 0.0  # time spent in read tasks (summed over worker threads)
    write_seconds: float = 0.0
    # read-ahead into the host tier (engine.fill_image): disk reads no step asked for, counted apart
    fill_bytes_read: int = 0
    fill_seconds: float = 0.0


# ---- tickets --------------------------------------------------------------------------------------
class Ticket:
    """One request, cut into `chunks` tasks. See the module docstring for the two levels."""

    def __init__(self, chunks: int, holds: list):
        self.consumed = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._unconsumed = chunks
        self._unfinished = chunks
        self._holds = holds  # tensors kept alive until the request no longer needs them (consumed)
        self.span = (0, 0)  # file bytes the request touches (padded to 4 KiB)
        self.host_only = False  # touches no device memory (a host-tier fill): wait_device skips it
        if chunks == 0:
            self.consumed.set()
            self.finished.set()
            self._holds = None

    def consume_chunk(self) -> None:
        """The engine: one chunk no longer needs its source tensors."""
        with self._lock:
            self._unconsumed -= 1
            if self._unconsumed == 0:
                # a write's sources are copied out, a read's destinations filled: a caller that releases
                # them (store.release_device) must not find device memory kept alive here
                self._holds = None
                self.consumed.set()

    def finish_chunk(self, error: BaseException | None) -> None:
        """The engine: one chunk has ended (its error, if it failed, is the ticket's)."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._unfinished -= 1
            done = self._unfinished == 0
        if done:
            self.finished.set()

    def wait(self, level: str = "finished") -> None:
        """Block until `level`; raise the error of any failed task. A finished read's bytes are in its
        destination tensors (on CUDA: the H2D copies have completed)."""
        (self.consumed if level == "consumed" else self.finished).wait()
        if self.error is not None and (level == "finished" or self.finished.is_set()):
            raise self.error

    def done(self, level: str = "finished") -> bool:
        return (self.consumed if level == "consumed" else self.finished).is_set()

    def wait_dependency(self, level: str) -> None:
        """Used by worker tasks: a failed dependency fails the task."""
        (self.consumed if level == "consumed" else self.finished).wait()
        if self.error is not None:
            raise IOError(f"an earlier I/O request on the same file failed: {self.error!r}") from self.error


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def finished_ticket() -> Ticket:
    return Ticket(0, [])


# ---- worker threads -------------------------------------------------------------------------------
class Workers:
    """Threads over a FIFO of tasks."""

    def __init__(self, name: str, count: int, device: torch.device):
        self._cv = threading.Condition()
        self._tasks: collections.deque = collections.deque()
        self._closing = False
        self._device = device
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for t in self._threads:
            t.start()

    def _next(self):
        with self._cv:
            while True:
                if self._tasks:
                    return self._tasks.popleft()
                if self._closing:
                    return None
                self._cv.wait()

    def _loop(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            task = self._next()
            if task is None:
                return
            task()
            del task  # its closure holds views of the request's tensors: not while this thread idles

    def submit(self, task) -> None:
        with self._cv:
            self._tasks.append(task)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=60)
