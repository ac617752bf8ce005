"""The raw disk floor a streamed step is measured against (`miles bench stream`): the disk alone, with
the engines' own primitives (through the stager) and no compute, no device."""

from __future__ import annotations

import os
import threading
import time

from miles_plugins.optimizers.streaming.io.stager import (NO_DIRECT, HostMemory, align_up, drop_page_cache,
                                                          host_buffer, open_direct, pread_into, pwrite_all)


def raw_floor(paths_and_ranges: list[tuple[str, int, int]], write_path: str, write_bytes: int, chunk_bytes: int,
              threads: int = 2, direct: bool = True, concurrent: bool = True) -> dict:
    """Time the disk alone: read the given (path, offset, nbytes) ranges and write `write_bytes` to
    `write_path` (preallocated by the caller), in chunk_bytes requests from aligned buffers, `threads`
    readers and `threads` writers, O_DIRECT where allowed (buffered writes end with fdatasync, buffered
    reads are preceded by dropping those pages from the page cache). concurrent: reads and writes at
    once (as the pipelined step does); otherwise all reads, then all writes. No compute, no device."""
    read_tasks = _chunks(paths_and_ranges, chunk_bytes)
    write_tasks = _chunks([(write_path, 0, write_bytes)], chunk_bytes)
    fds = {path: _open(path, direct) for path in {p for p, _, _ in read_tasks + write_tasks}}
    for fd, is_direct in fds.values():
        if not is_direct:
            drop_page_cache(fd)
    largest = max([n for _, _, n in read_tasks + write_tasks], default=1)
    buffers = _touched_buffers(2 * threads, largest)  # before the clock
    errors: list[BaseException] = []

    def run(groups):
        _run_workers(groups, fds, buffers, threads, errors)

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


def _chunks(paths_and_ranges, chunk_bytes: int) -> list[tuple[str, int, int]]:
    """The (path, offset, nbytes) requests of at most chunk_bytes that cover the ranges."""
    return [(path, off + pos, min(chunk_bytes, n - pos))
            for path, off, n in paths_and_ranges for pos in range(0, n, chunk_bytes)]


def _open(path: str, direct: bool) -> tuple[int, bool]:
    """(fd, whether O_DIRECT): O_DIRECT when asked for and the filesystem takes it, buffered otherwise."""
    if direct:
        try:
            return open_direct(path), True
        except OSError as e:
            if e.errno not in NO_DIRECT:
                raise
    return os.open(path, os.O_RDWR | os.O_CLOEXEC), False


def _touched_buffers(count: int, nbytes: int) -> list:
    """Aligned host buffers, written once so that their pages exist before anything is timed."""
    memory = HostMemory(pinned=False)
    buffers = [memory.empty(nbytes) for _ in range(count)]
    for buf in buffers:
        buf.fill_(7)
    return buffers


def _run_workers(groups, fds: dict, buffers: list, threads: int, errors: list) -> None:
    """`threads` workers per (tasks, "read" | "write") group, all at once, each with its own buffer;
    returns when every task is done. A worker's error ends that worker and lands in `errors`."""
    workers = []
    for g, (tasks, op) in enumerate(groups):
        lock = threading.Lock()
        workers += [threading.Thread(target=_worker, args=(tasks, op, lock, buffers[g * threads + i], fds, errors))
                    for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()


def _worker(tasks: list, op: str, lock: threading.Lock, buf, fds: dict, errors: list) -> None:
    try:
        while True:
            with lock:
                if not tasks:
                    return
                path, off, n = tasks.pop()
            fd, is_direct = fds[path]
            m = align_up(n) if is_direct else n
            (pread_into if op == "read" else pwrite_all)(fd, [host_buffer(buf[:m])], off)
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
