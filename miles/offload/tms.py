"""torch_memory_saver wiring for trainer offload on GPU.

The actor factory launches each GPU train actor with ``LD_PRELOAD`` = torch_memory_saver's hook,
``TMS_INIT_ENABLE=1`` (every CUDA allocation of the process is pausable from the start) and either
``TMS_INIT_ENABLE_CPU_BACKUP=1`` or ``TMS_INIT_ENABLE_DISK_BACKUP=1`` + ``TMS_DISK_BACKUP_DIR`` (the
rank's own directory) + ``TMS_DISK_BACKUP_CHUNK_MB``. Sleep is ``pause()``, wake is ``resume()``.

What a pause moves: the hook replaces ``cudaMalloc``, so torch_memory_saver knows allocations at
``cudaMalloc`` granularity (the caching allocator's segments, whole, with any free blocks inside them;
other libraries' ``cudaMalloc`` too), not tensors. ``pause()`` copies every allocation made with a
backup flag to pinned host memory or to a file ``<TMS_DISK_BACKUP_DIR>/tms_XXXXXX``, then unmaps it;
allocations made without one are dropped. The stats report the device memory the pause gave back
(``mem_get_info`` before and after, device-wide; nothing else on the device changes during a pause):
that is what was unmapped, i.e. what was backed up when every allocation carries the actor's backup
flag. ``memory_reserved()`` is torch's share only, and includes the segments of a torch MemPool (a
``torch_memory_saver.region``), whose free blocks ``empty_cache()`` keeps while the pool lives.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from .storage import OffloadStats

logger = logging.getLogger(__name__)


def tms_active() -> bool:
    """True in a process launched with the hook preloaded and TMS_INIT_ENABLE=1."""
    return os.environ.get("TMS_INIT_ENABLE") == "1" and "torch_memory_saver" in os.environ.get("LD_PRELOAD", "")


def preloaded_memory_saver():
    """torch_memory_saver's singleton, driving the preload hook this process runs under.

    Importing megatron-core's GPT model sets the singleton's hook mode to "torch" (megatron/core/inference/
    contexts/dynamic_context.py). The singleton would then talk to torch_memory_saver's other library,
    which does not see the hooked cudaMalloc: pause still reaches the hook, but ``disable()`` does not,
    so allocations meant to be plain (the weight handoff's buckets) stay pausable and CUDA IPC refuses
    them. So the mode is set back to "preload" before the singleton initializes. Call this after
    megatron is imported (once the singleton is initialized, megatron's import-time setting raises), and
    use torch_memory_saver only through it."""
    from torch_memory_saver import torch_memory_saver

    try:
        torch_memory_saver.hook_mode = "preload"
    except (AssertionError, AttributeError):
        pass  # initialized already, by an earlier call: miles uses torch_memory_saver only through this function
    return torch_memory_saver


class TmsOffloader:
    """Sleep/wake through torch_memory_saver (GPU only)."""

    def __init__(self, target: str, directory: Optional[str] = None):
        import torch

        self._torch = torch
        self._tms = preloaded_memory_saver()
        self.target = target
        self.directory = directory
        self._asleep = False
        if target == "cpu":
            # Keep the page-locked host copy between sleeps: allocating and registering it anew at every
            # pause costs seconds for a few GB. Host memory holds it all run long instead of while asleep.
            self._tms.retain_cpu_backup = True
        if target == "disk" and directory:
            os.makedirs(directory, exist_ok=True)

    @property
    def asleep(self) -> bool:
        return self._asleep

    def _device_free_bytes(self) -> int:
        free, _ = self._torch.cuda.mem_get_info()
        return int(free)

    def sleep(self, tensors=None) -> OffloadStats:  # tensors: unused, tms pauses every allocation
        if self._asleep:
            return OffloadStats("sleep", self.target, skipped=True, path=self.directory)
        start = time.perf_counter()
        torch = self._torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # whole free segments go back to the driver: no backup for them
        free_before = self._device_free_bytes()
        self._tms.pause()
        torch.cuda.synchronize()
        self._asleep = True
        paused = self._device_free_bytes() - free_before
        return OffloadStats("sleep", self.target, storages=0, bytes=paused, seconds=time.perf_counter() - start,
                            path=self.directory)

    def wake(self) -> OffloadStats:
        if not self._asleep:
            return OffloadStats("wake", self.target, skipped=True, path=self.directory)
        start = time.perf_counter()
        free_before = self._device_free_bytes()
        self._tms.resume()
        self._torch.cuda.synchronize()
        self._asleep = False
        resumed = free_before - self._device_free_bytes()
        return OffloadStats("wake", self.target, bytes=resumed, seconds=time.perf_counter() - start,
                            path=self.directory)

    def close(self, remove_directory: bool = False) -> None:
        if self._asleep:
            try:
                self.wake()
            except Exception:  # tearing down: the process is going away anyway
                logger.exception("torch_memory_saver resume during close failed")
