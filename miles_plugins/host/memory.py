"""How much memory this process can still take on its host: MemAvailable, or less under a cgroup limit.

Both the store (its host-RAM tier, "auto" sizes) and the framework (validation, the per-node probe, the
offload of a sleeping trainer) size what they pin or copy into RAM by this one reading.
"""

from __future__ import annotations

import os


_PROC_FILE_MAX_BYTES = 64 << 10  # /proc/meminfo, /proc/self/cgroup and memory.stat are a few KiB; a cgroup value, a line


def available_host_memory(root: str = "/") -> int | None:
    """Bytes of memory this process can still take: the host's MemAvailable, or less when the process's
    cgroup (a SLURM job, a container) has a memory limit with less left under it; None where neither can
    be read. `root` is where the filesystem is (a test passes a fake one)."""
    readings = [r for r in (_meminfo_available(root), _cgroup_memory_left(root)) if r is not None]
    return min(readings) if readings else None


def _read_text(root: str, path: str) -> str | None:
    """The start of a small system file under `root`, None when it cannot be read."""
    try:
        fd = os.open(os.path.join(root, path.lstrip("/")), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, _PROC_FILE_MAX_BYTES).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _meminfo_available(root: str) -> int | None:
    for line in (_read_text(root, "proc/meminfo") or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemAvailable:" and fields[1].isdigit():
            return int(fields[1]) * 1024
    return None


# (mount point, limit file, usage file, memory.stat's clean-page-cache keys: (file LRU keys, dirty keys)) of
# the memory controller: cgroup v2, then v1 (its hierarchical "total_" counters) where v2 has none
_CGROUP_MEMORY = (("sys/fs/cgroup", "memory.max", "memory.current",
                   (("active_file", "inactive_file"), ("file_dirty", "file_writeback"))),
                  ("sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                   (("total_active_file", "total_inactive_file"), ("total_dirty", "total_writeback"))))


def _reclaimable_page_cache(stat_text: str | None, keys: tuple[tuple[str, ...], tuple[str, ...]]) -> int:
    """Clean page cache a cgroup's usage counts and the kernel drops before its limit is hit (files just
    read or written: a checkpoint, a model folder): its file pages less the dirty ones and those under
    writeback. 0 when memory.stat cannot be read."""
    values = {}
    for line in (stat_text or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].isdigit():
            values[fields[0]] = int(fields[1])
    file_keys, dirty_keys = keys
    return max(0, sum(values.get(k, 0) for k in file_keys) - sum(values.get(k, 0) for k in dirty_keys))


def _cgroup_memory_left(root: str) -> int | None:
    """The least memory left under a limit of this process's cgroup or one above it (a limit may be set on
    a job and its processes sit in a step below), None when no limit applies or none can be read.
    "max" (v2) is no limit; v1 writes no limit as a huge number, which the host's reading then undercuts.
    The usage counts the cgroup's page cache; its clean part is left too (the kernel reclaims it under the
    limit, as MemAvailable counts it): a model folder just written would otherwise shrink an "auto" tier."""
    paths = _own_cgroups(_read_text(root, "proc/self/cgroup") or "")
    for (mount, limit_file, usage_file, cache_keys), path in zip(_CGROUP_MEMORY, (paths.get("v2"), paths.get("v1"))):
        if path is None:
            continue
        left = []
        while True:
            directory = os.path.join(mount, path.lstrip("/"))
            limit = _read_text(root, os.path.join(directory, limit_file))
            usage = _read_text(root, os.path.join(directory, usage_file))
            if limit is not None and usage is not None and limit.strip().isdigit() and usage.strip().isdigit():
                clean_cache = _reclaimable_page_cache(_read_text(root, os.path.join(directory, "memory.stat")),
                                                      cache_keys)
                in_use = max(0, int(usage.strip()) - clean_cache)
                left.append(max(0, int(limit.strip()) - in_use))
            if path == "/":
                break
            path = os.path.dirname(path)
        if left:
            return min(left)
    return None


def _own_cgroups(text: str) -> dict[str, str]:
    """From /proc/self/cgroup: the unified (v2, ``0::<path>``) and the v1 memory controller's cgroup paths.
    A path that is not absolute or climbs with ``..`` is not a kernel's and is ignored."""
    found = {}
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/") or ".." in path.split("/"):
            continue
        if hierarchy == "0" and controllers == "":
            found["v2"] = os.path.normpath(path)
        elif "memory" in controllers.split(","):
            found["v1"] = os.path.normpath(path)
    return found
