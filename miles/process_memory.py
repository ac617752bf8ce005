"""This process's host memory, from /proc/self/status (Linux; 0 where it cannot be read)."""


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes() -> int:
    """Current resident set (VmRSS) of this process."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set of this process (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    fork + exec, so a process started by a parent holding 12 GB reported 12 GB itself."""
    return _status_bytes("VmHWM")
