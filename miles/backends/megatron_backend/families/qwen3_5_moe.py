"""Qwen3.5-MoE (transformers ``qwen3_5_moe`` and its language model ``qwen3_5_moe_text``) in the Megatron backend.

What transformers' ``modeling_qwen3_5_moe.py`` computes, and the megatron-core piece built for it
(``qwen3_5_moe_layers.py`` builds the layer spec; this module is pure, tested on CPU):

- Token mixer per layer, by ``layer_types``: "linear_attention" is a Gated DeltaNet (megatron-core's
  ``GatedDeltaNet``), "full_attention" (every ``full_attention_interval``-th layer by default) is gated
  softmax attention. Megatron's ``linear_attention_freq`` takes the same pattern as a list.
- Gated DeltaNet: HF's input projections ``in_proj_qkv`` (q, k, v rows), ``in_proj_z`` (output gate),
  ``in_proj_b`` (beta) and ``in_proj_a`` (alpha), concatenated in that row order, are Megatron's one
  ``in_proj``; the depthwise ``conv1d`` (over q, k, v), ``dt_bias``, ``A_log`` and ``out_proj`` map one to
  one. HF's gated output norm ``norm`` (its weight used as is) is ``out_norm``. ``A_log`` is trained in
  fp32 (:data:`NATIVE_FP32_PARAMS`): HF itself computes the decay from ``A_log.float()``.
- Full attention: ``q_proj`` yields, per head, the query and a sigmoid output gate (rows
  ``[heads, 2, head_dim]``); Megatron's ``linear_qkv`` with ``attention_output_gate`` holds, per query
  group, the group's query heads, then their gate heads, then the key head and the value head.
  q/k RMSNorms per head.
- Every other RMSNorm (layer inputs, q/k, final) scales by ``1 + weight`` in fp32: the layer spec builds
  the same norm, so those weights map unchanged.
- Rotary embedding on the first ``partial_rotary_factor`` of each head (Megatron's ``rotary_percent``).
  The text model's multimodal rotary sections (``mrope_section``) all read the same position for text
  tokens, which makes them the plain rotary embedding; image and video positions are not built.
- An MoE block in every layer: softmax router, top-k then renormalized (always; the config has no
  ``norm_topk_prob``), routed experts, and one shared expert scaled by ``sigmoid(shared_expert_gate(x))``
  (Megatron's ``moe_shared_expert_gate``).
- The multi-token-prediction layer of Qwen3.5 checkpoints (``mtp.*``) is not part of transformers' model
  (it drops those weights on load): it is neither built nor trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..architecture import Architecture, UnsupportedModelError

__all__ = ["MODEL_TYPES", "NATIVE_FP32_PARAMS", "GatedDeltaNetLayout", "text_config", "describe", "layer_rules",
           "gated_qkv_to_megatron", "gated_qkv_to_hf", "transformer_config_kwargs"]

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_LINEAR, _FULL = "linear_attention", "full_attention"
# Megatron parameter names (suffixes) kept in fp32 when the model trains in bf16.
NATIVE_FP32_PARAMS = ("self_attention.A_log",)


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


def describe(hf_config: Any) -> Architecture:
    """The :class:`Architecture` of a ``qwen3_5_moe`` / ``qwen3_5_moe_text`` config (see the module doc)."""
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
    return Architecture(
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


# ---- weight layouts --------------------------------------------------------------------------------
def gated_qkv_to_megatron(q_and_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          arch: Architecture) -> torch.Tensor:
    """HF ``q_proj`` (per head: query rows, then gate rows), ``k_proj``, ``v_proj`` -> Megatron's gated
    ``linear_qkv`` (per query group: its query heads, its gate heads, its key head, its value head)."""
    g, d, per_group = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    rest = k.shape[1:]
    heads = q_and_gate.reshape(g, per_group, 2, d, *rest)
    parts = (heads[:, :, 0].reshape(g, per_group * d, *rest), heads[:, :, 1].reshape(g, per_group * d, *rest),
             k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def gated_qkv_to_hf(qkv: torch.Tensor, arch: Architecture) -> list[torch.Tensor]:
    """Inverse of :func:`gated_qkv_to_megatron`: ``[q_proj, k_proj, v_proj]``."""
    g, d, per_group = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    rest = qkv.shape[1:]
    q, gate, k, v = torch.split(qkv.reshape(g, (2 * per_group + 2) * d, *rest),
                                [per_group * d, per_group * d, d, d], dim=1)
    q_and_gate = torch.stack([q.reshape(g, per_group, d, *rest), gate.reshape(g, per_group, d, *rest)], dim=2)
    return [q_and_gate.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def _same(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _one(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


Rule = tuple[tuple[str, ...], str, Callable[[list[torch.Tensor]], torch.Tensor],
             Callable[[torch.Tensor], list[torch.Tensor]]]


def _token_mixer_rules(arch: Architecture, i: int, hf: str, mc: str) -> list[Rule]:
    if arch.linear_attention.linear_layers[i]:
        gdn, attn = arch.linear_attention, hf + "linear_attn."
        rows = list(gdn.in_proj_rows)
        in_proj = tuple(f"{attn}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
        return [
            (in_proj, mc + "self_attention.in_proj.weight", _cat_rows,
             lambda t: list(torch.split(t, rows, dim=0))),
            *(((attn + name,), mc + f"self_attention.{ours}", _same, _one) for name, ours in (
                ("conv1d.weight", "conv1d.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"),
                ("norm.weight", "out_norm.weight"), ("out_proj.weight", "out_proj.weight"))),
        ]
    attn = hf + "self_attn."
    return [
        (tuple(f"{attn}{p}_proj.weight" for p in "qkv"), mc + "self_attention.linear_qkv.weight",
         lambda ts: gated_qkv_to_megatron(*ts, arch), lambda t: gated_qkv_to_hf(t, arch)),
        ((attn + "o_proj.weight",), mc + "self_attention.linear_proj.weight", _same, _one),
        ((attn + "q_norm.weight",), mc + "self_attention.q_layernorm.weight", _same, _one),
        ((attn + "k_norm.weight",), mc + "self_attention.k_layernorm.weight", _same, _one),
    ]


def layer_rules(arch: Architecture, i: int) -> list[Rule]:
    """Layer ``i``'s HF <-> Megatron rules, ``(hf_names, megatron_name, merge, split)``, except the router and
    routed experts (the common MoE rules of ``convert.py``)."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    shared = hf + "mlp.shared_expert."
    return [
        ((hf + "input_layernorm.weight",), mc + "input_layernorm.weight", _same, _one),
        *_token_mixer_rules(arch, i, hf, mc),
        ((hf + "post_attention_layernorm.weight",), mc + "pre_mlp_layernorm.weight", _same, _one),
        ((shared + "gate_proj.weight", shared + "up_proj.weight"), mc + "mlp.shared_experts.linear_fc1.weight",
         _cat_rows, lambda t: list(torch.chunk(t, 2, dim=0))),
        ((shared + "down_proj.weight",), mc + "mlp.shared_experts.linear_fc2.weight", _same, _one),
        ((hf + "mlp.shared_expert_gate.weight",), mc + "mlp.shared_experts.gate_weight", _same, _one),
    ]


# ---- megatron-core TransformerConfig ----------------------------------------------------------------
def transformer_config_kwargs(arch: Architecture) -> dict[str, Any]:
    """What ``TransformerConfig`` needs beyond the common GPT / MoE keywords (``model.py``)."""
    gdn = arch.linear_attention
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(linear) for linear in gdn.linear_layers],  # 1 = Gated DeltaNet
        linear_conv_kernel_dim=gdn.conv_kernel,
        linear_key_head_dim=gdn.key_head_dim,
        linear_value_head_dim=gdn.value_head_dim,
        linear_num_key_heads=gdn.num_key_heads,
        linear_num_value_heads=gdn.num_value_heads,
        attention_output_gate=arch.attention_output_gate,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=arch.shared_expert_gate,
    )
