"""This process's host memory (/proc/self/status) and its writes to storage (/proc/self/io), on Linux."""

from __future__ import annotations


def _proc_self_field(name: str, field: str) -> int | None:
    """The first number after ``field:`` in /proc/self/<name>; None where it cannot be read (not Linux)."""
    try:
        with open(f"/proc/self/{name}") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _status_bytes(field: str) -> int:
    kib = _proc_self_field("status", field)
    return 0 if kib is None else kib * 1024


def rss_bytes() -> int:
    """Current resident set (VmRSS) of this process; 0 where it cannot be read."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set of this process (VmHWM); 0 where it cannot be read. Not getrusage's ru_maxrss: Linux
    carries that across fork + exec, so a process started by a parent holding 12 GB reported 12 GB itself."""
    return _status_bytes("VmHWM")


def disk_write_bytes() -> int | None:
    """Bytes this process (all its threads) has caused to be written to storage so far (``write_bytes`` of
    /proc/self/io); None where it cannot be read."""
    return _proc_self_field("io", "write_bytes")
