"""The trainer's side of the weight handoff: what a train rank runs to hand its weights to the rollout engines.

    stats = push_weights(trainer.hf_weights(), payload=SGLANG_FLATTENED_BUCKET, tp_size=1,
                         ipc_engines=[...], group=weight_group, group_engines=[...], max_bucket_bytes=...)

The driver (:class:`miles.ray.weight_sync.WeightSync`) chose the routes and names the payload the engines
consume (their ``weight_payload``, :data:`miles.rollout.contract.WEIGHT_PAYLOADS`); this rank builds exactly
that, one bucket at a time (:func:`miles.weights.plan_buckets`: one copy of the weights into the bucket):

- :data:`~miles.rollout.contract.MILES_FLAT_BUCKET`: miles' aligned flat; by reference a
  :class:`miles.weights.SharedBucket` (a CUDA IPC handle, or a file in /dev/shm on CPU), by broadcast the flat
  itself (:func:`miles.weights.send_buckets`).
- :data:`~miles.rollout.contract.SGLANG_FLATTENED_BUCKET`: sglang's own ``FlattenedTensorBucket`` (its class,
  imported here at run time); by reference its ``MultiprocessingSerializer`` payloads, one per tensor-parallel
  rank, which the engine hands to sglang as they are; by broadcast its flat. An sglang engine whose
  tensor-parallel ranks run on the GPUs of several train ranks (:class:`PayloadPeers`) gets each rank's payload
  from the train rank on that rank's GPU: every sglang rank reads its own GPU's memory.

Each bucket goes to every engine of this rank at once (``ipc_engines`` by reference; with a ``group``, of which
this rank is the source, ``group_engines`` by broadcast); the next is built once every engine acknowledged, and
the bucket is released on every path (``finally``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from miles.rollout.contract import FLATTENED_BUCKET, MILES_FLAT_BUCKET, SGLANG_FLATTENED_BUCKET, WEIGHT_PAYLOADS

from .buckets import BucketSpec, fill_bucket, plan_buckets
from .group import send_buckets
from .transport import share_bucket

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def bucket_allocation():
    """Buckets must come from a plain cudaMalloc to be shared through CUDA IPC: under torch_memory_saver
    (the trainer's sleep/wake) every allocation is a virtual-memory mapping CUDA IPC cannot export, so
    the handoff allocates outside it (``torch_memory_saver.disable()``: a private pool of plain
    allocations, dropped at its end). Emptying torch's cache after it returns that pool's memory to CUDA:
    torch_memory_saver does not pause it, so it would otherwise stay on the GPU while the trainer sleeps."""
    from miles.offload.tms import preloaded_memory_saver, tms_active

    if not tms_active():
        yield
        return
    try:
        with preloaded_memory_saver().disable():
            yield
    finally:
        torch.cuda.empty_cache()


class Sharer:
    """Shares a bucket's flat by reference (``share(flat)``), with one fallback: when CUDA refuses to export a
    bucket (memory CUDA IPC cannot share), this and every later bucket of the handoff go through host memory
    instead (a device to host copy: slower, still outside Ray's object store), with one warning."""

    def __init__(self):
        self.through_host = False

    def share(self, index: int, flat: torch.Tensor, share: Callable[[torch.Tensor], Any]) -> Any:
        if self.through_host:
            return share(flat.cpu())
        try:
            return share(flat)
        except RuntimeError as e:  # torch.AcceleratorError: cudaIpcGetMemHandle refused the allocation
            if not flat.is_cuda:
                raise
            logger.warning("CUDA IPC refused weight bucket %d (%s); handing the weights over through host "
                           "shared memory instead (slower)", index, str(e).splitlines()[0])
            self.through_host = True
            return share(flat.cpu())


class MilesFlatBuckets:
    """:data:`MILES_FLAT_BUCKET`: miles' aligned flat of each bucket."""

    def build(self, spec: BucketSpec, sources: list[torch.Tensor]) -> torch.Tensor:
        return fill_bucket(spec, sources)

    def share(self, sharer: Sharer, spec: BucketSpec, flat: torch.Tensor, tp_size: int):
        """``(payloads, release)``: one SharedBucket (the engine opens it once for all its ranks)."""
        shared = sharer.share(spec.index, flat, lambda f: share_bucket(spec, f))
        return [shared], shared.release

    def broadcast(self, group, spec: BucketSpec, flat: torch.Tensor) -> None:
        send_buckets(group, [(spec, flat)])

    def nbytes(self, spec: BucketSpec, flat: torch.Tensor) -> int:
        return spec.nbytes


class SglangFlattenedBuckets:
    """:data:`SGLANG_FLATTENED_BUCKET`: sglang's own bucket of each bucket's tensors, built with the class of
    the sglang installed here (the same sglang as the engine's: its layout changed across versions)."""

    def __init__(self):
        from miles.rollout.sglang.payloads import SglangPayloads

        self.payloads = SglangPayloads.from_sglang()

    def build(self, spec: BucketSpec, sources: list[torch.Tensor]):
        return self.payloads.bucket([(t.name, s) for t, s in zip(spec.tensors, sources)])

    def share(self, sharer: Sharer, spec: BucketSpec, bucket, tp_size: int):
        """``(payloads, release)``: ``tp_size`` serialized payloads of the bucket (CUDA: IPC handles of its flat).
        On CPU the flat is pickled by the name of a shared-memory file (torch's file_system strategy): the
        default strategy passes a file descriptor over a socket that only a process of the producer's family
        may open (multiprocessing's authkey), and an engine is another Ray actor."""
        def serialize(flat):
            shared = dataclasses.replace(bucket, flat=flat)
            if flat.is_cuda:
                return shared, self.payloads.serialize(shared, tp_size)
            with _cpu_sharing_strategy("file_system"):
                return shared, self.payloads.serialize(shared, tp_size)

        kept, serialized = sharer.share(spec.index, bucket.flat, serialize)
        return serialized, lambda: _drop(kept)

    def broadcast(self, group, spec: BucketSpec, bucket) -> None:
        group.broadcast(bucket.flat)

    def nbytes(self, spec: BucketSpec, bucket) -> int:
        return bucket.flat.numel() * bucket.flat.element_size()


def _drop(bucket) -> None:
    bucket.flat = None
    if torch.cuda.is_initialized():
        torch.cuda.ipc_collect()  # frees allocations whose consumers let go after ours was dropped


@contextlib.contextmanager
def _cpu_sharing_strategy(strategy: str):
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


@dataclass(frozen=True)
class PayloadPeers:
    """The train ranks on the GPUs of one sglang engine's tensor-parallel ranks, in the engine's rank order
    (``ranks``), the one of them that calls the engine (``caller``, the engine's colocated rank), and their
    process group. Per bucket each serializes its own copy; the caller gathers the payloads, calls the engine,
    and says how it went; every rank keeps its bucket alive until then."""

    ranks: tuple[int, ...]
    caller: int
    group: Any = None  # each rank's own (the driver plans the peers without it)

    @property
    def calls_engine(self) -> bool:
        return dist.get_rank() == self.caller

    def gather(self, payload: Any) -> Optional[list]:
        """Every rank's payload, in ``ranks`` order, on the caller (None on the others)."""
        gathered = [None] * len(self.ranks) if self.calls_engine else None
        dist.gather_object(payload, gathered, dst=self.caller, group=self.group)
        if gathered is None:
            return None
        by_rank = dict(zip(sorted(self.ranks), gathered))  # a group orders its members by global rank
        return [by_rank[r] for r in self.ranks]

    def settle(self, engine_ok: bool) -> None:
        """After the engine's call: the caller tells the others whether it succeeded (they raise if not,
        rather than wait in the next bucket's gather for a rank that stopped)."""
        flag = [engine_ok]
        dist.broadcast_object_list(flag, src=self.caller, group=self.group)
        if not flag[0] and not self.calls_engine:
            raise RuntimeError(f"the rollout engine fed by train ranks {list(self.ranks)} failed to load a weight "
                               f"bucket (see train rank {self.caller}'s error)")


def payload_builder(payload: str):
    """The builder of the engines' ``weight_payload`` kind; ValueError naming the kinds for another."""
    if payload == MILES_FLAT_BUCKET:
        return MilesFlatBuckets()
    if payload == SGLANG_FLATTENED_BUCKET:
        return SglangFlattenedBuckets()
    raise ValueError(f"weight payload {payload!r} is not one of {WEIGHT_PAYLOADS}: the engine's info() names "
                     "what it consumes")


def push_weights(named_tensors: Iterable, *, payload: str, tp_size: int = 1, ipc_engines: Sequence[Any] = (),
                 group=None, group_engines: Sequence[Any] = (), peers: Optional[PayloadPeers] = None,
                 max_bucket_bytes: int) -> dict[str, Any]:
    """Hand ``named_tensors`` (HF-layout ``(name, tensor)`` pairs on this rank's device) to the engines as
    ``payload`` (each engine ``tp_size`` ranks), one bucket at a time: each bucket is shared with
    ``ipc_engines`` (Ray actor handles; with ``peers``, one sglang engine fed one payload by each of its ranks'
    train ranks, this rank's among them) and, with a ``group`` (this rank its source), broadcast to
    ``group_engines``; the next bucket is built once every engine acknowledged the last. Returns the
    handoff's stats for the metrics."""
    import ray

    start = time.perf_counter()
    sharer = Sharer()
    buckets = nbytes = largest = 0
    broadcast = group is not None and bool(group_engines)
    feeds = bool(ipc_engines) or broadcast or peers is not None
    builder = payload_builder(payload) if feeds else None
    with bucket_allocation():
        for spec, sources in plan_buckets(named_tensors, max_bucket_bytes):
            if not feeds:  # a rank whose iteration only takes part in the expert gathers
                continue
            bucket = builder.build(spec, sources)
            del sources
            release, engine_ok = None, False
            try:
                refs = []
                if peers is not None:  # this rank's own payload; the engine gets every peer's at once
                    shared, release = builder.share(sharer, spec, bucket, 1)
                    gathered = peers.gather(shared[0])
                    if gathered is not None:
                        refs += [e.update_weights_from_tensor.remote(gathered, load_format=FLATTENED_BUCKET)
                                 for e in ipc_engines]
                elif ipc_engines:
                    shared, release = builder.share(sharer, spec, bucket, tp_size)
                    refs += [e.update_weights_from_tensor.remote(shared, load_format=FLATTENED_BUCKET)
                             for e in ipc_engines]
                if broadcast:
                    refs += [e.update_weights_from_distributed.remote([spec.to_dict()], group.group_name)
                             for e in group_engines]
                    builder.broadcast(group, spec, bucket)
                ray.get(refs)
                engine_ok = True
            finally:  # an engine that failed or died, or this actor interrupted: the bucket goes all the same
                try:
                    if peers is not None:  # the peers' payloads stay alive until the engine has read them
                        peers.settle(engine_ok)
                finally:
                    if release is not None:
                        release()
            size = builder.nbytes(spec, bucket)
            del bucket
            buckets += 1
            nbytes += size
            largest = max(largest, size)
    return {"weight_handoff_seconds": time.perf_counter() - start, "weight_handoff_bytes": nbytes,
            "weight_handoff_buckets": buckets, "weight_handoff_largest_bucket_bytes": largest,
            "weight_handoff_through_host": sharer.through_host}
