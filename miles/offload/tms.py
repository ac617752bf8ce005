"""torch_memory_saver wiring for trainer offload on GPU.

The actor factory launches each GPU train actor with ``LD_PRELOAD`` = torch_memory_saver's hook,
``TMS_INIT_ENABLE=1`` (every CUDA allocation of the process is pausable from the start) and either
``TMS_INIT_ENABLE_CPU_BACKUP=1`` or ``TMS_INIT_ENABLE_DISK_BACKUP=1`` + ``TMS_DISK_BACKUP_DIR`` (the
rank's own directory) + ``TMS_DISK_BACKUP_CHUNK_MB``. Sleep is ``pause()``, wake is ``resume()``.
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


class TmsOffloader:
    """Sleep/wake through torch_memory_saver (GPU only)."""

    def __init__(self, target: str, directory: Optional[str] = None):
        import torch
        from torch_memory_saver import torch_memory_saver

        self._torch = torch
        self._tms = torch_memory_saver
        self.target = target
        self.directory = directory
        self._asleep = False
        if target == "disk" and directory:
            os.makedirs(directory, exist_ok=True)

    @property
    def asleep(self) -> bool:
        return self._asleep

    def _device_bytes(self) -> int:
        return int(self._torch.cuda.memory_reserved())

    def sleep(self, tensors=None) -> OffloadStats:  # tensors: unused, tms pauses every allocation
        if self._asleep:
            return OffloadStats("sleep", self.target, skipped=True, path=self.directory)
        start = time.perf_counter()
        torch = self._torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # freed cached blocks need no backup
        nbytes = self._device_bytes()
        self._tms.pause()
        torch.cuda.synchronize()
        self._asleep = True
        return OffloadStats("sleep", self.target, storages=0, bytes=nbytes, seconds=time.perf_counter() - start,
                            path=self.directory)

    def wake(self) -> OffloadStats:
        if not self._asleep:
            return OffloadStats("wake", self.target, skipped=True, path=self.directory)
        start = time.perf_counter()
        self._tms.resume()
        self._torch.cuda.synchronize()
        self._asleep = False
        return OffloadStats("wake", self.target, bytes=self._device_bytes(), seconds=time.perf_counter() - start,
                            path=self.directory)

    def close(self, remove_directory: bool = False) -> None:
        if self._asleep:
            try:
                self.wake()
            except Exception:  # tearing down: the process is going away anyway
                logger.exception("torch_memory_saver resume during close failed")
