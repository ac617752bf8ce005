"""Who owns a directory on a shared disk: an exclusive lock while a run uses it, a marker for what it made.

Two runs on one directory corrupt each other silently (each wipes and rewrites the other's files), and
a teardown that removes "whatever is there" deletes other people's data. So:

- `DirectoryLock.acquire(path, run_id)` holds an exclusive `flock` on `<path>/.miles-owner` for as long
  as the run uses the directory; the file records the holder (host, pid, run id, time). A second
  holder gets `DirectoryInUseError` naming the first. The kernel drops the lock when its process dies,
  so a lock left by a dead process is taken over on the next acquire, and the takeover is logged.
- `make_directory(path, run_id)` creates a directory and records in `<path>/.miles-created` that this
  run created it; `remove_created(path, run_id)` removes a directory only when that record names this
  run, and otherwise leaves it and reports why. Teardown deletes nothing it did not create. A run root
  is created only when its parent exists: nothing above it is ever made (or left behind marked).
- `sweep(root, run_id)` is a run's last cleanup of a whole tree: it removes every directory this run
  made (and what the run wrote in them), enters no other directory, and reports everything else it found,
  so one warning can list it (`listing` keeps that warning short).
- `ProcessIdentity` names a process by pid, start time and boot id, and `identity_alive` says whether it
  still runs: records and temporary names carry it, so a reused pid does not keep a dead run's leftovers.
- `system_directory_reason(path, home)` says why `path` may not be a root a run creates things in;
  `path_within(path, top)` is the containment test both sides use.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from dataclasses import asdict, dataclass
from typing import Callable

logger = logging.getLogger(__name__)

LOCK_FILE = ".miles-owner"
CREATED_FILE = ".miles-created"
_RECORD_MAX_BYTES = 4096  # a record is a few hundred bytes; anything larger is not ours


class DirectoryInUseError(RuntimeError):
    """Another live process holds the directory."""


class LockUnsupportedError(OSError):
    """The filesystem refuses file locks (NFS without a lock manager, some FUSE mounts); `errno` says how."""


# flock's answer when the lock is free to take but the filesystem cannot lock at all
_NO_LOCKS = (errno.ENOLCK, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)


_PROC = "/proc"
_STAT_MAX_BYTES = 4096  # /proc/<pid>/stat is one line of ~300 bytes (comm is at most 16)
_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# a tag as ProcessIdentity.tag() writes it into a file name: "<pid>-<start ticks>-<boot id>", or a bare pid
# (names written before identities were recorded)
IDENTITY_TAG = rf"\d+(?:-\d+-{_BOOT_ID.pattern})?"
_IDENTITY_TAG = re.compile(rf"(\d+)(?:-(\d+)-({_BOOT_ID.pattern}))?")


@dataclass(frozen=True)
class ProcessIdentity:
    """One process of one boot of a host. A pid alone is reused once its process dies, so a record naming
    only a pid can make a dead run look alive forever; the start time (clock ticks after boot,
    /proc/<pid>/stat field 22) and the boot id (/proc/sys/kernel/random/boot_id) tell the reuse apart.
    `start_ticks` and `boot_id` are None when unknown (a record from before they were kept, or no /proc)."""

    pid: int
    start_ticks: int | None = None
    boot_id: str | None = None

    @classmethod
    def current(cls) -> "ProcessIdentity":
        return cls.of(os.getpid()) or cls(os.getpid())

    @classmethod
    def of(cls, pid: int, proc: str = _PROC) -> "ProcessIdentity | None":
        """The identity of the live process `pid` (None when /proc shows none), read from `proc`."""
        ticks = _start_ticks(pid, proc)
        return None if ticks is None else cls(pid, ticks, _boot_id(proc))

    def tag(self) -> str:
        """This identity in a file name (IDENTITY_TAG's form): the pid alone when the rest is unknown."""
        if self.start_ticks is None or self.boot_id is None:
            return str(self.pid)
        return f"{self.pid}-{self.start_ticks}-{self.boot_id}"

    @classmethod
    def from_tag(cls, text: str) -> "ProcessIdentity | None":
        """The identity a file name's tag spells (a bare pid: pid only), None when it is no tag."""
        match = _IDENTITY_TAG.fullmatch(text)
        if match is None:
            return None
        pid, ticks, boot = match.groups()
        return cls(int(pid), None if ticks is None else int(ticks), boot)

    def is_current(self) -> bool:
        """This process (by pid alone when the identity does not know more)."""
        if self.pid != os.getpid():
            return False
        return self.start_ticks is None or self.boot_id is None or self == ProcessIdentity.current()


def _read_small(path: str, limit: int) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _boot_id(proc: str = _PROC) -> str | None:
    raw = _read_small(os.path.join(proc, "sys/kernel/random/boot_id"), 64)
    text = raw.decode("ascii", "replace").strip() if raw else ""
    return text if _BOOT_ID.fullmatch(text) else None


def _start_ticks(pid: int, proc: str = _PROC) -> int | None:
    """Field 22 of /proc/<pid>/stat (None: no such process visible, or not a stat line). The command name
    (field 2) may hold spaces and parentheses: fields are counted after its last ')'."""
    if pid <= 0:
        return None
    raw = _read_small(os.path.join(proc, str(pid), "stat"), _STAT_MAX_BYTES)
    if not raw or b")" not in raw:
        return None
    fields = raw.rsplit(b")", 1)[1].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def identity_alive(identity: ProcessIdentity, proc: str = _PROC) -> bool:
    """True while the process `identity` names may still run on this host: a process with its pid exists
    and, when the identity knows them, it started at the same tick of the same boot.

    A pid-only identity (older records and names) counts alive whenever its pid exists, as before: a
    reused pid then keeps a leftover, but a live run's directory is never taken for a dead one's. A pid
    that /proc does not show but that signals reach (/proc mounted with hidepid) cannot be told apart, and
    counts alive for the same reason."""
    if identity.start_ticks is None or identity.boot_id is None:
        return pid_alive(identity.pid)
    boot = _boot_id(proc)
    if boot is None:
        return pid_alive(identity.pid)
    if boot != identity.boot_id:
        return False  # the host rebooted since: every process of that boot is gone
    ticks = _start_ticks(identity.pid, proc)
    if ticks is None:
        return pid_alive(identity.pid)
    return ticks == identity.start_ticks


@dataclass(frozen=True)
class OwnerRecord:
    host: str
    pid: int
    run_id: str
    since: float  # time.time() when the lock was taken or the directory made
    start_ticks: int | None = None  # with boot_id: which process `pid` was (ProcessIdentity); None in older records
    boot_id: str | None = None

    @classmethod
    def mine(cls, run_id: str) -> "OwnerRecord":
        me = ProcessIdentity.current()
        return cls(socket.gethostname(), me.pid, run_id, time.time(), me.start_ticks, me.boot_id)

    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_ticks, self.boot_id)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on host {self.host} (run {self.run_id}, since {when})"


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _parse_record(raw: bytes) -> OwnerRecord | None:
    try:
        data = json.loads(raw.decode())
        boot = data.get("boot_id")
        if boot is not None and not (isinstance(boot, str) and _BOOT_ID.fullmatch(boot)):
            return None
        return OwnerRecord(str(data["host"]), int(data["pid"]), str(data["run_id"]), float(data["since"]),
                           _optional_int(data.get("start_ticks")), boot)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None


