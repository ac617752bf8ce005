"""What the Megatron backend reads from a Qwen3.5-MoE transformers config (``qwen3_5_moe`` or its language
model's ``qwen3_5_moe_text``): an ``Architecture``, or ``UnsupportedModelError`` naming the field that cannot be
built exactly."""

from __future__ import annotations

from typing import Any

from ...architecture import Architecture, UnsupportedModelError
from ...pieces.gated_deltanet import gated_deltanet_tp_rules, read_gated_deltanet
from ...tp_shards import TpRules

__all__ = ["MODEL_TYPES", "text_config", "describe"]

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# The shared expert's sigmoid gate: one row, on every tensor-parallel rank
_SHARED_EXPERT_GATE_TP = TpRules(replicated=(r"shared_experts\.gate_weight",))


def text_config(hf_config: Any) -> Any:
    """The language model's config: a multimodal ``qwen3_5_moe`` config's ``text_config``, else the config."""
    if getattr(hf_config, "model_type", None) == "qwen3_5_moe" and getattr(hf_config, "text_config", None):
        return hf_config.text_config
    return hf_config


def _refuse(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"qwen3_5_moe: {field}={value!r} is not supported by the Megatron backend: {why}")


def _rotary(cfg: Any) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` of the text config (transformers 5 keeps both in rope_parameters)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise _refuse("rope_parameters['rope_type']", rope_type, "only the default rotary embedding is built")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("qwen3_5_moe: the config has no rope_theta (rope_parameters['rope_theta'])")
    factor = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
    rotary_dim = cfg.head_dim * factor
    if not 0 < factor <= 1 or rotary_dim != int(rotary_dim) or int(rotary_dim) % 2:
        raise _refuse("partial_rotary_factor", factor, f"head_dim {cfg.head_dim} x factor must be an even "
                      "number of rotary channels")
    return float(theta), factor


def _refuse_unbuilt(cfg: Any) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg.hidden_act, "the experts and the Gated DeltaNet are built with silu")
    if getattr(cfg, "attention_bias", False):
        raise _refuse("attention_bias", cfg.attention_bias, "attention is built without biases")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise _refuse("num_attention_heads", cfg.num_attention_heads,
                      f"must be a multiple of num_key_value_heads={cfg.num_key_value_heads}")
    if not cfg.shared_expert_intermediate_size:
        raise _refuse("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                      "transformers builds the shared expert with this width; it must be > 0")


def describe(hf_config: Any) -> Architecture:
    cfg = text_config(hf_config)
    _refuse_unbuilt(cfg)
    theta, factor = _rotary(cfg)
    gdn = read_gated_deltanet(cfg)
    n = cfg.num_hidden_layers
    return Architecture(
        model_type="qwen3_5_moe", num_layers=n, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.moe_intermediate_size,  # no dense MLP layers; Megatron requires a value
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
        norm_eps=float(cfg.rms_norm_eps), rope_theta=theta, init_std=float(getattr(cfg, "initializer_range", 0.02)),
        qkv_bias=False, qk_norm=True, tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        num_experts=cfg.num_experts, moe_layers=(True,) * n, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_topk=cfg.num_experts_per_tok, moe_renormalize=True,
        shared_expert_ffn_hidden_size=cfg.shared_expert_intermediate_size, shared_expert_gate=True,
        attention_output_gate=True, rotary_percent=factor, zero_centered_norms=True, linear_attention=gdn,
        mtp_layers=int(getattr(cfg, "mtp_num_hidden_layers", 0) or 0),
        tp_rules=gated_deltanet_tp_rules(gdn).joined(_SHARED_EXPERT_GATE_TP))
