"""The weight payloads sglang's ``update_weights_from_tensor(load_format="flattened_bucket")`` takes.

sglang's flattened-bucket byte layout has changed across its versions, so nothing here spells it: the
bucket is built by sglang's own ``FlattenedTensorBucket`` and each tensor-parallel rank's payload by its
``MultiprocessingSerializer`` (a ForkingPickler dump, base64 text), both imported when first needed
(:meth:`SglangPayloads.from_sglang`). A payload of CUDA tensors carries CUDA IPC handles: the tensors
must stay alive until the update call returned (:class:`BuiltPayloads` holds them).

The trainer builds these for an engine whose ``weight_payload`` is
:data:`miles.rollout.contract.SGLANG_FLATTENED_BUCKET` (:mod:`miles.weights.push`): :meth:`SglangPayloads.bucket`
once per bucket, :meth:`SglangPayloads.serialize` for the engines it hands it to by reference, the bucket's
``flat`` for those it broadcasts to (sglang's ``update_weights_from_distributed(load_format="flattened_bucket")``
receives into a bucket of its own class built from the names, dtypes and shapes). The engine hands the
payloads to sglang as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

__all__ = ["BuiltPayloads", "SglangBucket", "SglangPayloads", "tensor_pairs"]


@dataclass
class SglangBucket:
    """One bucket in sglang's layout: the flat and sglang's metadata of it, and what it holds (``tensors``,
    ``bytes``: the source bytes)."""

    flat: Any
    metadata: Any
    tensors: int
    bytes: int


@dataclass
class BuiltPayloads:
    """One serialized payload per tensor-parallel rank, the flat they reference (kept alive until
    :meth:`release`), and what they hold (``tensors``, ``bytes``: the source bytes)."""

    payloads: list[str]
    flat: Any
    tensors: int
    bytes: int

    def release(self) -> None:
        self.flat = None


def tensor_pairs(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    """``named_tensors`` as a list of ``(name, tensor)`` pairs; TypeError naming what is wrong (a mapping, a
    pair that is not a name and a tensor)."""
    if isinstance(named_tensors, dict):
        raise TypeError("weights go as a list of (name, tensor) pairs, not a mapping: pass list(state_dict.items())")
    pairs = []
    for i, pair in enumerate(named_tensors):
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str)
                or not isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"weights[{i}] is not a (name, tensor) pair: got {type(pair).__name__}")
        pairs.append((pair[0], pair[1]))
    if not pairs:
        raise ValueError("no weights to send: the list of (name, tensor) pairs is empty")
    return pairs


class SglangPayloads:
    """Builds sglang's flattened-bucket payloads with the classes it is given (sglang's own, by
    :meth:`from_sglang`): ``bucket_cls(named_tensors=...)`` with ``get_flattened_tensor()`` /
    ``get_metadata()``, and ``serializer.serialize(obj, output_str=True)``."""

    def __init__(self, bucket_cls: type, serializer: Any):
        self.bucket_cls = bucket_cls
        self.serializer = serializer

    @classmethod
    def from_sglang(cls) -> "SglangPayloads":
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        return cls(FlattenedTensorBucket, MultiprocessingSerializer)

    def bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SglangBucket:
        """The tensors copied into one bucket of sglang's class, in this order (the copy the handoff makes)."""
        pairs = tensor_pairs(named_tensors)
        built = self.bucket_cls(named_tensors=pairs)
        return SglangBucket(flat=built.get_flattened_tensor(), metadata=built.get_metadata(), tensors=len(pairs),
                            bytes=sum(t.numel() * t.element_size() for _, t in pairs))

    def serialize(self, bucket: SglangBucket, tp_size: int) -> list[str]:
        """One payload per tensor-parallel rank (``tp_size`` of them), each serialized on its own so that every
        rank's deserialization owns its references (what sglang expects: its ranks each open one payload)."""
        if type(tp_size) is not int or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
        body = {"flattened_tensor": bucket.flat, "metadata": bucket.metadata}
        return [self.serializer.serialize(body, output_str=True) for _ in range(tp_size)]

    def build(self, named_tensors: Iterable[tuple[str, torch.Tensor]], tp_size: int) -> BuiltPayloads:
        """:meth:`bucket` and :meth:`serialize` in one."""
        bucket = self.bucket(named_tensors)
        return BuiltPayloads(payloads=self.serialize(bucket, tp_size), flat=bucket.flat, tensors=bucket.tensors,
                             bytes=bucket.bytes)
