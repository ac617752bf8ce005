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
