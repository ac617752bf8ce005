"""Sleep/wake: the one mechanism by which the trainer and the rollout engine step aside (colocated RL).

- :class:`StorageOffloader`: host copies (``cpu``) or one file (``disk``) plus
  ``untyped_storage().resize_(0)``; bit-exact, idempotent. The torch trainer's sleep on CPU (and on GPU
  without torch_memory_saver) and the embedded rollout engine's release_memory/resume_memory.
  :func:`make_resizable` prepares a loaded model for it (mmap'ed / numpy-backed / tied storages).
- GPU trainer: torch_memory_saver (:class:`TmsOffloader`), configured through the actor's environment.
- The sleep plan (``--offload-train-plan auto``, the default): :mod:`miles.offload.plan` decides each group
  of the trainer's tensors' way back (kept, rebuilt from the engine's copy or the store's masters,
  discarded, host RAM, disk); :class:`miles.offload.planned.PlannedOffloader` executes it with the storage
  offloader for what it writes out. The two above are then what ``offload-all`` uses.

    make_resizable(model)
    off = make_offloader("disk", directory, chunk_mb, device_type)
    off.sleep(list(model.parameters())); off.wake()   # OffloadStats each; off.close() drops the backup
"""

from .storage import OffloadStats, StorageOffloader, make_resizable, unique_storages
from .tms import TmsOffloader, tms_active

__all__ = ["OffloadStats", "StorageOffloader", "TmsOffloader", "make_resizable", "make_offloader", "tms_active",
           "unique_storages"]


def make_offloader(target: str, directory, chunk_mb: int, device_type: str, *, run_id=None, lock=None):
    """The offloader for this process: torch_memory_saver on GPU when the actor was launched with its
    hook, otherwise the storage offloader (works for CPU and CUDA tensors alike). ``run_id`` / ``lock``:
    see :class:`StorageOffloader` (torch_memory_saver writes into the directory its caller holds)."""
    if device_type == "cuda" and tms_active():
        return TmsOffloader(target, directory)
    return StorageOffloader(target, directory, chunk_mb, run_id=run_id, lock=lock)
