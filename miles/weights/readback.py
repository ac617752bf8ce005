"""Rollout engine -> trainer, by reference: the engine's weights read back by a trainer on the same GPU.

After the handoff the colocated engine holds a bit-equal copy of the trainer's weights; a trainer that
dropped its own at sleep (the sleep plan's ``rebuild_from_engine``, :mod:`miles.offload.plan`) reads them
back at wake, before the engine releases them. Each weight travels as its own one-tensor bucket of
:mod:`miles.weights.transport`: on CUDA a CUDA IPC handle of the engine's own parameter (nothing is
copied until the trainer copies out); on CPU a file in ``/dev/shm`` (a copy: no saving over the trainer's
own offload, so the loop does not use it there; it keeps the path testable).

    shared = share_named_tensors(engine.model.named_parameters())   # the engine; keep until the trainer is done
    for name, tensor in open_named_tensors(shared): ...              # the trainer: copy out, then drop them
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .buckets import BucketSpec, TensorSpec, dtype_name, unpack_bucket
from .transport import SharedBucket, open_bucket, share_bucket


def share_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[SharedBucket]:
    """One SharedBucket per distinct tensor (a tied weight is shared once, under its first name)."""
    out, seen = [], set()
    for name, tensor in named:
        t = tensor.detach()
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        if not t.is_contiguous():
            raise ValueError(f"weight {name} is not contiguous: it cannot be shared by reference")
        flat = t.reshape(-1).view(torch.uint8)
        spec = BucketSpec(index=len(out), dtype=dtype_name(t.dtype), nbytes=flat.numel(),
                          tensors=(TensorSpec(name, tuple(t.shape), dtype_name(t.dtype), 0, flat.numel()),))
        out.append(share_bucket(spec, flat))
    return out


def open_named_tensors(shared: Iterable[SharedBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """The shared weights as ``(name, tensor)`` on this process's device (CUDA) or mapped (CPU), one at a time."""
    for bucket in shared:
        spec, flat = open_bucket(bucket)
        yield from unpack_bucket(spec, flat)
