"""Flattened per-dtype weight buckets: the unit the trainer hands to the rollout engine.

A bucket is one 1-D uint8 tensor holding tensors of one dtype, each starting at an aligned byte offset,
described by a :class:`BucketSpec` (names, shapes, offsets) that travels apart from the bytes as plain
dicts. Pure torch: no processes, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool")}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: a weight bucket holds one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling specs carry)."""
    name = str(dtype).removeprefix("torch.")
    torch_dtype(name)
    return name


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # bytes from the start of the bucket
    nbytes: int


@dataclass(frozen=True)
class BucketSpec:
    index: int
    dtype: str
    nbytes: int
    tensors: tuple[TensorSpec, ...]

    def to_dict(self) -> dict:
        return {"index": self.index, "dtype": self.dtype, "nbytes": self.nbytes,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": t.offset,
                             "nbytes": t.nbytes} for t in self.tensors]}

    @classmethod
    def from_dict(cls, d) -> BucketSpec:
        """A spec from untrusted plain data; ValueError names the first field that is wrong."""
        _check_keys(d, ("index", "dtype", "nbytes", "tensors"), "BucketSpec")
        index = _non_negative_int(d["index"], "BucketSpec.index")
        dtype = _known_dtype(d["dtype"], "BucketSpec.dtype")
        nbytes = _non_negative_int(d["nbytes"], "BucketSpec.nbytes")
        if not isinstance(d["tensors"], list):
            raise ValueError(f"BucketSpec.tensors must be a list of tensor dicts, got {type(d['tensors']).__name__}")
        tensors = tuple(_tensor_from_dict(t, f"BucketSpec.tensors[{i}]", dtype, nbytes)
                        for i, t in enumerate(d["tensors"]))
        _check_disjoint(tensors)
        return cls(index=index, dtype=dtype, nbytes=nbytes, tensors=tensors)


def _check_keys(d, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a dict, got {type(d).__name__}")
    missing, extra = set(keys) - d.keys(), d.keys() - set(keys)
    if missing or extra:
        raise ValueError(f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(map(str, extra))}; "
                         f"expected exactly {list(keys)}")


