"""What the Megatron backend needs to know about a transformers config, as plain values.

Each model family (``families/``) reads its transformers config into an :class:`Architecture`; the model
builder (``model.py``), the weight converter (``convert.py``) and the TP cuts (``tp_shards.py``) all work from
it, so they can never disagree about a layer's layout. The optional pieces (``mla``, ``dsa``,
``linear_attention``) are data the families that compose them read; the shared modules never branch on them.
The helpers below are the config readers every family shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .errors import UnsupportedModelError
from .tp_shards import GPT_RULES, TpRules

__all__ = ["Architecture", "UnsupportedModelError", "rope_settings", "theta_of", "rope_theta", "require_silu", "reject"]


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
    # The optional pieces, each a value of its module in pieces/ (typed loosely here: the pieces build on this module)
    linear_attention: Optional[Any] = None  # pieces.gated_deltanet.GatedDeltaNetLayout; None: attention only
    shared_expert_ffn_hidden_size: Optional[int] = None  # shared experts' SwiGLU width (all of them); None: none
    router_expert_bias: bool = False  # an fp32 per-expert bias added to the scores for the top-k choice only
    router_score_function: str = "softmax"  # "softmax" | "sigmoid"
    router_topk_scaling_factor: Optional[float] = None  # the top-k weights are multiplied by it
    router_num_groups: Optional[int] = None  # group-limited routing: experts in groups ...
    router_group_topk: Optional[int] = None  # ... of which each token may use this many
    mla: Optional[Any] = None  # pieces.mla.Mla: multi-latent attention; None: grouped-query attention
    dsa: Optional[Any] = None  # pieces.dsa.Dsa: DeepSeek sparse attention's indexer on top of the MLA
    tp_rules: TpRules = GPT_RULES  # how the family's own tensors split over TP (tp_shards.py)
    mtp_layers: int = 0  # the checkpoint's multi-token-prediction layers: transformers drops them; not built

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


def rope_settings(hf_config: Any) -> tuple[str, dict[str, Any]]:
    """``(rope_type, parameters)``: transformers >= 5 keeps rope settings in ``rope_parameters``, 4.x in
    ``rope_theta``/``rope_scaling`` (merged, the former winning)."""
    params = {**(getattr(hf_config, "rope_scaling", None) or {}), **(getattr(hf_config, "rope_parameters", None) or {})}
    return params.get("rope_type") or params.get("type") or "default", params


def theta_of(hf_config: Any, params: dict[str, Any]) -> float:
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the config has no rope_theta (neither rope_parameters['rope_theta'] nor rope_theta)")
    return float(theta)


def rope_theta(hf_config: Any) -> float:
    """The theta of the default rotary embedding (any other rope type is refused)."""
    rope_type, params = rope_settings(hf_config)
    if rope_type != "default":
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported by the Megatron backend (only the "
                                    "default rotary embedding); use a config without rope scaling")
    return theta_of(hf_config, params)


def require_silu(hf_config: Any) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r}: the Megatron backend builds SwiGLU MLPs (silu) only")


def reject(hf_config: Any, field: str, bad: Any, why: str) -> None:
    """Refuse ``hf_config.field`` when it equals ``bad`` (``bad=True``: when it is truthy)."""
    value = getattr(hf_config, field, None)
    if value == bad or (bad is True and value):
        raise UnsupportedModelError(f"{field}={value!r} is not supported by the Megatron backend: {why}")
