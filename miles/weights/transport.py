"""Handing one weight bucket to another process on the same node, by reference.

- CUDA flat: a CUDA IPC handle, the bytes of ``ForkingPickler.dumps(flat)`` (torch's reducers). The
  consumer maps the producer's allocation; nothing is copied until the consumer copies out. CUDA IPC can
  export only memory from a plain ``cudaMalloc``: in a process running under torch_memory_saver
  (``LD_PRELOAD`` + ``TMS_INIT_ENABLE=1``) allocate the buckets inside ``torch_memory_saver.disable()``.
- CPU flat: the bytes in a new file ``<shm_dir>/miles-weights-<pid>-<start>-<boot>-<pidns>-<counter>``
  (default ``/dev/shm``), named by its maker: see :func:`sweep_dead_files`.

Ownership: the producer keeps the :class:`SharedBucket` (it holds the flat, or owns the file) until the
consumer acknowledged, then calls :meth:`SharedBucket.release`, on every path (the push releases in a
``finally``). torch counts the consumer's references to an IPC allocation; the producer's allocator frees
it once both sides dropped it. A producer killed before its release (SIGKILL: nothing runs) leaves its file;
the first share of the next process on the host removes it (:func:`sweep_dead_files`).
"""

from __future__ import annotations

import functools
import io
import itertools
import logging
import mmap
import os
import pickle
import re
import stat
import tempfile
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reducers with ForkingPickler)

from miles_plugins.host.ownership import IDENTITY_TAG, ProcessIdentity, identity_alive

from .buckets import BucketSpec

logger = logging.getLogger(__name__)

FILE_PREFIX = "miles-weights-"
KINDS = ("cuda_ipc", "shm_file")
_file_counter = itertools.count()
# A file's name says who made it, so that a later process can tell whether its maker is gone: the pid; its
# start time (clock ticks after boot, /proc/<pid>/stat field 22), since a pid is reused; the boot id of the
# host; and the inode of the maker's pid namespace, since containers sharing one /dev/shm (--ipc=host) each
# number their processes anew. Then a counter.
_FILE_NAME = re.compile(re.escape(FILE_PREFIX) + rf"({IDENTITY_TAG})-(\d+)-\d+")
_swept_dirs: set[str] = set()  # the directories this process swept at its first share there


@dataclass
class SharedBucket:
    """A bucket's payload for another process: small and picklable (no tensor data)."""
    spec: BucketSpec
    kind: str  # "cuda_ipc" | "shm_file"
    handle: bytes | str  # the pickled IPC handle, or the file's absolute path
    nbytes: int
    # The producer's side only, never pickled: the flat kept alive, the file this process created.
    _flat: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _created_file: str | None = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self):
        return {"spec": self.spec, "kind": self.kind, "handle": self.handle, "nbytes": self.nbytes}

    def __setstate__(self, state):
        self.__dict__.update(state, _flat=None, _created_file=None)

    def release(self) -> None:
        """Producer side, after the consumer's ack: remove the file / forget the flat. Idempotent; a no-op
        on the consumer's copy, which owns nothing."""
        if self._created_file is not None:
            try:
                os.unlink(self._created_file)
            except FileNotFoundError:
                pass
            self._created_file = None
        if self._flat is not None:
            self._flat = None
            torch.cuda.ipc_collect()  # frees allocations whose consumers let go after ours was dropped


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@functools.lru_cache(maxsize=None)
def _maker(pid: int) -> tuple[ProcessIdentity, int] | None:
    """Process ``pid`` (this one; keyed by pid for forked children) as the maker of bucket files: its identity
    and its pid namespace's inode. None where /proc does not tell: its files are then named by pid alone and
    it sweeps nothing."""
    identity = ProcessIdentity.of(pid)
    if identity is None or identity.boot_id is None:
        return None
    try:
        return identity, os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def sweep_dead_files(directory: str) -> list[str]:
    """Remove the bucket files in ``directory`` whose maker is gone (killed mid-handoff: nothing of it ran):
    files named by a process of this boot and this pid namespace with no process of that pid and start time
    now, regular files of this user. Every other entry stays: a live maker's file, another host's, boot's or
    container's, a name of another form. Returns the paths removed (one log line names them)."""
    mine = _maker(os.getpid())
    if mine is None:
        return []
    me, my_namespace = mine
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        logger.warning("cannot list %s to remove the weight bucket files of processes that are gone: %s",
                       directory, e.strerror)
        return []
    removed = []
    for name in names:
        match = _FILE_NAME.fullmatch(name)
        maker = ProcessIdentity.from_tag(match[1]) if match else None
        if maker is None or maker.boot_id != me.boot_id or int(match[2]) != my_namespace:
            continue  # another form, boot or container: not ours to judge
        if identity_alive(maker):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue  # another sweep came first
        removed.append(path)
    if removed:
        logger.info("removed %d weight bucket file(s) left by processes killed mid-handoff: %s", len(removed),
                    ", ".join(removed))
    return removed


