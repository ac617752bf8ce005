"""sglang's routed experts as miles' :class:`~miles.routing.Routes` (R3 with ``--rollout-engine sglang``).

sglang records them when its server runs with ``enable_return_routed_experts`` (``--enable-return-routed-experts``)
and a generate request asks with ``return_routed_experts``: ``meta_info["routed_experts"]`` is then the base64 of
little-endian int32 ids ``[tokens, num_hidden_layers, num_experts_per_tok]``, one row per decoder layer (a dense
layer's row is zeros) for the prompt and the response but their last token (sglang's capturer, upstream miles'
reader). :class:`RoutedExpertsLayout` keeps the MoE layers' rows, in the compact dtype, checked as routes from a peer
are (:meth:`miles.routing.Routes.check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from miles.routing.routers import moe_decoder_layers_of_config, route_shape_of_config
from miles.routing.routes import Routes, RoutesError, RouteShape, decode_bounded_base64

__all__ = ["RoutedExpertsLayout"]

_SGLANG_ID_BYTES = 4  # int32


@dataclass(frozen=True)
class RoutedExpertsLayout:
    """Where each MoE layer's ids sit in sglang's per-decoder-layer record: ``moe_layers[i]`` is the decoder
    layer of route layer ``i`` (of ``shape``), among ``decoder_layers``."""

    shape: RouteShape
    decoder_layers: int
    moe_layers: tuple[int, ...]

    @classmethod
    def of_config(cls, model_config: Mapping[str, Any]) -> "RoutedExpertsLayout":
        """The layout of the model a config.json describes; ValueError for a model without MoE routers miles
        replays."""
        shape, moe_layers = route_shape_of_config(model_config), moe_decoder_layers_of_config(model_config)
        if shape is None or moe_layers is None:
            raise ValueError(f"sglang's routed experts: model_type {model_config.get('model_type')!r} has no MoE "
                             "router miles replays")
        sizes = model_config["text_config"] if isinstance(model_config.get("text_config"), dict) else model_config
        return cls(shape, int(sizes["num_hidden_layers"]), moe_layers)

    def routes(self, encoded: Any, sequence_tokens: int) -> Routes:
        """The routes of a sample of ``sequence_tokens`` (prompt + response) from its ``meta_info["routed_experts"]``;
        :class:`~miles.routing.RoutesError` naming what does not fit (the encoded length is bounded first)."""
        row_bytes = self.decoder_layers * self.shape.top_k * _SGLANG_ID_BYTES
        raw = decode_bounded_base64(encoded, sequence_tokens * row_bytes, "sglang's routed_experts",
                                    f"{sequence_tokens} tokens x {self.decoder_layers} layers x "
                                    f"top-{self.shape.top_k} int32")
        if len(raw) % row_bytes:
            raise RoutesError(f"sglang's routed_experts: {len(raw)} bytes is no whole number of tokens of "
                              f"{self.decoder_layers} layers x top-{self.shape.top_k} int32 ({row_bytes} bytes)")
        ids = np.frombuffer(raw, dtype="<i4").reshape(-1, self.decoder_layers, self.shape.top_k)
        return Routes.from_expert_ids(ids[:, list(self.moe_layers)], self.shape).check(self.shape, sequence_tokens)