def read_record(path: str) -> OwnerRecord | None:
    """The record in a lock or marker file, or None when it is missing, foreign or malformed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return _parse_record(os.read(fd, _RECORD_MAX_BYTES + 1)[:_RECORD_MAX_BYTES])
    finally:
        os.close(fd)


def _write_record(fd: int, record: OwnerRecord) -> None:
    data = json.dumps(asdict(record)).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


class DirectoryLock:
    """An exclusive hold on one directory; `release()` (or process death) ends it."""

    def __init__(self, directory: str, fd: int, record: OwnerRecord, previous: OwnerRecord | None):
        self.directory, self._fd, self.record, self.previous = directory, fd, record, previous

    @classmethod
    def acquire(cls, directory: str, run_id: str, what: str = "directory") -> "DirectoryLock":
        """Lock `directory` (which must exist) for this process, or raise DirectoryInUseError.

        `what` names the directory in messages ("optimizer-state directory", "run root")."""
        path = os.path.join(directory, LOCK_FILE)
        while True:
            fd, created = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    if created:
                        _unlink_if_present(path)
                    if e.errno in _NO_LOCKS:
                        raise LockUnsupportedError(
                            e.errno, f"{what} {directory}: the filesystem cannot lock {path} (flock failed with "
                            f"{errno.errorcode.get(e.errno, e.errno)}: {os.strerror(e.errno)}), so two runs on this "
                            "directory could not be kept apart; use a local filesystem with file locks (ext4, XFS "
                            "on a node-local disk), not NFS or a mount without locks", path) from None
                    raise
                holder = read_record(path)
                who = holder.describe() if holder else "another process (no readable owner record)"
                raise DirectoryInUseError(
                    f"{what} {directory} is in use by {who}. Two runs on one directory overwrite each "
                    "other's files; wait for that run to end, or give this run another directory.") from None
            # A releaser unlinks the file after we opened it: our lock would then be on a dead inode.
            try:
                same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _parse_record(os.pread(fd, _RECORD_MAX_BYTES, 0))
        record = OwnerRecord.mine(run_id)
        if previous is not None and (previous.host, previous.pid) != (record.host, record.pid):
            logger.warning("%s %s: taking over the lock of %s, which is no longer running", what, directory,
                           previous.describe())
        _write_record(fd, record)
        return cls(directory, fd, record, previous)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Remove the lock file and drop the lock. Safe to call twice."""
        if self._fd < 0:
            return
        _unlink_if_present(os.path.join(self.directory, LOCK_FILE))
        os.close(self._fd)
        self._fd = -1