def share_bucket(spec: BucketSpec, flat: torch.Tensor, *, shm_dir: str | None = None) -> SharedBucket:
    """The payload that lets a process on this node open ``flat``. Keep the result until the consumer
    acknowledged, then ``release()`` it."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous() or flat.numel() != spec.nbytes:
        raise ValueError(f"bucket {spec.index}: share a contiguous 1-D uint8 flat of the spec's {spec.nbytes} "
                         f"bytes, got {flat.dtype} of shape {tuple(flat.shape)}")
    directory = os.path.abspath(shm_dir or default_shm_dir())
    if directory not in _swept_dirs:  # this process's first share there, CUDA too (its host fallback writes files)
        _swept_dirs.add(directory)
        sweep_dead_files(directory)
    if flat.is_cuda:
        shared = SharedBucket(spec=spec, kind="cuda_ipc", handle=bytes(ForkingPickler.dumps(flat)),
                              nbytes=spec.nbytes)
        shared._flat = flat
        return shared
    path = _write_new_file(directory, flat)
    shared = SharedBucket(spec=spec, kind="shm_file", handle=path, nbytes=spec.nbytes)
    shared._created_file = path
    return shared


def _write_new_file(directory: str, flat: torch.Tensor) -> str:
    maker = _maker(os.getpid())
    stem = f"{maker[0].tag()}-{maker[1]}" if maker is not None else str(os.getpid())
    while True:
        path = os.path.join(directory, f"{FILE_PREFIX}{stem}-{next(_file_counter)}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            break
        except FileExistsError:
            continue  # a file of this name that this process did not make (a reused pid): leave it
    try:
        view = memoryview(flat.numpy()).cast("B")
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def open_bucket(shared: SharedBucket) -> tuple[BucketSpec, torch.Tensor]:
    """Consumer side: the bucket's flat uint8 tensor. CUDA: on this process's current device, which must be
    the producer's GPU. CPU: the file, opened read-only and mapped copy-on-write. Copy out, then drop it."""
    if shared.kind not in KINDS:
        raise ValueError(f"unknown SharedBucket.kind {shared.kind!r}: expected one of {KINDS}")
    if shared.nbytes != shared.spec.nbytes:
        raise ValueError(f"SharedBucket.nbytes {shared.nbytes} differs from its spec's {shared.spec.nbytes}")
    flat = _open_ipc(shared.handle) if shared.kind == "cuda_ipc" else _map_file(shared.handle, shared.nbytes)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != shared.nbytes:
        raise ValueError(f"bucket {shared.spec.index}: the payload holds {flat.dtype} of shape "
                         f"{tuple(flat.shape)}, not the {shared.nbytes} uint8 bytes of its spec")
    return shared.spec, flat


class _IpcUnpickler(pickle.Unpickler):
    """Unpickles exactly what torch's CUDA tensor reducer writes, rebuilt on this process's device."""
    ALLOWED = {("torch", "Tensor"), ("torch", "Size"), ("torch", "uint8"), ("torch.storage", "TypedStorage")}

    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_on_current_device
        if (module, name) not in self.ALLOWED:
            raise ValueError(f"a CUDA IPC payload names {module}.{name}; only torch's CUDA tensor rebuild "
                             f"is accepted: the payload was not made by share_bucket")
        return super().find_class(module, name)


def _rebuild_on_current_device(tensor_cls, size, stride, offset, storage_cls, dtype, _producer_device, *rest):
    # The producer's device index is its own numbering (CUDA_VISIBLE_DEVICES differs between processes).
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, torch.cuda.current_device(),
                               *rest)


def _open_ipc(handle) -> torch.Tensor:
    if not isinstance(handle, bytes):
        raise ValueError(f"a cuda_ipc SharedBucket.handle is bytes, got {type(handle).__name__}")
    return _IpcUnpickler(io.BytesIO(handle)).load()


def _map_file(path, nbytes: int) -> torch.Tensor:
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"a shm_file SharedBucket.handle is an absolute path, got {path!r}")
    directory, name = os.path.split(path)
    if ".." in path.split(os.sep):
        raise ValueError(f"shm file path {path!r} has a '..' component: refused")
    if not name.startswith(FILE_PREFIX):
        raise ValueError(f"shm file {path!r} is not named {FILE_PREFIX}*: refused (share_bucket names its files)")
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ValueError(f"shm file {path!r}: its directory cannot be opened: {e.strerror}") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ValueError(f"shm file {path!r}: no such file (released by its producer already?)") from None
    except OSError as e:  # ELOOP: the name is a symbolic link
        raise ValueError(f"shm file {path!r} refused: {e.strerror} (a symbolic link is not followed)") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"shm file {path!r} is not a regular file: refused")
        if st.st_size != nbytes:
            raise ValueError(f"shm file {path!r} holds {st.st_size} bytes, its spec says {nbytes}: refused")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    finally:
        os.close(fd)
