"""What an I/O request hands back and what runs it: `Ticket`s, the background tasks a waiter may run
itself, the worker threads, and the byte counters. Shared by the engines (engine.py, sync.py).

Ticket levels: `consumed` (a write no longer needs its source tensors: their storage may be released)
and `finished` (the bytes are in the file / in the destination tensors). Whoever waits for a write to
be finished runs its not-yet-started background part itself, so no wait depends on idle threads.
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
    read_seconds: float = 0.0  # time spent in read tasks (summed over worker threads)
    write_seconds: float = 0.0


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
        self._holds = holds  # tensors kept alive until the request is finished
        self._deferred: list[Deferred] = []  # background parts not started yet (stealable by waiters)
        self.span = (0, 0)  # file bytes the request touches (padded to 4 KiB)
        if chunks == 0:
            self.consumed.set()
            self.finished.set()
            self._holds = None

    def consume_chunk(self) -> None:
        """The engine: one chunk no longer needs its source tensors."""
        with self._lock:
            self._unconsumed -= 1
            if self._unconsumed == 0:
                self.consumed.set()

    def finish_chunk(self, error: BaseException | None) -> None:
        """The engine: one chunk has ended (its error, if it failed, is the ticket's)."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._unfinished -= 1
            done = self._unfinished == 0
        if done:
            self._holds = None
            self.finished.set()

    def defer(self, task: "Deferred") -> None:
        """The engine: a background part of this request that a waiter may run itself."""
        self._deferred.append(task)

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

    def wait_dependency(self, level: str) -> None:
        """Used by worker tasks: a failed dependency fails the task."""
        if level == "finished":
            self._run_deferred()
        (self.consumed if level == "consumed" else self.finished).wait()
        if self.error is not None:
            raise IOError(f"an earlier I/O request on the same file failed: {self.error!r}") from self.error


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def finished_ticket() -> Ticket:
    return Ticket(0, [])


class Deferred:
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


# ---- worker threads -------------------------------------------------------------------------------
class Workers:
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
