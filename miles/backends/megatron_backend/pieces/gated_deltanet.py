"""The Gated DeltaNet (linear attention of Qwen3.5 / Qwen3-Next): what a transformers config says of it, its
weights' names, how they split over TP, and megatron-core's config fields (pure).

transformers' input projections ``in_proj_qkv`` (q, k, v rows), ``in_proj_z`` (output gate), ``in_proj_b``
(beta) and ``in_proj_a`` (alpha), concatenated in that row order, are megatron-core's one ``in_proj``; the
depthwise ``conv1d`` (over q, k, v), ``dt_bias``, ``A_log`` and ``out_proj`` map one to one; HF's gated output
norm ``norm`` (its weight used as is) is ``out_norm``. ``A_log`` trains in fp32 (:data:`NATIVE_FP32_PARAMS`):
transformers computes the decay from ``A_log.float()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.sizing.tensors import Tensor, gated_deltanet_tensors

from ..architecture import Architecture
from ..errors import UnsupportedModelError
from ..tp_shards import TpRules
from ..weight_rules import Rule, cat_rows

__all__ = ["GatedDeltaNetLayout", "NATIVE_FP32_PARAMS", "LAYER_TYPES", "read_gated_deltanet", "gated_deltanet_rules",
           "gated_deltanet_tp_rules", "gated_deltanet_config_kwargs", "gated_deltanet_layer_tensors",
           "gated_deltanet_layout_sizes"]

# Megatron parameter names (suffixes) kept in fp32 when the model trains in bf16.
NATIVE_FP32_PARAMS = ("self_attention.A_log",)
LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)


@dataclass(frozen=True)
class GatedDeltaNetLayout:
    """Which layers are Gated DeltaNets, and their head shapes (HF ``linear_*`` config fields)."""

    linear_layers: tuple[bool, ...]  # per layer: True = Gated DeltaNet, False = full attention
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def in_proj_rows(self) -> tuple[int, int, int, int]:
        """Rows of HF's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``: Megatron's ``in_proj`` in
        this order."""
        return 2 * self.key_dim + self.value_dim, self.value_dim, self.num_value_heads, self.num_value_heads


def read_gated_deltanet(cfg: Any) -> GatedDeltaNetLayout:
    """The layout of a config with ``layer_types`` and the ``linear_*`` fields (``cfg``: the language model's)."""
    types = tuple(cfg.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != cfg.num_hidden_layers:
        raise UnsupportedModelError(f"{cfg.model_type}: layer_types={types!r} is not supported by the Megatron "
                                    f"backend: needs one of {LINEAR!r} / {FULL!r} per layer ({cfg.num_hidden_layers} "
                                    "layers)")
    layout = GatedDeltaNetLayout(
        linear_layers=tuple(t == LINEAR for t in types), num_key_heads=cfg.linear_num_key_heads,
        num_value_heads=cfg.linear_num_value_heads, key_head_dim=cfg.linear_key_head_dim,
        value_head_dim=cfg.linear_value_head_dim, conv_kernel=cfg.linear_conv_kernel_dim)
    if layout.num_value_heads % layout.num_key_heads:
        raise UnsupportedModelError(f"{cfg.model_type}: linear_num_value_heads={layout.num_value_heads!r} is not "
                                    "supported by the Megatron backend: must be a multiple of linear_num_key_heads="
                                    f"{layout.num_key_heads}")
    return layout


def gated_deltanet_rules(gdn: GatedDeltaNetLayout, hf: str, mc: str) -> list[Rule]:
    """A Gated DeltaNet layer's token mixer: HF names under ``hf`` (``model.layers.{i}.``), Megatron's under ``mc``."""
    attn, rows = hf + "linear_attn.", list(gdn.in_proj_rows)
    in_proj = tuple(f"{attn}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
    return [
        Rule(in_proj, mc + "self_attention.in_proj.weight", cat_rows, lambda t: list(torch.split(t, rows, dim=0))),
        *(Rule((attn + name,), mc + f"self_attention.{ours}") for name, ours in (
            ("conv1d.weight", "conv1d.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
            ("norm.weight", "out_norm.weight"), ("out_proj.weight", "out_proj.weight"))),
    ]


def gated_deltanet_tp_rules(gdn: GatedDeltaNetLayout) -> TpRules:
    """Column: the per-head ``dt_bias`` and ``A_log``; sections: ``in_proj`` (q, k, v, z, beta, alpha) and
    ``conv1d`` (q, k, v), each cut; row: ``out_proj``; replicated: the output norm (per head dim)."""
    k, v, heads = gdn.key_dim, gdn.value_dim, gdn.num_value_heads
    return TpRules(column=(r"self_attention\.(dt_bias|A_log)",), row=(r"self_attention\.out_proj\.weight",),
                   replicated=(r"self_attention\.out_norm\.weight",),
                   sections=(("self_attention.in_proj", (k, k, v, v, heads, heads)),
                             ("self_attention.conv1d", (k, k, v))))


def gated_deltanet_layer_tensors(gdn: GatedDeltaNetLayout, hidden: int, prefix: str) -> list[Tensor]:
    """A Gated DeltaNet layer's tensors under ``prefix`` (megatron-core builds it as the layer's
    ``self_attention``)."""
    return gated_deltanet_tensors(f"{prefix}.self_attention", hidden, gdn.num_key_heads, gdn.num_value_heads,
                                  gdn.key_head_dim, gdn.value_head_dim, gdn.conv_kernel)


def gated_deltanet_layout_sizes(arch: Architecture) -> dict[str, Any]:
    """Tensor parallelism splits the Gated DeltaNet by heads."""
    gdn = arch.linear_attention
    return dict(linear_key_heads=gdn.num_key_heads, linear_value_heads=gdn.num_value_heads)


def gated_deltanet_config_kwargs(gdn: GatedDeltaNetLayout) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` fields of the Gated DeltaNet layers."""
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(linear) for linear in gdn.linear_layers],  # 1 = Gated DeltaNet
        linear_conv_kernel_dim=gdn.conv_kernel,
        linear_key_head_dim=gdn.key_head_dim,
        linear_value_head_dim=gdn.value_head_dim,
        linear_num_key_heads=gdn.num_key_heads,
        linear_num_value_heads=gdn.num_value_heads,
    )
