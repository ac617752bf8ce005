"""Trainer offload for sleep (colocated RL: the trainer steps aside while the rollout engine runs).

- CPU torch backend: :class:`StorageOffloader`, host copies (``cpu``) or files (``disk``) plus
  ``untyped_storage().resize_(0)``; bit-exact, idempotent.
- GPU: torch_memory_saver (:class:`TmsOffloader`), configured through the actor's environment.
"""

from .storage import OffloadStats, StorageOffloader, make_resizable, unique_storages
from .tms import TmsOffloader, tms_active

__all__ = ["OffloadStats", "StorageOffloader", "TmsOffloader", "make_resizable", "make_offloader", "tms_active",
           "unique_storages"]


def make_offloader(target: str, directory=None, chunk_mb: int = 256, device_type: str = "cpu"):
    """The offloader for this process: torch_memory_saver on GPU when the actor was launched with its
    hook, otherwise the storage offloader (works for CPU and CUDA tensors alike)."""
    if device_type == "cuda" and tms_active():
        return TmsOffloader(target, directory)
    return StorageOffloader(target, directory, chunk_mb)
