"""Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral configs as an ``Architecture``: grouped-query attention (Qwen2's
q/k/v bias, Qwen3's q/k norms), SwiGLU MLPs, softmax-routed experts. Anything the backend cannot reproduce exactly
(biases other than Qwen2's q/k/v, sliding windows, rope scaling, shared experts, a non-SiLU activation) is refused
with the config field to change."""

from __future__ import annotations

from typing import Any

from ...architecture import Architecture, UnsupportedModelError, reject, require_silu, rope_theta

__all__ = ["MODEL_TYPES", "describe"]

# model_type -> which optional pieces the model has
_PIECES = {
    "llama": dict(qkv_bias=False, qk_norm=False, moe=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False, moe=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True, moe=False),
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True, moe=True),
    "mixtral": dict(qkv_bias=False, qk_norm=False, moe=True),
}
MODEL_TYPES = tuple(_PIECES)


def _moe_layers(hf_config: Any) -> tuple[bool, ...]:
    n = hf_config.num_hidden_layers
    if hf_config.model_type == "mixtral":
        return (True,) * n
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))  # Qwen3MoeDecoderLayer's rule


def _refuse_unbuilt(hf_config: Any, pieces: dict[str, bool]) -> None:
    require_silu(hf_config)
    if not pieces["qkv_bias"]:
        reject(hf_config, "attention_bias", True, "only Qwen2's q/k/v bias is built")
    reject(hf_config, "mlp_bias", True, "MLPs are built without bias")
    reject(hf_config, "use_sliding_window", True, "sliding-window attention is not built")
    if hf_config.model_type == "mixtral" and getattr(hf_config, "sliding_window", None) is not None:
        raise UnsupportedModelError(f"sliding_window={hf_config.sliding_window!r}: sliding-window attention "
                                    "is not built by the Megatron backend; set it to None")
    if getattr(hf_config, "shared_expert_intermediate_size", None):
        raise UnsupportedModelError("shared experts are not supported by the Megatron backend")


def _moe_fields(hf_config: Any) -> dict[str, Any]:
    if hf_config.model_type == "mixtral":
        experts, moe_ffn, renormalize = hf_config.num_local_experts, hf_config.intermediate_size, True
    else:
        experts, moe_ffn, renormalize = (hf_config.num_experts, hf_config.moe_intermediate_size,
                                         bool(hf_config.norm_topk_prob))
    return dict(num_experts=experts, moe_layers=_moe_layers(hf_config), moe_ffn_hidden_size=moe_ffn,
                moe_topk=hf_config.num_experts_per_tok, moe_renormalize=renormalize)


def describe(hf_config: Any) -> Architecture:
    pieces = _PIECES[hf_config.model_type]
    _refuse_unbuilt(hf_config, pieces)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return Architecture(
        model_type=hf_config.model_type, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=heads, num_query_groups=kv_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size, max_position_embeddings=hf_config.max_position_embeddings,
        norm_eps=float(hf_config.rms_norm_eps), rope_theta=rope_theta(hf_config),
        init_std=float(getattr(hf_config, "initializer_range", 0.02)), qkv_bias=pieces["qkv_bias"],
        qk_norm=pieces["qk_norm"], tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **(_moe_fields(hf_config) if pieces["moe"] else {}))
