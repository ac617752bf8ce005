"""The stager: the only code that touches the filesystem and host staging memory.

Everything above it (bucket, store, bindings) speaks in device tensors and byte offsets. A GPUDirect
Storage backend or a different I/O engine is a change to this module alone.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


class StoreConfigError(ValueError):
    """Bad input to the store, found at construction, before anything on disk was touched."""


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
class BucketFile:
    path: str
    fd: int
    nbytes: int


@dataclass
class IOCounters:
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


class Stager:
    """Synchronous chunked I/O through one pinned staging buffer (pinned only where CUDA exists).

    CPU tensors are read into and written from their own memory directly: staging would only add
    a copy. Device tensors move in chunk_bytes pieces: disk <-> pinned buffer <-> device, always as
    same-dtype bytes (a copy into a differently typed host view takes no DMA path).
    """

    def __init__(self, device: torch.device, chunk_bytes: int):
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise StoreConfigError(f"chunk size must be a positive multiple of 4 KiB, got {chunk_bytes} bytes")
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.counters = IOCounters()
        self._staging = None
        if self.device.type != "cpu":
            self._staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    # ---- directories --------------------------------------------------------------------------
    @staticmethod
    def prepare_directory(root: str, relative_dir: str, required_bytes: int) -> str:
        """Validate the root and free space, then wipe and recreate `<root>/<relative_dir>`.

        Nothing is deleted or created before every check has passed, and nothing outside the store's
        own directory is ever touched.
        """
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            parent = os.path.dirname(root)
            if os.path.exists(root):
                raise StoreConfigError(f"optimizer-state root {root!r} exists but is not a directory; pass a directory")
            if not os.path.isdir(parent):
                raise StoreConfigError(
                    f"optimizer-state root {root!r} does not exist and neither does its parent {parent!r}; "
                    "create the parent or choose another directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise StoreConfigError(f"cannot create optimizer-state root {root!r}: parent {parent!r} is not writable")
        elif not os.access(root, os.W_OK | os.X_OK):
            raise StoreConfigError(f"optimizer-state root {root!r} is not writable; choose a writable directory")
        path = os.path.join(root, relative_dir)
        probe = root if os.path.isdir(root) else os.path.dirname(root)
        reclaimable = _tree_bytes(path)
        free = shutil.disk_usage(probe).free + reclaimable
        if required_bytes > free:
            raise StoreConfigError(
                f"not enough free space for the optimizer state under {root!r}: need {required_bytes / 2**30:.2f} GiB, "
                f"{free / 2**30:.2f} GiB available; free space, choose another directory, or use narrower "
                "moments (moment_dtype='bf16')")
        if os.path.lexists(path):
            logger.info("removing leftover optimizer-state directory %s", path)
            shutil.rmtree(path)
        os.makedirs(path)
        return path

    @staticmethod
    def remove_directory(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        parent = os.path.dirname(path)
        try:  # the rank folder goes too once its last store is gone
            os.rmdir(parent)
        except OSError:
            pass

    # ---- files --------------------------------------------------------------------------------
    @staticmethod
    def create_file(path: str, nbytes: int) -> BucketFile:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _preallocate(fd, nbytes, path)
        except BaseException:
            os.close(fd)
            raise
        return BucketFile(path, fd, nbytes)

    @staticmethod
    def close_file(file: BucketFile) -> None:
        if file.fd >= 0:
            os.close(file.fd)
            file.fd = -1

    # ---- data ---------------------------------------------------------------------------------
    def read(self, file: BucketFile, offset: int, dst: torch.Tensor) -> None:
        """Fill the contiguous tensor `dst` with the bytes at `offset`."""
        start = time.perf_counter()
        dst_bytes = as_bytes(dst)
        total = dst_bytes.numel()
        if self._staging is None:
            _pread_into(file.fd, host_buffer(dst_bytes), offset)
        else:
            for pos in range(0, total, self.chunk_bytes):
                n = min(self.chunk_bytes, total - pos)
                _pread_into(file.fd, host_buffer(self._staging[:n]), offset + pos)
                dst_bytes[pos:pos + n].copy_(self._staging[:n])
        self.counters.bytes_read += total
        self.counters.read_seconds += time.perf_counter() - start

    def write(self, file: BucketFile, offset: int, srcs: list[torch.Tensor]) -> None:
        """Write the contiguous tensors `srcs` back to back starting at `offset`."""
        start = time.perf_counter()
        views = [as_bytes(t) for t in srcs]
        total = sum(v.numel() for v in views)
        if self._staging is None:
            _pwrite_all(file.fd, [host_buffer(v) for v in views], offset)
        else:
            filled, written = 0, 0
            for view in views:
                pos = 0
                while pos < view.numel():
                    n = min(self.chunk_bytes - filled, view.numel() - pos)
                    self._staging[filled:filled + n].copy_(view[pos:pos + n])
                    filled, pos = filled + n, pos + n
                    if filled == self.chunk_bytes:
                        _pwrite_all(file.fd, [host_buffer(self._staging)], offset + written)
                        written, filled = written + filled, 0
            if filled:
                _pwrite_all(file.fd, [host_buffer(self._staging[:filled])], offset + written)
        self.counters.bytes_written += total
        self.counters.write_seconds += time.perf_counter() - start

    def close(self) -> None:
        self._staging = None


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _preallocate(fd: int, nbytes: int, path: str) -> None:
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise StoreConfigError(
                f"no space left to preallocate {nbytes / 2**20:.1f} MiB for {path!r}; free space or choose another "
                "directory") from e
        if e.errno not in _NO_FALLOCATE:
            raise
    logger.debug("fallocate unsupported for %s; using ftruncate (space is not reserved)", path)
    os.ftruncate(fd, nbytes)


def _pread_into(fd: int, buffer, offset: int) -> None:
    view = buffer
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + (1 << 30)]], offset + done)
        if n == 0:
            raise IOError(f"unexpected end of file reading fd {fd} at byte {offset + done}")
        done += n


def _pwrite_all(fd: int, buffers: list, offset: int) -> None:
    for view in buffers:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)
        offset += len(view)
