"""Trainer -> rollout engine weight handoff by reference: nothing of the weights goes through Ray.

The trainer packs its weights into flattened per-dtype buckets of bounded size (:func:`iter_buckets`;
a :class:`BucketSpec` names each tensor's shape, dtype and byte offset and travels as a plain dict), and
hands each bucket over one of two paths:

- same GPU (colocated engine): :func:`share_bucket` gives a CUDA IPC handle of the bucket; the engine
  maps it with :func:`open_bucket`, copies the weights out into its own layout and drops the mapping.
  On CPU the same two calls go through a file in ``/dev/shm``.
- other GPUs or nodes: a :class:`WeightUpdateGroup` (NCCL; gloo on CPU) apart from the default process
  group; the source broadcasts with :func:`send_buckets`, each engine rank takes :func:`receive_bucket`.

The train rank's push, which builds the payload the engine names (miles' bucket or sglang's own), is
:mod:`miles.weights.push` (imported apart: it needs Ray).

Ownership: the producer keeps each bucket alive (the flat, the ``SharedBucket``) until the consumer
acknowledged it, then releases it (``SharedBucket.release()``, or lets the flat go after the broadcast).
"""

from .buckets import BucketSpec, TensorSpec, fill_bucket, iter_buckets, plan_buckets, torch_dtype, unpack_bucket
from .group import WeightUpdateGroup, free_port, receive_bucket, send_buckets
from .transport import SharedBucket, open_bucket, share_bucket

__all__ = ["BucketSpec", "SharedBucket", "TensorSpec", "WeightUpdateGroup", "fill_bucket", "free_port", "iter_buckets",
           "open_bucket", "plan_buckets", "receive_bucket", "send_buckets", "share_bucket", "torch_dtype",
           "unpack_bucket"]