def _open_lock_file(path: str) -> tuple[int, bool]:
    """The lock file's descriptor, and whether this call created the file (a failed lock then removes it)."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    while True:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            pass
        try:
            return os.open(path, flags), False
        except FileNotFoundError:  # its holder released it between the two opens: create it again
            continue


def _unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def pid_alive(pid: int) -> bool:
    """True when process `pid` exists on this host (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def process_run_id() -> str:
    """A run id for a process that was given none: ``<host>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


# A run makes its root only when the root's parent exists, and inside it at most two levels of its own
# layout on the way to a directory (<root>/trainer/cell<i>_rank<j>, <root>/rollout/engine<i>): an actor on
# a node where the root is missing makes those. So a directory is made with at most this many missing
# parents; more means the root's parent is missing, and nothing is created.
RUN_TREE_PARENTS = 2


def make_directory(path: str, run_id: str, parents: int = RUN_TREE_PARENTS) -> bool:
    """Create `path` and mark it as this run's; True when this call created it. Up to `parents` missing
    parents are made and marked the same way, so a teardown can remove them too once they are empty;
    with more missing, FileNotFoundError names the highest one and nothing is created.

    An existing directory is left unmarked: this run did not make it, so its teardown leaves it."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        if parents <= 0:
            missing = parent
            while not os.path.isdir(os.path.dirname(missing)):
                missing = os.path.dirname(missing)
            raise FileNotFoundError(
                errno.ENOENT, f"cannot create {path}: {missing} does not exist, and a run creates a missing root "
                "only when the root's parent exists (never the parents themselves); create the parent first, or "
                "choose a directory whose parent exists", missing)
        make_directory(parent, run_id, parents - 1)
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    fd = os.open(os.path.join(path, CREATED_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_record(fd, OwnerRecord.mine(run_id))
    finally:
        os.close(fd)
    return True


def created_by(path: str, run_id: str) -> bool:
    """True when `path` is a real directory (not a symlink) whose marker names `run_id`."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    record = read_record(os.path.join(path, CREATED_FILE))
    return record is not None and record.run_id == run_id


def remove_created(path: str, run_id: str) -> str | None:
    """Remove `path` if this run created it; else leave it and return why (None when removed or absent)."""
    if not os.path.lexists(path):
        return None
    if not created_by(path, run_id):
        record = read_record(os.path.join(path, CREATED_FILE))
        return (f"{path} (made by {record.describe()})" if record else f"{path} (not made by this run)")
    lock = read_record(os.path.join(path, LOCK_FILE))
    if lock is not None and lock.run_id != run_id:
        return f"{path} (in use by {lock.describe()})"
    shutil.rmtree(path)
    return None


Keep = Callable[[str], "str | None"]  # why a sweep must leave a directory whole (None: no reason)


def claim_directory(path: str, run_id: str, what: str = "directory", parents: int = RUN_TREE_PARENTS,
                    keep: Keep | None = None) -> DirectoryLock:
    """Make `path` if it is missing (marked as this run's; `parents` as in make_directory) and lock it;
    raises DirectoryInUseError.

    A directory left by a run that died on this host (its maker's process is gone and nobody holds its
    lock) is first swept as that run's teardown would have: what the dead run made goes, anything else
    (and every directory `keep` gives a reason for) stays and is reported. So a crashed run's scratch
    does not pile up under a reused root."""
    _sweep_dead_maker(path, what, keep)
    created = make_directory(path, run_id, parents)
    try:
        return DirectoryLock.acquire(path, run_id, what)
    except BaseException:
        if created:  # refused (held, or a filesystem without locks): leave no trace of this attempt
            remove_created(path, run_id)
        raise


def _sweep_dead_maker(path: str, what: str, keep: Keep | None) -> None:
    made = read_record(os.path.join(path, CREATED_FILE))
    if (made is None or made.host != socket.gethostname() or identity_alive(made.identity())
            or _lock_is_held(os.path.join(path, LOCK_FILE))):
        return  # ours to keep, someone else's, or not decidable from this host
    result = sweep(path, made.run_id, keep)
    logger.warning("%s %s was left by %s, which is no longer running: removed %d of its directories%s",
                   what, path, made.describe(), len(result.removed),
                   f"; left what it did not make: {listing(result.left)}" if result.left else "")


LISTED = 5  # entries a warning names; the rest are counted


def listing(entries: list[str], shown: int = LISTED) -> str:
    """``a; b`` for a few entries, ``40000 entries, first 5: a; b; c; d; e`` for more: one warning line stays
    short whatever a directory holds."""
    if len(entries) <= shown:
        return "; ".join(entries)
    return f"{len(entries)} entries, first {shown}: {'; '.join(entries[:shown])}"


@dataclass
class Sweep:
    """What `sweep` did: directories removed, and entries left because this run did not make them."""

    removed: list[str]
    left: list[str]


_BOOKKEEPING = (LOCK_FILE, CREATED_FILE)


def sweep(root: str, run_id: str, keep: Keep | None = None) -> Sweep:
    """Remove what run `run_id` made under `root` (root included), leave and report everything else.

    A directory is this run's when its marker names the run, or when it has no marker and lies inside
    one of the run's directories (folders a run makes with plain makedirs). Only `root` and the run's own
    directories are looked into: any other directory (marked or locked by another run, one `keep` gives a
    reason for, such as a checkpoint, or one that existed before the run) is left whole, unentered, and
    reported as one entry; in a directory that existed before the run, each file is left and reported. An
    entry that cannot be read or removed is reported too, and the sweep goes on."""
    result = Sweep([], [])
    if os.path.isdir(root) and not os.path.islink(root):
        _sweep(os.path.abspath(root), run_id, inside_ours=False, result=result, keep=keep)
    return result


def _foreign_reason(path: str, run_id: str, keep: Keep | None) -> str | None:
    kept = keep(path) if keep is not None else None
    if kept is not None:
        return f"{path} ({kept})"
    made = read_record(os.path.join(path, CREATED_FILE))
    if made is not None and made.run_id != run_id:
        return f"{path} (made by {made.describe()})"
    lock = read_record(os.path.join(path, LOCK_FILE))
    if lock is not None and lock.run_id != run_id and _lock_is_held(os.path.join(path, LOCK_FILE)):
        return f"{path} (in use by {lock.describe()})"
    return None  # a lock file whose holder died (a killed actor's store) is no one's


def _lock_is_held(lock_file: str) -> bool:
    """True when some live process holds the flock on `lock_file` (the kernel drops it when it dies)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # also drops the shared lock taken to test


def _sweep(path: str, run_id: str, inside_ours: bool, result: Sweep, keep: Keep | None) -> bool:
    """Sweep one directory; True when it is gone. Only the root and directories of this run are listed:
    any other directory is reported whole and never entered (it may be unreadable, or huge, and is not
    ours to look through). An entry that cannot be read or removed is reported and skipped."""
    foreign = _foreign_reason(path, run_id, keep)
    if foreign is not None:
        result.left.append(foreign)
        return False
    ours = created_by(path, run_id) or (inside_ours and not os.path.exists(os.path.join(path, CREATED_FILE)))
    entries = _entries(path, result)
    if entries is None:
        return False
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                if ours or created_by(entry.path, run_id):
                    _sweep(entry.path, run_id, ours, result, keep)
                else:
                    reason = _foreign_reason(entry.path, run_id, keep)
                    result.left.append(reason or f"{entry.path} (not made by this run)")
            elif ours:
                os.unlink(entry.path)
            else:
                result.left.append(entry.path)
        except OSError as e:
            result.left.append(f"{entry.path} (cannot be swept: {e.strerror or e})")
    if not ours:
        return False
    remaining = _entries(path, result)
    if remaining is None or remaining:
        return False  # something foreign inside (already reported): the directory stays
    try:
        shutil.rmtree(path)
    except OSError as e:
        result.left.append(f"{path} (cannot be removed: {e.strerror or e})")
        return False
    result.removed.append(path)
    return True


def _entries(path: str, result: Sweep) -> list[os.DirEntry] | None:
    """The entries of `path` but the bookkeeping files, sorted by name; None (reported) when it cannot be read."""
    try:
        with os.scandir(path) as scan:
            return sorted((e for e in scan if e.name not in _BOOKKEEPING), key=lambda e: e.name)
    except OSError as e:
        result.left.append(f"{path} (cannot be read: {e.strerror or e})")
        return None


# Where a run must not create and remove its folders: the filesystem root, the system's own trees, and a
# home directory itself (inside home is fine). /lib* covers /lib, /lib32, /lib64, /libx32.
SYSTEM_DIRECTORIES = ("/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/boot", "/var", "/run")
SCRATCH_UNDER_SYSTEM = ("/var/tmp", "/dev/shm")  # the system's scratch (on disk, in RAM): made for files like these


def path_within(path: str, top: str) -> bool:
    """True when the normalized absolute `path` is `top` or lies below it (by path, not by inode)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def system_directory_reason(path: str, home: str) -> str | None:
    """Why the absolute, normalized `path` may not be a root a run creates folders in and removes them
    from (None when it may). The caller asks about the path as given and as resolved (symlinks)."""
    if path == "/":
        return "it is the filesystem root"
    if home and path == os.path.normpath(home):
        return "it is the home directory itself"
    if any(path_within(path, scratch) for scratch in SCRATCH_UNDER_SYSTEM):
        return None
    top = "/" + path.split("/")[1]
    if top in SYSTEM_DIRECTORIES or top.startswith("/lib"):
        return f"it is the system directory {top}" if path == top else f"it lies in the system directory {top}"
    return None
