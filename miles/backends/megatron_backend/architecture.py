"""What the Megatron backend needs to know about a transformers config, as plain values.

:func:`describe` reads a ``PretrainedConfig`` of the Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral
families (and, through ``families/qwen3_5_moe_config.py``, Qwen3.5-MoE) into an :class:`Architecture`;
the model builder (``model.py``) and the weight converter (``convert.py``) both work from it, so the
two can never disagree about a layer's layout. Anything the backend cannot reproduce exactly (biases
other than Qwen2's q/k/v, sliding windows, rope scaling, shared experts outside Qwen3.5, a non-SiLU
activation) is rejected here with the config field to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import UnsupportedModelError
from .families import qwen3_5_moe_config
from .families.qwen3_5_moe_config import GatedDeltaNetLayout
from .families.glm_moe_dsa import MlaDsa, describe_glm_moe_dsa

__all__ = ["Architecture", "describe", "UnsupportedModelError", "SUPPORTED_MODEL_TYPES"]

# model_type -> which optional pieces the family has
_FAMILIES = {
    "llama": dict(qkv_bias=False, qk_norm=False, moe=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False, moe=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True, moe=False),
    "qwen3_moe": dict(qkv_bias=False, qk_norm=True, moe=True),
    "mixtral": dict(qkv_bias=False, qk_norm=False, moe=True),
}
# model_type -> the describe function of a family with its own module (it returns the Architecture's keyword
# arguments, from the config and its rope theta)
_OWN_MODULES = {"glm_moe_dsa": describe_glm_moe_dsa}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES) + tuple(_OWN_MODULES) + qwen3_5_moe_config.MODEL_TYPES


@dataclass(frozen=True)
class Architecture:
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # dense MLP layers
    num_attention_heads: int
    num_query_groups: int  # key/value heads (GQA)
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    init_std: float
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    # MoE (num_experts is None for dense models)
    num_experts: Optional[int] = None
    moe_layers: tuple[bool, ...] = ()
    moe_ffn_hidden_size: Optional[int] = None
    moe_topk: Optional[int] = None
    moe_renormalize: bool = True  # top-k probabilities renormalized to sum to 1
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(Linear(hidden, 1))
    attention_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the attention output
    rotary_percent: float = 1.0  # rotary embedding on this fraction of each head's channels
    zero_centered_norms: bool = False  # RMSNorms scale by (1 + weight)
    linear_attention: Optional[GatedDeltaNetLayout] = None  # Gated DeltaNet layers; None: attention only
    shared_expert_ffn_hidden_size: Optional[int] = None  # shared experts' SwiGLU width (all of them); None: none
    router_expert_bias: bool = False  # an fp32 per-expert bias added to the scores for the top-k choice only
    router_score_function: str = "softmax"  # "softmax" | "sigmoid"
    router_topk_scaling_factor: Optional[float] = None  # the top-k weights are multiplied by it
    router_num_groups: Optional[int] = None  # group-limited routing: experts in groups ...
    router_group_topk: Optional[int] = None  # ... of which each token may use this many
    # Multi-latent attention with a DeepSeek-sparse-attention indexer (GLM-5); None: grouped-query attention
    mla_dsa: Optional[MlaDsa] = None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def tp_row_sections(self) -> dict[str, tuple[int, ...]]:
        """The row sections tensor parallelism cuts each (tp_shards.py): the Gated DeltaNet's; {} without."""
        return self.linear_attention.tp_row_sections if self.linear_attention is not None else {}

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


def _rope_theta(hf_config: Any) -> float:
    """transformers >= 5 keeps rope settings in ``rope_parameters``; 4.x in ``rope_theta``/``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported by the Megatron backend (only the "
                                    "default rotary embedding); use a config without rope scaling")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    return float(theta)


def _moe_layers(hf_config: Any, model_type: str) -> tuple[bool, ...]:
    n = hf_config.num_hidden_layers
    if model_type == "mixtral":
        return (True,) * n
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))  # Qwen3MoeDecoderLayer's rule


def _reject(hf_config: Any, field: str, bad: Any, why: str) -> None:
    value = getattr(hf_config, field, None)
    if value == bad or (bad is True and value):
        raise UnsupportedModelError(f"{field}={value!r} is not supported by the Megatron backend: {why}")


def _describe_with_own_module(hf_config: Any, model_type: str) -> Architecture:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r}: the Megatron backend builds SwiGLU MLPs (silu) only")
    return Architecture(**_OWN_MODULES[model_type](hf_config, _rope_theta(hf_config)))


def describe(hf_config: Any) -> Architecture:
    """The :class:`Architecture` of a transformers config; raises :class:`UnsupportedModelError`."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in qwen3_5_moe_config.MODEL_TYPES:
        try:
            return Architecture(**qwen3_5_moe_config.architecture_fields(hf_config))
        except qwen3_5_moe_config.UnbuildableConfig as exc:
            raise UnsupportedModelError(str(exc)) from None
    if model_type in _OWN_MODULES:
        return _describe_with_own_module(hf_config, model_type)
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported by the Megatron backend; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (use --train-backend torch)")
    family = _FAMILIES[model_type]
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r}: the Megatron backend builds SwiGLU MLPs (silu) only")
    if not family["qkv_bias"]:
        _reject(hf_config, "attention_bias", True, "only Qwen2's q/k/v bias is built")
    _reject(hf_config, "mlp_bias", True, "MLPs are built without bias")
    _reject(hf_config, "use_sliding_window", True, "sliding-window attention is not built")
    if model_type == "mixtral":
        if getattr(hf_config, "sliding_window", None) is not None:
            raise UnsupportedModelError(f"sliding_window={hf_config.sliding_window!r}: sliding-window attention "
                                        "is not built by the Megatron backend; set it to None")
    if getattr(hf_config, "shared_expert_intermediate_size", None):
        raise UnsupportedModelError("shared experts are not supported by the Megatron backend")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    arch = dict(
        model_type=model_type, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=heads, num_query_groups=kv_heads,
        head_dim=head_dim, vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings, norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=_rope_theta(hf_config), init_std=float(getattr(hf_config, "initializer_range", 0.02)),
        qkv_bias=family["qkv_bias"], qk_norm=family["qk_norm"],
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
    if family["moe"]:
        if model_type == "mixtral":
            experts, moe_ffn, renormalize = hf_config.num_local_experts, hf_config.intermediate_size, True
        else:
            experts, moe_ffn = hf_config.num_experts, hf_config.moe_intermediate_size
            renormalize = bool(hf_config.norm_topk_prob)
        arch.update(num_experts=experts, moe_layers=_moe_layers(hf_config, model_type), moe_ffn_hidden_size=moe_ffn,
                    moe_topk=hf_config.num_experts_per_tok, moe_renormalize=renormalize)
    return Architecture(**arch)