def _non_negative_int(value, field: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{field} must be a non-negative int, got {value!r}")
    return value


def _known_dtype(value, field: str) -> str:
    if not isinstance(value, str) or value not in _DTYPES:
        raise ValueError(f"{field} must be one of {sorted(_DTYPES)}, got {value!r}")
    return value


def _tensor_from_dict(d, where: str, bucket_dtype: str, bucket_nbytes: int) -> TensorSpec:
    _check_keys(d, ("name", "shape", "dtype", "offset", "nbytes"), where)
    if not isinstance(d["name"], str) or not d["name"]:
        raise ValueError(f"{where}.name must be a non-empty str, got {d['name']!r}")
    if not isinstance(d["shape"], list):
        raise ValueError(f"{where}.shape must be a list of ints, got {d['shape']!r}")
    shape = tuple(_non_negative_int(n, f"{where}.shape") for n in d["shape"])
    if _known_dtype(d["dtype"], f"{where}.dtype") != bucket_dtype:
        raise ValueError(f"{where}.dtype is {d['dtype']!r} in a {bucket_dtype!r} bucket: a bucket holds one dtype")
    item = torch_dtype(bucket_dtype).itemsize
    nbytes = _non_negative_int(d["nbytes"], f"{where}.nbytes")
    if nbytes != math.prod(shape) * item:
        raise ValueError(f"{where}.nbytes is {nbytes}, but shape {list(shape)} of {bucket_dtype} takes "
                         f"{math.prod(shape) * item} bytes")
    offset = _non_negative_int(d["offset"], f"{where}.offset")
    if offset % item:
        raise ValueError(f"{where}.offset {offset} is not aligned to the {item}-byte {bucket_dtype} element")
    if offset + nbytes > bucket_nbytes:
        raise ValueError(f"{where}.offset {offset} + nbytes {nbytes} runs past the bucket's {bucket_nbytes} bytes")
    return TensorSpec(name=d["name"], shape=shape, dtype=bucket_dtype, offset=offset, nbytes=nbytes)


def _check_disjoint(tensors: tuple[TensorSpec, ...]) -> None:
    names = {}
    for i, t in enumerate(tensors):
        if t.name in names:
            raise ValueError(f"BucketSpec.tensors[{i}].name {t.name!r} repeats tensors[{names[t.name]}]")
        names[t.name] = i
    placed = sorted((t.offset, i) for i, t in enumerate(tensors) if t.nbytes)
    for (prev_offset, prev), (offset, i) in zip(placed, placed[1:]):
        if prev_offset + tensors[prev].nbytes > offset:
            raise ValueError(f"BucketSpec.tensors[{i}].offset {offset} overlaps tensors[{prev}] "
                             f"(bytes {prev_offset}..{prev_offset + tensors[prev].nbytes})")


class _OpenBucket:
    """The sources of one dtype's bucket being filled, and where each goes."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.entries: list[tuple[TensorSpec, torch.Tensor]] = []
        self.end = 0

    def offset_for(self, align: int) -> int:
        return -(-self.end // align) * align


def _close(bucket: _OpenBucket, index: int) -> tuple[BucketSpec, list[torch.Tensor]]:
    spec = BucketSpec(index=index, dtype=bucket.dtype, nbytes=bucket.end,
                      tensors=tuple(t for t, _ in bucket.entries))
    return spec, [source for _, source in bucket.entries]


def fill_bucket(spec: BucketSpec, sources: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """A new 1-D uint8 flat on ``device`` (default: the first source's) holding ``sources`` at the spec's
    offsets (``sources[i]`` is ``spec.tensors[i]``)."""
    flat = torch.empty(spec.nbytes, dtype=torch.uint8, device=device or sources[0].device)
    for t, source in zip(spec.tensors, sources):
        view = flat[t.offset:t.offset + t.nbytes].view(source.dtype).view(source.shape)
        view.copy_(source.detach())
    return flat


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int, *, align: int = 256,
                 device: torch.device | None = None) -> Iterator[tuple[BucketSpec, torch.Tensor]]:
    """Pack tensors into per-dtype buckets of at most ``max_bytes`` (:func:`plan_buckets`), each yielded as a
    new 1-D uint8 flat on ``device`` (default: the first source's device, :func:`fill_bucket`)."""
    for spec, sources in plan_buckets(named_tensors, max_bytes, align=align):
        yield spec, fill_bucket(spec, sources, device)


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int, *,
                 align: int = 256) -> Iterator[tuple[BucketSpec, list[torch.Tensor]]]:
    """Group tensors into per-dtype buckets of at most ``max_bytes`` (a larger tensor is a bucket of its own),
    each tensor at an ``align``-byte offset, in arrival order; nothing is copied: each bucket comes as its spec
    and its source tensors (``sources[i]`` is ``spec.tensors[i]``), for whichever payload is built of it. A
    bucket is yielded as soon as the next tensor of its dtype does not fit, so at most one open bucket per
    dtype holds references to its sources."""
    if type(max_bytes) is not int or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align!r}")
    open_buckets: dict[str, _OpenBucket] = {}
    seen: set[str] = set()
    index = 0
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}: each weight is sent once")
        seen.add(name)
        dtype = dtype_name(tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes:  # alone, leaving the open bucket of its dtype to fill further
            bucket = _OpenBucket(dtype)
        else:
            bucket = open_buckets.setdefault(dtype, _OpenBucket(dtype))
            if bucket.offset_for(align) + nbytes > max_bytes:
                yield _close(bucket, index)
                index += 1
                bucket = open_buckets[dtype] = _OpenBucket(dtype)
        offset = bucket.offset_for(align)
        bucket.entries.append((TensorSpec(name=name, shape=tuple(tensor.shape), dtype=dtype, offset=offset,
                                          nbytes=nbytes), tensor))
        bucket.end = offset + nbytes
        if nbytes > max_bytes:
            yield _close(bucket, index)
            index += 1
    for bucket in open_buckets.values():
        if bucket.entries:
            yield _close(bucket, index)
            index += 1


def unpack_bucket(spec: BucketSpec, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, view)`` for each tensor of the bucket: views into ``flat`` (no copy) with the spec's shape
    and dtype."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"bucket {spec.index}: the flat must be a 1-D uint8 tensor, got {flat.dtype} "
                         f"of shape {tuple(flat.shape)}")
    if flat.numel() < spec.nbytes:
        raise ValueError(f"bucket {spec.index}: the flat is too small: {flat.numel()} bytes for a spec of "
                         f"{spec.nbytes} bytes")
    dtype = torch_dtype(spec.dtype)
    for t in spec.tensors:
        yield t.name, flat[t.offset:t.offset + t.nbytes].view(dtype).view(t.shape)
