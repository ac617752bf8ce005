"""The routes of one sample: which experts each MoE layer chose for each token, in a compact dtype.

A :class:`Routes` holds ``[tokens, layers, top_k]`` expert ids, row-major little-endian bytes of the smallest
dtype that holds every id of the model (:func:`id_dtype`): uint8 up to 256 experts (all the seed's models:
GLM-5 and Qwen3.5 have 256, Qwen3-30B-A3B 128), int16 up to 32768, int32 beyond. One token costs
``layers * top_k * itemsize`` bytes (:attr:`RouteShape.bytes_per_token`): GLM-5-744B 75 MoE layers x top-8 =
600 B, Qwen3-30B-A3B 48 x 8 = 384 B, Qwen3.5-35B-A3B 40 x 8 = 320 B (upstream's int32 takes 4x that).

Token ``t`` is the sequence's token ``t`` (prompt then response, padding dropped) as the trainer's forward
sees it. An engine never runs the model on a sample's last token (nothing follows it), so what it records
covers ``len(prompt) + len(response) - 1`` tokens, as sglang's routed experts do; the last token's route only
shapes the logits after the response, which no loss reads. :meth:`Routes.check` takes either length.

A :class:`Routes` is a frozen dataclass of ints and bytes: it pickles (Ray) as its bytes. For JSON files
(recorded rollouts) :meth:`Routes.to_json` / :meth:`Routes.from_json`, the ids base64-encoded; what comes from
a file or a peer is checked against the model's :class:`RouteShape` (:meth:`Routes.check`): sizes, the token
count, every id below the expert count, no expert twice in one token's top-k.

This module imports torch only in the methods that make or return tensors.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["Routes", "RouteShape", "RoutesError", "UnsupportedRouterError", "id_dtype", "check_id_range",
           "decode_bounded_base64", "MAX_EXPERTS", "MAX_TOP_K", "MAX_MOE_LAYERS"]

# Bounds on what a file or a peer may claim, far above any model's (GLM-5: 256 experts, top-8, 75 MoE layers),
# so that a claimed shape cannot make a reader allocate much before the token count bounds it.
MAX_EXPERTS = 1 << 20
MAX_TOP_K = 64
MAX_MOE_LAYERS = 1024


class RoutesError(ValueError):
    """Routes that do not fit the model or are malformed; the message says which value and its bound."""


class UnsupportedRouterError(ValueError):
    """A model with MoE blocks of a family whose routers miles cannot record or replay
    (:mod:`miles.routing.routers` lists those it can)."""


def id_dtype(num_experts: int) -> np.dtype:
    """The smallest little-endian dtype that holds expert ids ``0 .. num_experts - 1``."""
    if num_experts <= 1 << 8:
        return np.dtype("<u1")
    if num_experts <= 1 << 15:
        return np.dtype("<i2")
    return np.dtype("<i4")


@dataclass(frozen=True)
class RouteShape:
    """What a model's routes look like: ``layers`` MoE layers (in model order), ``top_k`` experts per token
    out of ``num_experts``."""

    num_experts: int
    top_k: int
    layers: int

    def __post_init__(self):
        for name, value, bound in (("num_experts", self.num_experts, MAX_EXPERTS), ("top_k", self.top_k, MAX_TOP_K),
                                   ("layers", self.layers, MAX_MOE_LAYERS)):
            if type(value) is not int or not 1 <= value <= bound:
                raise RoutesError(f"routes: {name} must be an int in 1..{bound}, got {value!r}")
        if self.top_k > self.num_experts:
            raise RoutesError(f"routes: top_k {self.top_k} is more than the {self.num_experts} experts")

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * id_dtype(self.num_experts).itemsize


@dataclass(frozen=True)
class Routes:
    """The experts each MoE layer chose for each token of one sample (see the module docstring).

    ``ids``: ``[tokens, shape.layers, shape.top_k]`` ids as row-major little-endian bytes of
    ``id_dtype(shape.num_experts)``; each token's ids in the order the router returned them."""

    shape: RouteShape
    ids: bytes

    def __post_init__(self):
        if not isinstance(self.shape, RouteShape) or not isinstance(self.ids, bytes):
            raise RoutesError(f"routes: a RouteShape and bytes, got {type(self.shape).__name__} and "
                              f"{type(self.ids).__name__}")
        if len(self.ids) % self.shape.bytes_per_token:
            raise RoutesError(f"routes: {len(self.ids)} bytes is no whole number of tokens of "
                              f"{self.shape.bytes_per_token} bytes ({self.shape})")

    @property
    def tokens(self) -> int:
        return len(self.ids) // self.shape.bytes_per_token

    def array(self) -> np.ndarray:
        """The ids as a read-only ``[tokens, layers, top_k]`` numpy array of the compact dtype."""
        flat = np.frombuffer(self.ids, dtype=id_dtype(self.shape.num_experts))
        return flat.reshape(self.tokens, self.shape.layers, self.shape.top_k)

    def expert_ids(self, device: "torch.device | str" = "cpu") -> "torch.Tensor":
        """The ids as an int64 ``[tokens, layers, top_k]`` tensor (what routers return) on ``device``."""
        import torch

        return torch.from_numpy(self.array().astype(np.int64)).to(device)

    @classmethod
    def from_expert_ids(cls, ids: "torch.Tensor | np.ndarray", shape: RouteShape) -> "Routes":
        """Routes of a ``[tokens, layers, top_k]`` integer tensor or array of ids that a router chose (checked:
        each below ``shape.num_experts``; distinct in a token's top-k, as a router chooses them, is not)."""
        array = ids.cpu().numpy() if hasattr(ids, "cpu") else np.asarray(ids)
        expected = (shape.layers, shape.top_k)
        if array.ndim != 3 or array.shape[1:] != expected:
            raise RoutesError(f"routes: ids of shape {tuple(array.shape)}, expected [tokens, {expected[0]}, "
                              f"{expected[1]}] for {shape}")
        _check_range(array, shape)
        return cls(shape, array.astype(id_dtype(shape.num_experts)).tobytes())

    def check(self, shape: RouteShape, sequence_tokens: int) -> "Routes":
        """Itself, once it fits (:meth:`check_fit`) and every id is in range and no expert is twice in one token's
        top-k: what routes from a file or a peer must pass. :class:`RoutesError` naming the value otherwise."""
        self.check_fit(shape, sequence_tokens)
        array = self.array()
        _check_range(array, shape)
        _check_distinct(array)
        return self

    def check_fit(self, shape: RouteShape, sequence_tokens: int) -> "Routes":
        """Itself, once it is of route shape ``shape`` and covers a sequence (prompt + response) of
        ``sequence_tokens`` whole or but its last token; :class:`RoutesError` otherwise."""
        if self.shape != shape:
            raise RoutesError(f"routes of {self.shape}, the model's are {shape}: were they recorded with another "
                              "model?")
        if self.tokens not in (sequence_tokens - 1, sequence_tokens) or self.tokens < 1:
            raise RoutesError(f"routes of {self.tokens} tokens for a sequence of {sequence_tokens} tokens: they "
                              f"cover all its tokens or all but the last ({sequence_tokens - 1})")
        return self

    def to_json(self) -> dict:
        return {"num_experts": self.shape.num_experts, "top_k": self.shape.top_k, "layers": self.shape.layers,
                "ids": base64.b64encode(self.ids).decode("ascii")}

    @classmethod
    def from_json(cls, doc: Any, shape: RouteShape, sequence_tokens: int) -> "Routes":
        """What :meth:`to_json` wrote, checked (:meth:`check`) against ``shape`` and ``sequence_tokens``;
        the encoded ids' length is bounded by them before anything is decoded."""
        if not isinstance(doc, dict) or set(doc) != {"num_experts", "top_k", "layers", "ids"}:
            raise RoutesError("routes must be an object of num_experts, top_k, layers and ids, got "
                              f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
        claimed = RouteShape(num_experts=doc["num_experts"], top_k=doc["top_k"], layers=doc["layers"])
        if claimed != shape:
            raise RoutesError(f"routes of {claimed}, the model's are {shape}: were they recorded with another "
                              "model?")
        ids = decode_bounded_base64(doc["ids"], sequence_tokens * shape.bytes_per_token, "routes ids",
                                    f"{sequence_tokens} tokens x {shape.bytes_per_token} bytes")
        return cls(shape, ids).check(shape, sequence_tokens)


def decode_bounded_base64(encoded: Any, most_bytes: int, what: str, why: str) -> bytes:
    """The bytes of base64 text ``encoded`` that may hold at most ``most_bytes`` (``why``: what bounds them), its
    length checked before anything is decoded; :class:`RoutesError` naming ``what`` otherwise."""
    most = 4 * -(-max(most_bytes, 0) // 3)
    if not isinstance(encoded, str) or len(encoded) > most:
        raise RoutesError(f"{what} must be a base64 string of at most {most} characters ({why}), got "
                          f"{len(encoded) if isinstance(encoded, str) else type(encoded).__name__}")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise RoutesError(f"{what} is not valid base64") from None


def check_id_range(low: int, high: int, shape: RouteShape) -> None:
    """:class:`RoutesError` unless ids from ``low`` to ``high`` are expert ids of ``shape``."""
    if low < 0 or high >= shape.num_experts:
        bad = low if low < 0 else high
        raise RoutesError(f"routes: expert id {bad} is outside 0..{shape.num_experts - 1}")


def _check_range(array: np.ndarray, shape: RouteShape) -> None:
    if array.size:
        check_id_range(int(array.min()), int(array.max()), shape)


def _check_distinct(array: np.ndarray) -> None:
    """Sorting costs about 60 ms for 8k tokens of GLM-5's 75 layers x top-8: done for untrusted routes only."""
    ordered = np.sort(array, axis=-1)
    repeats = np.argwhere(ordered[..., 1:] == ordered[..., :-1])
    if len(repeats):
        token, layer, slot = (int(x) for x in repeats[0])
        raise RoutesError(f"routes: token {token}, MoE layer {layer} names expert {int(ordered[token, layer, slot])} "
                          "twice; a router chooses top_k distinct experts")
