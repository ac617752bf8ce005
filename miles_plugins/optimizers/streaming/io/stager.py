"""The stager: the only code that touches the filesystem and host staging memory.

Everything above it (bucket, store, bindings) speaks in device tensors and byte offsets. The bytes are
moved by the I/O engine the stager owns: `sync.py` (the seed's synchronous path) or `engine.py`
(`pipelined`: worker threads, several pinned staging buffers, CUDA streams, O_DIRECT), built from
`hostio.py` (file and host-memory primitives, staging), `tickets.py` (in-flight requests, workers)
and `hostcache.py` (the optional host-RAM cache of hot buckets). Checkpoint file primitives (copies
with checksums, durable files, atomic directory publish) live in `fileops.py` and are re-exported here.
Only the stager imports these modules: a GPUDirect Storage backend or a different I/O engine is a
change below this module alone.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Callable

import torch

from miles_plugins.host.memory import available_host_memory
from miles_plugins.host.ownership import (  # noqa: F401 - store, checkpoint/ take the locks through the stager
    LOCK_FILE, DirectoryInUseError, DirectoryLock, ProcessIdentity, identity_alive, listing, system_directory_reason)

from ..config import IO_ENGINES
from ..errors import StoreConfigError
from ..layout import BucketLayout, align_up  # noqa: F401 - align_up: miles/bench/floor.py
from ..units import binary_size
from .engine import make_engine, on_a_worker_thread  # noqa: F401 - on_a_worker_thread: the store's finalizer
from .fileops import (  # noqa: F401 - checkpoint/ uses them through the stager
    open_read, open_new, close_fd, reflink, copy_with_crc, file_size, read_file,
    read_at, write_at, write_file_durable, fsync_dir, make_dirs, publish_dir, remove_tree, glob_paths)
from .hostio import (  # noqa: F401 - requantize.py moves bytes, miles/bench/floor.py times the disk, through them
    NO_DIRECT, HostMemory, as_bytes, drop_page_cache, host_buffer, open_direct, pread_into, pwrite_all)
from .tickets import IOCounters, Ticket  # noqa: F401
from .verify import FileChecksums

logger = logging.getLogger(__name__)

_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


def check_host_cache_budget(budget_bytes: int, available_bytes: int | None) -> None:
    """The host cache must fit the memory this host has free now (each rank of a node asks for its own)."""
    if budget_bytes < 0:
        raise StoreConfigError(f"the host cache budget must be >= 0, got {budget_bytes} bytes")
    if available_bytes is not None and budget_bytes > available_bytes:
        raise StoreConfigError(
            f"host cache of {budget_bytes / 2**30:.2f} GiB asked for, but this host has {available_bytes / 2**30:.2f} GiB "
            "of memory available; lower host_cache_mb (--stream-optimizer-state-host-cache-mb), remembering "
            "that every rank on the node takes its own")




class NotARegularFileError(OSError):
    """A checkpoint lists a path that is a symbolic link, a directory, a FIFO or a device."""


def open_regular(path: str) -> tuple[int, int]:
    """Open a file of a checkpoint for reading: (fd, size in bytes). The last component is never
    followed (a symbolic link is refused), and anything but a regular file is refused before a byte is
    read (O_NONBLOCK: opening a FIFO must not wait for a writer). Raises NotARegularFileError or OSError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotARegularFileError(e.errno, "a symbolic link, which a load never follows", path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotARegularFileError(errno.EINVAL, "not a regular file", path)
    return fd, st.st_size


def read_regular(path: str, limit: int) -> bytes:
    """The whole of a small checkpoint file (open_regular's refusals), its size bounded by `limit`
    before anything is read."""
    fd, size = open_regular(path)
    try:
        if size > limit:
            raise OSError(errno.EFBIG, f"{size} bytes, more than the {limit} a file of its kind may hold", path)
        return bytes(read_at(fd, 0, size))
    finally:
        os.close(fd)


@dataclass
class BucketFile:
    path: str
    fd: int
    nbytes: int
    # Called before any write to this file: a checkpoint taken in the background copies the file's
    # current bytes first (checkpoint/save_load.py). Every write path of any I/O engine must call it.
    before_write: Callable[[], None] | None = None
    dfd: int = -1  # O_DIRECT descriptor of the same file (create_file), -1 where the filesystem refuses it
    direct_refusal: OSError | None = None  # why there is no O_DIRECT descriptor (the engine logs its fallback)
    checksums: FileChecksums | None = None  # verify: crc32 per chunk written, checked on reads (verify.py)
    # A bucket that lives in host RAM only: `fd` is an anonymous memory file (memfd: never on a disk, gone
    # when closed) and `home` its bytes mapped as a host tensor. The engines serve its reads and writes
    # from `home`; checkpoints copy it through `fd` like any file. None: a file on disk.
    home: torch.Tensor | None = None


class Stager:
    """Moves bucket bytes between the files and device (or CPU) tensors through its I/O engine.

    io_engine: "pipelined" (default) or "sync" (the seed's path, kept as the in-run baseline).
    io_threads: reader and writer threads of the pipelined engine (each). direct_io: None probes
    O_DIRECT (logged fallback to buffered where the filesystem refuses it), True asks for it (a refusal
    is logged as a warning), False never uses it. host_cache_bytes: RAM budget for whole-file images of
    buckets, write-back (0: none; hostcache.py): a write to a file with an image stays in host RAM until
    `write_back()`, `drain()`, a closed file or a replaced engine needs it in the file.

    Two ways to call it. `read`/`write` are synchronous whatever the engine (they return once the bytes
    are in the tensor / in the file). `read_async`/`write_async` return a Ticket and let the engine run
    them in the background; `wait_reads(file)` (the destination tensors hold the bytes),
    `wait_sources(file)` (the source tensors of the file's writes may be released) and
    `wait_writes(file)` (the file holds them, or its host image does) wait per file; `wait_all()` waits
    for everything in flight; `wait_device()` only until no request uses device memory; `write_back()`
    until the files hold every write, images included; `drain()` also forgets the images and tells the
    store to release what its pipeline holds.
    """

    def __init__(self, device: torch.device, chunk_bytes: int, io_engine: str = "pipelined", io_threads: int = 2,
                 direct_io: bool | None = None, host_cache_bytes: int = 0, ram_home_bytes: int = 0):
        """host_cache_bytes: the host tier in all; ram_home_bytes of it are taken by the buckets that live
        in host RAM only (create_in_ram), the rest is the write-back images' budget."""
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise StoreConfigError(f"chunk size must be a positive multiple of 4 KiB, got {chunk_bytes} bytes")
        if io_engine not in IO_ENGINES:
            raise StoreConfigError(f"io_engine must be one of {IO_ENGINES}, got {io_engine!r}")
        if io_threads < 1:
            raise StoreConfigError(f"io_threads must be >= 1, got {io_threads}")
        if host_cache_bytes:
            check_host_cache_budget(host_cache_bytes, available_host_memory())
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.ram_home_bytes = ram_home_bytes
        self._homes = HostMemory(pinned=self.device.type == "cuda")  # outlives engines: set_engine keeps them
        self.engine = make_engine(io_engine, self.device, chunk_bytes, threads=io_threads, direct=direct_io,
                                  host_cache_bytes=max(0, host_cache_bytes - ram_home_bytes))
        self.counters = self.engine.counters
        self._drain_hooks: list[Callable[[], None]] = []

    @property
    def io_engine(self) -> str:
        return self.engine.name

    @property
    def direct_io(self) -> bool:
        """Whether the engine uses O_DIRECT now (a probe may have fallen back to buffered I/O)."""
        return bool(self.engine.direct)

    @property
    def staging_bytes(self) -> int:
        """Host staging memory the engine may use (pinned where CUDA is); the host cache comes on top."""
        return self.engine.staging_bytes

    # ---- directories --------------------------------------------------------------------------
    @staticmethod
    def prepare_directory(root: str, relative_dir: str, required_bytes: int) -> DirectoryLock:
        """Validate the root and free space, lock `<root>/<relative_dir>` for this process and empty it.

        Returns the held lock (its `directory` is the store's path); `remove_directory` releases it.
        Nothing is deleted before every check has passed and the lock is held (another live process
        using the directory gets DirectoryInUseError naming it), and nothing outside the store's own
        directory is ever touched. Emptying removes only what a store makes there (its bucket files and
        lock file); anything else is refused with StoreConfigError naming it, and nothing is deleted.
        A missing root is created only when its parent exists; a system directory is refused.
        """
        from ..layout import is_bucket_filename  # the store's own file names: what emptying may remove

        root = os.path.abspath(root)
        for candidate in dict.fromkeys((root, os.path.realpath(root))):
            why = system_directory_reason(candidate, os.path.expanduser("~"))
            if why is not None:
                raise StoreConfigError(
                    f"optimizer-state root {root!r}: {why}; the store creates and removes its folders there, so "
                    "pass a directory of its own on a local disk (e.g. under $SCRATCH or /tmp)")

        if not os.path.isdir(root):
            parent = os.path.dirname(root)
            # Re-check isdir: the ranks of a node share the root, and another one may just have created it.
            if os.path.lexists(root) and not os.path.isdir(root):
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
        _refuse_links(root, path)
        probe = root if os.path.isdir(root) else os.path.dirname(root)
        reclaimable = _tree_bytes(path)
        usage = shutil.disk_usage(probe)
        if usage.total == 0:  # kernel filesystems report no capacity: "0 free" would blame the wrong thing
            raise StoreConfigError(
                f"optimizer-state root {root!r}: its filesystem reports no capacity at all, so it is not a disk "
                "(e.g. /proc, /sys or another kernel filesystem); pass a directory on a local disk (e.g. under "
                "$SCRATCH or /tmp)")
        free = usage.free + reclaimable
        if required_bytes > free:
            raise StoreConfigError(
                f"not enough free space for the optimizer state under {root!r}: need {binary_size(required_bytes)}, "
                f"{binary_size(free)} available; free space, choose another directory, or use narrower "
                "moments (moment_dtype='bf16')")
        os.makedirs(path, exist_ok=True)
        lock = DirectoryLock.acquire(path, f"optimizer-state store {relative_dir}", "optimizer-state directory")
        try:
            _remove_own_entries(path, is_bucket_filename, "optimizer-state directory")
        except BaseException:
            lock.release()
            raise
        return lock

    @staticmethod
    def remove_directory(lock: DirectoryLock) -> None:
        """Remove the store's files, then its lock, then the directory (and the rank folder once its last
        store is gone). A directory another process has locked meanwhile is left to it, and so is what the
        store did not make (named in one warning; the directory then stays)."""
        from ..layout import is_bucket_filename

        path = lock.directory
        foreign = []
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name == LOCK_FILE:
                    continue
                if not entry.is_dir(follow_symlinks=False) and is_bucket_filename(entry.name):
                    os.unlink(entry.path)
                else:
                    foreign.append(entry.name)
        if foreign:
            logger.warning("left in %s what the store did not make: %s", path, listing(sorted(foreign)))
        lock.release()
        for directory in (path, os.path.dirname(path)):
            try:
                os.rmdir(directory)
            except OSError:
                pass

    # ---- files --------------------------------------------------------------------------------
    @staticmethod
    def create_file(path: str, nbytes: int, layout: BucketLayout | None = None, bucket: int = 0,
                    verify: bool = False) -> BucketFile:
        """Create and preallocate `path`, and open both its descriptors now: buffered, and O_DIRECT where
        the filesystem allows. They are never re-resolved by path, so a file replaced behind the store's
        back (another process recreating the directory) is never read or written in its place.
        layout, bucket: what the file holds (verify's errors name the bucket and segment). verify: every
        chunk written is checksummed and checked when read back from the file (io/verify.py)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        segments = layout.segments if layout is not None else {}
        file = BucketFile(path, fd, nbytes, checksums=FileChecksums(path, bucket, segments, verify))
        try:
            _preallocate(fd, nbytes, path)
            file.dfd, file.direct_refusal = _open_direct_twin(fd, path)
        except BaseException:
            Stager.close_descriptors(file)
            raise
        return file

    def create_in_ram(self, name: str, nbytes: int, layout: BucketLayout | None = None, bucket: int = 0,
                      verify: bool = False) -> BucketFile:
        """A bucket that lives in host RAM only (BucketFile.home): an anonymous memory file, never on a
        disk, its pages reserved now and mapped, page-locked where CUDA is. `name` only names it in
        messages; nothing is created in any directory. Its memory is freed by close_file."""
        fd = os.memfd_create(f"miles-{os.path.basename(name)}", os.MFD_CLOEXEC)
        path = f"{name} (in host RAM, no file)"
        segments = layout.segments if layout is not None else {}
        file = BucketFile(path, fd, nbytes, checksums=FileChecksums(path, bucket, segments, verify))
        try:
            _preallocate(fd, nbytes, path)
            file.home = self._homes.map_file(fd, nbytes)
        except BaseException:
            Stager.close_descriptors(file)
            raise
        return file

    @staticmethod
    def files_rewritten(files: list[BucketFile]) -> None:
        """The caller rewrote these files through their descriptors, not the engine (a checkpoint load,
        after drain()): verify's checksums of them no longer hold, until the next write of each chunk."""
        for file in files:
            file.checksums.forget()

    @staticmethod
    def set_verify(files: list[BucketFile], on: bool) -> None:
        """Turn verify on or off for these files (nothing may be in flight: drain first). Turned on, a
        chunk is checked from its next write on."""
        for file in files:
            file.checksums.enable(on)

    def close_file(self, file: BucketFile, write_back: bool = True) -> None:
        """Close a bucket file (its host image's dirty bytes are written first unless `write_back` is
        False: the caller removes the file next; its requests in flight end and the engine forgets it)."""
        try:
            self.engine.forget(file, write_back=write_back)
        finally:
            if file.home is not None:  # its memory goes with the last reference to the mapping
                self._homes.release(file.home)
                file.home = None
            Stager.close_descriptors(file)

    @staticmethod
    def close_descriptors(file: BucketFile) -> None:
        """Close a file the engine never saw (a scratch file)."""
        if file.fd >= 0:
            os.close(file.fd)
            file.fd = -1
        if file.dfd >= 0:
            os.close(file.dfd)
            file.dfd = -1

    # ---- data ---------------------------------------------------------------------------------
    def read(self, file: BucketFile, offset: int, dst: torch.Tensor) -> None:
        """Fill the contiguous tensor `dst` with the bytes at `offset` (returns once it holds them)."""
        self.engine.read(file, offset, [dst]).wait()

    def write(self, file: BucketFile, offset: int, srcs: list[torch.Tensor]) -> None:
        """Write the contiguous tensors `srcs` back to back starting at `offset` (returns once written)."""
        self.engine.write(file, offset, srcs).wait()

    def read_async(self, file: BucketFile, offset: int, dsts: list[torch.Tensor]) -> Ticket:
        """Submit: fill `dsts` (back to back) from `offset`. Waits for the file's earlier writes first."""
        return self.engine.read(file, offset, dsts)

    def write_async(self, file: BucketFile, offset: int, srcs: list[torch.Tensor], pad_tail: bool = False) -> Ticket:
        """Submit: write `srcs` back to back at `offset`. pad_tail: the bytes after the last one, up to the
        next 4 KiB boundary, are reserved space the engine may overwrite with zeros (O_DIRECT)."""
        return self.engine.write(file, offset, srcs, pad_tail=pad_tail)

    def wait_reads(self, file: BucketFile) -> None:
        for t in self.engine.pending(file, "read"):
            t.wait()

    def wait_sources(self, file: BucketFile) -> None:
        for t in self.engine.pending(file, "write"):
            t.wait("consumed")

    def sources_released(self, file: BucketFile) -> bool:
        """True when no write of `file` still needs its source tensors (non-blocking)."""
        return all(t.done("consumed") for t in self.engine.pending(file, "write"))

    def wait_writes(self, file: BucketFile) -> None:
        for t in self.engine.pending(file, "write"):
            t.wait()

    def writes_in_flight(self, file: BucketFile) -> bool:
        return any(not t.done() for t in self.engine.pending(file, "write"))

    def expect_files(self, max_nbytes: int) -> None:
        """The largest bucket file: no staging buffer needs to be larger."""
        self.engine.expect_files(max_nbytes)

    def is_cached(self, file: BucketFile, offset: int, nbytes: int) -> bool:
        """True when the host cache holds these bytes (a read of them costs no disk I/O)."""
        return self.engine.is_cached(file, offset, nbytes)

    def fill_host_tier(self, file: BucketFile, spans: list[tuple[int, int]]) -> int:
        """Start reading the byte ranges `spans` [(offset, nbytes)] of `file` into a new host image, when
        the file has none and the tier has room (read-ahead; nothing waits for it but reads of those
        bytes). Returns the bytes started (0: no room, an image already, or no tier)."""
        return self.engine.fill_image(file, spans)

    def wait_all(self, raise_errors: bool = True) -> None:
        """Every request in flight has ended (a write into a host image ends in the image)."""
        self.engine.wait_all(raise_errors=raise_errors)

    def wait_device(self) -> None:
        """Return once no request uses device memory (reads finished, writes' sources copied to host
        images or staging); writes to the disk may go on in the background, and the file's later
        requests order after them."""
        self.engine.wait_device()

    def write_back(self) -> None:
        """Return once every request has ended and the files hold every write, the host images' dirty
        bytes included (the images stay, now clean)."""
        self.engine.write_back_images()

    def check(self) -> None:
        """Raise the error of any background task that failed (the engine is unusable after one)."""
        self.engine.check()

    def on_drain(self, hook: Callable[[], None]) -> None:
        """`hook` runs at the end of every drain() (the store releases its prefetched buckets there)."""
        self._drain_hooks.append(hook)

    def drain(self, write_back: bool = True) -> None:
        """Return once every read and write issued so far has ended and the files hold every write, the
        host images' dirty bytes included. The images are forgotten and the drain hooks run, since
        whoever drains may change the files behind the engine's back. write_back=False: the images'
        dirty bytes are forgotten unwritten, for a caller that rewrites every file next (a load)."""
        try:
            self.engine.drop_cache(write_back)
        finally:
            for hook in self._drain_hooks:
                hook()

    def drop_page_cache(self, files: list[BucketFile]) -> None:
        """Benchmarks: flush these files and drop their pages from the page cache (cold reads)."""
        for file in files:
            if file.fd >= 0:
                drop_page_cache(file.fd)

    def set_engine(self, io_engine: str, io_threads: int = 2, direct_io: bool | None = None,
                   host_cache_bytes: int = 0, discard_errors: bool = False) -> None:
        """Replace the engine (its host images are written back first). Benchmarks and A/B runs switch
        engines on the same files this way. discard_errors: the old engine failed and the store recovers
        (load_from on a poisoned store): its error is dropped with it instead of raised. host_cache_bytes:
        the tier in all; the buckets in host RAM only keep theirs (ram_home_bytes), the rest is the new
        engine's write-back images."""
        if io_engine not in IO_ENGINES:
            raise StoreConfigError(f"io_engine must be one of {IO_ENGINES}, got {io_engine!r}")
        host_cache_bytes = max(0, host_cache_bytes - self.ram_home_bytes)
        if host_cache_bytes:
            check_host_cache_budget(host_cache_bytes, available_host_memory())
        old = self.engine
        if discard_errors:
            old.wait_all(raise_errors=False)  # its images die with it: the store reloads its state
        else:
            old.drop_cache()  # the new engine starts without images: the files must hold their bytes
        self.engine = make_engine(io_engine, self.device, self.chunk_bytes, threads=io_threads, direct=direct_io,
                                  host_cache_bytes=host_cache_bytes)
        self.engine.expect_files(old.expected_file_bytes)
        self.counters = self.engine.counters
        old.close()

    def close(self) -> None:
        self.engine.close()
        self._homes.close()


def free_disk_bytes(root: str, relative_dir: str) -> int | None:
    """Bytes a store under `root` may fill: the filesystem's free space plus what an earlier store left in
    `<root>/<relative_dir>` (emptied before the files are made). None where `root` and its parent do not
    exist (prepare_directory says why)."""
    root = os.path.abspath(root)
    probe = root if os.path.isdir(root) else os.path.dirname(root)
    if not os.path.isdir(probe):
        return None
    return shutil.disk_usage(probe).free + _tree_bytes(os.path.join(root, relative_dir))


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _refuse_links(root: str, path: str) -> None:
    """The store empties and removes its directories: refuse any that is a symbolic link (the root itself
    may be one: it is only read through), before anything is touched."""
    relative = os.path.relpath(path, root).split(os.sep)
    for depth in range(1, len(relative) + 1):
        candidate = os.path.join(root, *relative[:depth])
        if os.path.islink(candidate):
            raise StoreConfigError(
                f"optimizer-state directory {candidate!r} is a symbolic link (to {os.readlink(candidate)!r}); the "
                "store empties and removes its own directories, so they must be real ones: remove the link, or "
                "pass a dir whose rank folders are not links")


def _remove_own_entries(directory: str, is_own: Callable[[str], bool], what: str) -> None:
    """Empty `directory` (locked by the caller) of the entries its owner made: the names `is_own` accepts;
    the lock file stays. Anything else in it is someone else's: then nothing is removed and
    StoreConfigError names it (a few names and the count)."""
    with os.scandir(directory) as scan:
        entries = sorted((e for e in scan if e.name != LOCK_FILE), key=lambda e: e.name)
    foreign = [e.name for e in entries if e.is_dir(follow_symlinks=False) or not is_own(e.name)]
    if foreign:
        count = f"{len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'}"
        raise StoreConfigError(
            f"{what} {directory} holds {count} the store did not make: {listing(foreign)}. The store clears its "
            "directory at start and removes it at the end, so it works only in a directory that holds nothing "
            "else; move them elsewhere, or choose another dir")
    for entry in entries:
        os.unlink(entry.path)


def _open_direct_twin(fd: int, path: str) -> tuple[int, OSError | None]:
    """An O_DIRECT descriptor of the file `fd` has open, checked to be the same file; (-1, why) where the
    filesystem refuses O_DIRECT."""
    try:
        dfd = open_direct(path)
    except OSError as e:
        if e.errno not in NO_DIRECT:
            raise
        return -1, e
    if not os.path.samestat(os.fstat(fd), os.fstat(dfd)):
        os.close(dfd)
        raise OSError(errno.ESTALE, f"{path} was replaced while the store opened it: another process is "
                                    "writing into this directory")
    return dfd, None


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
