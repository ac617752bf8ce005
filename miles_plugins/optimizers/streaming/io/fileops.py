"""File primitives of checkpoints: whole-file copies with checksums, durable small files, atomic
directory publish, on hostio's positional I/O. Below the stager (which re-exports them): checkpoint/
reaches them as `stager.<name>`, so the stager stays the one door to files.

Copies run in the kernel (copy_file_range; reflink where the filesystem shares extents; pread/pwrite
where refused); every syscall and crc32 releases the GIL, so a background save does not stall training.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import zlib
from typing import Callable

from .hostio import pread_into, pwrite_all


# ---- checkpoint files (checkpoint/ decides what to copy; these move the bytes) --------------------
COPY_CHUNK_BYTES = 16 << 20
_FICLONE = 0x40049409  # ioctl: share a file's extents (btrfs, XFS with reflink, bcachefs)


def open_read(path: str) -> int:
    """Open a checkpoint file for reading; a symbolic link is refused (ELOOP), never followed."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)


def open_new(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def close_fd(fd: int, sync: bool = False) -> None:
    try:
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def reflink(src_fd: int, dst_fd: int) -> bool:
    """Make dst share src's extents: an instant copy-on-write snapshot. False where unsupported."""
    try:
        import fcntl
        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
        return True
    except OSError:
        return False


_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}
_kernel_copy = hasattr(os, "copy_file_range")  # False once refused (other filesystems, old kernels, gVisor)


def _copy_range(src_fd: int, dst_fd: int, n: int, src_off: int, dst_off: int, buf: memoryview) -> None:
    global _kernel_copy
    done = 0
    while _kernel_copy and done < n:  # in the kernel: no copy through user memory (reflink on XFS)
        try:
            k = os.copy_file_range(src_fd, dst_fd, n - done, src_off + done, dst_off + done)
        except OSError as e:
            if e.errno not in _NO_COPY_FILE_RANGE:
                raise
            _kernel_copy = False
            break
        if k == 0:
            raise IOError(f"unexpected end of file copying fd {src_fd} at byte {src_off + done}")
        done += k
    for pos in range(done, n, len(buf)):
        chunk = buf[:min(len(buf), n - pos)]
        pread_into(src_fd, [chunk], src_off + pos)
        pwrite_all(dst_fd, [chunk], dst_off + pos)


def copy_with_crc(src_fd: int, dst_fd: int | None, nbytes: int, src_offset: int = 0, dst_offset: int = 0,
                  crc: int = 0, on_chunk: Callable[[], None] | None = None,
                  inspect: Callable[[int, memoryview], None] | None = None) -> int:
    """Copy `nbytes` (dst_fd None: only read them) and return their zlib.crc32, chained from `crc`.
    inspect: called with (source offset, bytes) of each chunk checksummed, in order (verify's check of
    a live file a checkpoint copies, on the bytes the checksum reads anyway); what it raises fails the copy.

    Chunk by chunk: the copy runs in the kernel (copy_file_range; pread/pwrite where refused) while a
    helper thread checksums the previous chunk, re-read from the page cache. Every syscall and crc32
    releases the GIL, so a copy in a background thread does not stall the training thread. Short
    files raise IOError.
    """
    chunk_bytes = max(1, min(COPY_CHUNK_BYTES, nbytes))
    if dst_fd is None or nbytes <= chunk_bytes:
        buf = memoryview(bytearray(chunk_bytes))
        for pos in range(0, nbytes, chunk_bytes):
            n = min(chunk_bytes, nbytes - pos)
            if dst_fd is not None:
                _copy_range(src_fd, dst_fd, n, src_offset + pos, dst_offset + pos, buf)
            pread_into(src_fd, [buf[:n]], src_offset + pos)
            crc = zlib.crc32(buf[:n], crc)
            if inspect is not None:
                inspect(src_offset + pos, buf[:n])
            if on_chunk is not None:
                on_chunk()
        return crc
    from concurrent.futures import ThreadPoolExecutor

    copy_buf, crc_buf, state = memoryview(bytearray(chunk_bytes)), memoryview(bytearray(chunk_bytes)), [crc]

    def checksum(pos: int, n: int) -> None:  # one worker: runs in submission order
        pread_into(src_fd, [crc_buf[:n]], src_offset + pos)
        state[0] = zlib.crc32(crc_buf[:n], state[0])
        if inspect is not None:
            inspect(src_offset + pos, crc_buf[:n])

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-crc") as pool:
        futures = []
        for pos in range(0, nbytes, chunk_bytes):
            n = min(chunk_bytes, nbytes - pos)
            _copy_range(src_fd, dst_fd, n, src_offset + pos, dst_offset + pos, copy_buf)
            futures.append(pool.submit(checksum, pos, n))
            if on_chunk is not None:
                on_chunk()
        for f in futures:
            f.result()
    return state[0]


def file_size(path: str) -> int:
    return os.stat(path).st_size


def read_file(path: str, limit: int) -> bytes:
    """The whole file (not followed if a symbolic link); IOError when it holds more than `limit` bytes,
    found before they are read (a file's size is not trusted to fit memory)."""
    fd = open_read(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise IOError(f"{path} holds {size} bytes, more than the {limit} a file of its kind may")
        return bytes(read_at(fd, 0, size))
    finally:
        os.close(fd)


def read_at(fd: int, offset: int, nbytes: int) -> bytearray:
    """`nbytes` bytes at `offset` (short files raise IOError)."""
    buf = bytearray(nbytes)
    pread_into(fd, [memoryview(buf)], offset)
    return buf


def write_at(fd: int, offset: int, data) -> None:
    """Write all of `data` (a bytes-like object) at `offset`."""
    pwrite_all(fd, [memoryview(data).cast("B")], offset)


def write_file_durable(path: str, data: bytes) -> None:
    fd = open_new(path)
    try:
        pwrite_all(fd, [memoryview(data)], 0)
    finally:
        close_fd(fd, sync=True)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str) -> None:
    """Create `path` and its missing parents, each made durable in its parent."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for p in reversed(missing):
        try:
            os.mkdir(p)
        except FileExistsError:
            pass
        fsync_dir(os.path.dirname(p))


def publish_dir(tmp: str, final: str, on_step: Callable[[], None] | None = None) -> None:
    """Rename the complete directory `tmp` to `final`, durably. An existing `final` (a re-save to the
    same place) is renamed aside first and removed after: no moment exposes a mix of the two."""
    step = on_step or (lambda: None)
    parent = os.path.dirname(final)
    old = None
    if os.path.lexists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
        step()
    os.rename(tmp, final)
    step()
    fsync_dir(parent)
    step()
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def glob_paths(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern))
