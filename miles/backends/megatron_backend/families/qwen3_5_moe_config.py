"""What the Megatron backend reads from a Qwen3.5-MoE transformers config (``qwen3_5_moe`` or its language
model's ``qwen3_5_moe_text``): the keyword arguments of ``architecture.Architecture``, or
:class:`UnbuildableConfig` naming the field that cannot be built exactly. A leaf module (it imports none of
the backend's others): ``architecture.describe`` calls it; ``qwen3_5_moe.py`` says what each piece is built as.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MODEL_TYPES", "GatedDeltaNetLayout", "UnbuildableConfig", "text_config", "architecture_fields"]

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_LINEAR, _FULL = "linear_attention", "full_attention"


class UnbuildableConfig(ValueError):
    """A Qwen3.5-MoE config the backend cannot build exactly; ``architecture.describe`` raises it as its
    unsupported-model error."""


@dataclass(frozen=True)
class GatedDeltaNetLayout:
    """Which layers are Gated DeltaNets, and their head shapes (HF ``linear_*`` config fields)."""

    linear_layers: tuple[bool, ...]  # per layer: True = Gated DeltaNet, False = gated full attention
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

    @property
    def tp_row_sections(self) -> dict[str, tuple[int, ...]]:
        """The row sections of Megatron's ``in_proj`` (q, k, v, z, beta, alpha) and ``conv1d`` (q, k, v), each cut
        over tensor parallelism (tp_shards.py)."""
        k, v, heads = self.key_dim, self.value_dim, self.num_value_heads
        return {"in_proj": (k, k, v, v, heads, heads), "conv1d": (k, k, v)}


def text_config(hf_config: Any) -> Any:
    """The language model's config: a multimodal ``qwen3_5_moe`` config's ``text_config``, else the config."""
    if getattr(hf_config, "model_type", None) == "qwen3_5_moe" and getattr(hf_config, "text_config", None):
        return hf_config.text_config
    return hf_config


def _refuse(field: str, value: Any, why: str) -> UnbuildableConfig:
    return UnbuildableConfig(f"qwen3_5_moe: {field}={value!r} is not supported by the Megatron backend: {why}")


def _rotary(cfg: Any) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` of the text config (transformers 5 keeps both in rope_parameters)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise _refuse("rope_parameters['rope_type']", rope_type, "only the default rotary embedding is built")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise UnbuildableConfig("qwen3_5_moe: the config has no rope_theta (rope_parameters['rope_theta'])")
    factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
    rotary_dim = cfg.head_dim * factor
    if not 0 < factor <= 1 or rotary_dim != int(rotary_dim) or int(rotary_dim) % 2:
        raise _refuse("partial_rotary_factor", factor, f"head_dim {cfg.head_dim} x factor must be an even "
                      "number of rotary channels")
    return float(theta), factor


def _layout(cfg: Any) -> GatedDeltaNetLayout:
    types = tuple(cfg.layer_types)
    unknown = sorted(set(types) - {_LINEAR, _FULL})
    if unknown or len(types) != cfg.num_hidden_layers:
        raise _refuse("layer_types", types, f"needs one of {_LINEAR!r} / {_FULL!r} per layer "
                      f"({cfg.num_hidden_layers} layers)")
    layout = GatedDeltaNetLayout(
        linear_layers=tuple(t == _LINEAR for t in types), num_key_heads=cfg.linear_num_key_heads,
        num_value_heads=cfg.linear_num_value_heads, key_head_dim=cfg.linear_key_head_dim,
        value_head_dim=cfg.linear_value_head_dim, conv_kernel=cfg.linear_conv_kernel_dim)
    if layout.num_value_heads % layout.num_key_heads:
        raise _refuse("linear_num_value_heads", layout.num_value_heads,
                      f"must be a multiple of linear_num_key_heads={layout.num_key_heads}")
    return layout


def architecture_fields(hf_config: Any) -> dict[str, Any]:
    """``Architecture``'s keyword arguments for a ``qwen3_5_moe`` / ``qwen3_5_moe_text`` config."""
    cfg = text_config(hf_config)
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg.hidden_act, "the experts and the Gated DeltaNet are built with silu")
    if getattr(cfg, "attention_bias", False):
        raise _refuse("attention_bias", cfg.attention_bias, "attention is built without biases")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % kv_heads:
        raise _refuse("num_attention_heads", heads, f"must be a multiple of num_key_value_heads={kv_heads}")
    if not cfg.shared_expert_intermediate_size:
        raise _refuse("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                      "transformers builds the shared expert with this width; it must be > 0")
    theta, factor = _rotary(cfg)
    n = cfg.num_hidden_layers
    return dict(
        model_type="qwen3_5_moe", num_layers=n, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.moe_intermediate_size,  # no dense MLP layers; Megatron requires a value
        num_attention_heads=heads, num_query_groups=kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, norm_eps=float(cfg.rms_norm_eps), rope_theta=theta,
        init_std=float(getattr(cfg, "initializer_range", 0.02)), qkv_bias=False, qk_norm=True,
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        num_experts=cfg.num_experts, moe_layers=(True,) * n, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_topk=cfg.num_experts_per_tok, moe_renormalize=True,
        shared_expert_ffn_hidden_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True,
        attention_output_gate=True, rotary_percent=factor, zero_centered_norms=True, linear_attention=_layout(cfg))


