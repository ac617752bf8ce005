"""Megatron's gradient buffers while the trainer sleeps: dropped, not backed up.

DDP accumulates every grad into one flat buffer per (param dtype, grad dtype, expert or dense) group
(``buffer.grad_data``, fp32 here); each ``param.main_grad``, bucket slice and the optimizer's shard
grads are views of it. Every train step starts with ``ddp.zero_grad_buffer()``, so the grads of a
sleeping trainer are dead bytes, and with fp32 grads they are twice the bf16 params: copying them to
host or disk on every sleep, and back on every wake, would be most of what a streamed trainer moves.

:meth:`GradBuffers.release` frees their storage (``untyped_storage().resize_(0)``): every view shares
that storage object, so after :meth:`GradBuffers.restore` (re-allocated at the old size, zero-filled)
they all point at live memory again, with the offsets they had.

Order around torch_memory_saver (the actor's whole CUDA memory is pausable): release BEFORE the pause
and restore AFTER the resume. Freeing a block of a paused allocation would hand the caching allocator's
empty_cache a cudaFree of memory torch_memory_saver holds unmapped, and a re-allocation while paused
could be given a cached block inside an unmapped segment (the first write faults). Released before the
pause, the buffer's segment is free, ``empty_cache()`` returns it, and the pause never sees it.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["GradBuffers", "droppable_grad_storages"]


def droppable_grad_storages(buffers: Iterable) -> list[torch.UntypedStorage]:
    """The distinct grad storages of megatron ``_ParamAndGradBuffer``-like objects (``grad_data``,
    ``param_data``) that hold nothing but grads.

    A grad storage that is also a param buffer's is kept: megatron shares one buffer between the
    param all-gather and the grads for MXFP8 params (``shared_buffer``), and dropping it would drop
    the weights. ``None`` buffers (DDP without a distributed optimizer has no ``param_data``) are skipped."""
    buffers = list(buffers)
    param_storages = {b.param_data.untyped_storage()._cdata for b in buffers if b.param_data is not None}
    seen: set[int] = set()
    out: list[torch.UntypedStorage] = []
    for b in buffers:
        if b.grad_data is None:
            continue
        storage = b.grad_data.untyped_storage()
        key = storage._cdata
        if key in param_storages or key in seen:
            continue
        seen.add(key)
        out.append(storage)
    return out


class GradBuffers:
    """Release / restore of the droppable grad storages of a DDP's buffers (idempotent both ways)."""

    def __init__(self, buffers: Iterable):
        self.storages = droppable_grad_storages(buffers)
        self.nbytes = [s.nbytes() for s in self.storages]
        self.released = False

    def release(self) -> int:
        """Free the grad storages; returns the bytes freed (0 when already released)."""
        if self.released:
            return 0
        for storage in self.storages:
            storage.resize_(0)
        self.released = True
        return sum(self.nbytes)

    def restore(self) -> int:
        """Re-allocate the grad storages at their old sizes, zero-filled; returns the bytes allocated."""
        if not self.released:
            return 0
        for storage, nbytes in zip(self.storages, self.nbytes):
            storage.resize_(nbytes)
            # A fresh allocation holds whatever was there before. The next step's zero_grad_buffer would
            # clear it, but export, save and load between wake and that step should see defined grads.
            storage.fill_(0)
        self.released = False
        return sum(self.nbytes)

