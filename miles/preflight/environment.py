"""What ``miles train``'s validation may look at besides the arguments: this machine and its files.

:class:`Environment` holds probes (callables, so that probing is lazy: CUDA is probed only when a rule
needs it) and a few values; :func:`miles.preflight.validation.validate_args` asks it, never the machine
directly, so a test passes a fixed one and validation stays a pure function of (arguments, environment).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["Environment"]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _package_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (as pip names it), None when it is not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _cpu_count() -> int:
    return os.cpu_count() or 1


def _check_prompt_data(path: str) -> Optional[str]:
    """Parse the JSONL prompt file now (so a bad line fails before any actor starts); the problem or None."""
    from miles.rl.data import PromptDataError, load_prompt_data

    try:
        load_prompt_data(path)
    except PromptDataError as e:
        return str(e)
    return None


def _dir_writable(directory: str) -> bool:
    """Can this process create files in the existing ``directory``? Probed with an anonymous temporary
    file (gone when closed), because permission bits lie for root and for /proc or /sys."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _disk_free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def _filesystem_id(path: str) -> int:
    return os.stat(path).st_dev


def _read_json(path: str) -> Any:
    """The JSON document in ``path``, read bounded (it is untrusted): ValueError when it is larger than any
    config.json (:data:`miles.sizing.bounds.MAX_JSON_BYTES`), not JSON, or nested too deeply."""
    from miles.sizing.bounds import MAX_JSON_BYTES

    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"larger than {MAX_JSON_BYTES >> 20} MiB, more than any config.json")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _ray_running_here() -> bool:
    """Ray is initialized in this process: the run uses that cluster (miles.train starts none)."""
    ray = sys.modules.get("ray")  # never imported: not running, and validation does not import it
    return ray is not None and ray.is_initialized()


def _host_memory_available() -> Optional[int]:
    # the store's own reading, so validation and the store judge a host tier by the same number; imported
    # here because the stager brings torch, which validation loads only when it must
    from miles_plugins.host.memory import available_host_memory

    return available_host_memory()


@dataclass
class Environment:
    """What validation may look at besides the args (the module doc). Tests pass a fixed one."""

    python_version: tuple[int, int] = field(default_factory=lambda: tuple(sys.version_info[:2]))
    cuda_available: Callable[[], bool] = _cuda_available
    has_module: Callable[[str], bool] = _has_module
    package_version: Callable[[str], Optional[str]] = _package_version  # None: not installed
    path_exists: Callable[[str], bool] = os.path.exists
    is_dir: Callable[[str], bool] = os.path.isdir
    is_file: Callable[[str], bool] = os.path.isfile
    check_prompt_data: Callable[[str], Optional[str]] = _check_prompt_data  # None if the file parses
    # the three below are asked only about paths that exist (the nearest existing parent of a directory)
    dir_writable: Callable[[str], bool] = _dir_writable
    disk_free_bytes: Callable[[str], int] = _disk_free_bytes
    filesystem_id: Callable[[str], int] = _filesystem_id  # equal ids: the same filesystem
    read_json: Callable[[str], Any] = _read_json  # --hf-checkpoint's config.json: checked, and the model size
    scratch_root: Optional[str] = None  # None: $SCRATCH or the system temp dir
    # the cluster to join; None: the run starts its own single-node Ray (miles.train)
    ray_address: Optional[str] = field(default_factory=lambda: os.environ.get("RAY_ADDRESS") or None)
    ray_running: Callable[[], bool] = _ray_running_here  # True: the run uses it, whatever ray_address says
    # this machine's GPUs (when CUDA is available) and CPUs: the Ray cluster a run starts itself has these,
    # and joining a cluster, this node's bundle slots
    gpu_count: Callable[[], int] = _gpu_count
    cpu_count: Callable[[], int] = _cpu_count
    host_memory_available: Callable[[], Optional[int]] = _host_memory_available  # bytes; None: unknown
    run_id: Optional[str] = None  # None: "<YYYYmmdd-HHMMSS>-<pid>" (miles.config.paths.new_run_id)
    real_path: Callable[[str], str] = os.path.realpath  # symbolic links resolved, for the overlap checks
    home: str = field(default_factory=lambda: os.path.expanduser("~"))  # refused as the root itself
