"""Multi-latent attention (DeepSeek-V3, GLM-5): what a transformers config says of it, its weights' names, how they
split over TP, and the ``MLATransformerConfig`` fields (pure; ``mla_layers.py`` builds the modules).

Facts of transformers' modeling code (``modeling_deepseek_v3.py``, ``modeling_glm_moe_dsa.py``) this relies on:
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (per head ``[nope, rope]``; a plain ``q_proj`` without
``q_lora_rank``); ``kv_a_proj_with_mqa`` gives ``[kv_lora_rank, rope]``, the latent goes through
``kv_a_layernorm`` and ``kv_b_proj`` (per head ``[nope, v]``). Megatron's MLA keeps the same row orders, so every
weight maps unchanged (but the rope rows of a model that rotates halves: below). The two latent norms are built without an eps argument: 1e-6 whatever ``rms_norm_eps``
says (:data:`LATENT_NORM_EPS`).

Rope: megatron's MLA always rotates pairs ``(x0, x1), (x2, x3)...`` of the rope slice (``mla_rotary_interleaved``),
as transformers does with ``rope_interleave`` (GLM-5 always). DeepSeek-V3 with ``rope_interleave=False`` rotates
halves ``(x_i, x_{i+d/2})``: the rope rows of ``q_b_proj`` / ``q_proj`` (each head's) and ``kv_a_proj_with_mqa``
then convert reordered so that megatron's pairs are transformers' halves (the rotated values are the same, so the
attention is). YaRN (:class:`Yarn`, DeepSeek-V3 and Kimi-K2 checkpoints) is megatron's ``rope_type="yarn"``: the
same inverse frequencies and cos/sin scale as transformers' ``_compute_yarn_parameters``, and the same softmax
scale ``mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim)`` as its ``yarn_apply_mscale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch

from miles.sizing.tensors import Tensor, mla_tensors

from ..architecture import Architecture, rope_settings, theta_of
from ..errors import UnsupportedModelError
from ..tp_shards import TpRules
from ..weight_rules import Rule, layer_prefixes

__all__ = ["Mla", "Yarn", "LATENT_NORM_EPS", "MLA_TP_RULES", "read_mla", "read_mla_rope", "mla_attention_rules",
           "mla_attention_tensors", "mla_config_kwargs"]

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm are built without an eps

# Column-parallel: the up projections (rows head by head: whole heads per rank), the down projections (megatron's
# local MLA builds them column-parallel and gathers the latent) and the direct q projection.
MLA_TP_RULES = TpRules(column=(r"linear_(q|kv)_(down|up)_proj\.weight", r"linear_q_proj\.weight"))


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling in megatron's ``MLATransformerConfig`` terms (:func:`read_mla_rope` reads it)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class Mla:
    q_lora_rank: Optional[int]  # None: one q projection, no low-rank query
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool = True  # transformers' rope_interleave: pairs (x0, x1)...; False: halves (module doc)
    yarn: Optional[Yarn] = None  # None: the default rotary embedding

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def read_mla(hf_config: Any) -> Mla:
    return Mla(q_lora_rank=getattr(hf_config, "q_lora_rank", None), kv_lora_rank=hf_config.kv_lora_rank,
               qk_nope_head_dim=hf_config.qk_nope_head_dim, qk_rope_head_dim=hf_config.qk_rope_head_dim,
               v_head_dim=hf_config.v_head_dim)


def read_mla_rope(hf_config: Any) -> tuple[float, Optional[Yarn]]:
    """``(rope_theta, yarn)`` of an MLA config: the default rotary embedding (yarn None) or YaRN as transformers
    computes it; raises :class:`UnsupportedModelError` for what megatron's MLA cannot reproduce exactly."""
    rope_type, params = rope_settings(hf_config)
    if rope_type == "default":
        return theta_of(hf_config, params), None
    if rope_type != "yarn":
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported by the Megatron backend's multi-latent "
                                    "attention (the default rotary embedding or YaRN); use a config with either")
    theta = theta_of(hf_config, params)
    fixed = {"attention_factor": None, "partial_rotary_factor": 1.0, "truncate": True}
    for field, megatrons in fixed.items():
        if params.get(field, megatrons) != megatrons:
            raise UnsupportedModelError(f"rope_parameters[{field!r}]={params[field]!r}: megatron-core's YaRN has no "
                                        f"such setting (it computes as {field}={megatrons!r}); use a config without it")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise UnsupportedModelError(f"rope_parameters mscale={mscale!r} with mscale_all_dim={mscale_all_dim!r}: "
                                    "transformers then scales cos/sin by mscale(factor, 1) and the softmax by "
                                    "mscale(factor, mscale_all_dim)^2, which megatron-core's YaRN cannot combine; "
                                    "set mscale")
    original = int(params["original_max_position_embeddings"])
    # transformers' own defaults: factor from the context lengths, betas 32 / 1; mscale is read only together
    # with mscale_all_dim (else cos/sin scale by mscale(factor, 1): megatron's mscale 1 over mscale_all_dim 0)
    both = bool(mscale and mscale_all_dim)
    yarn = Yarn(factor=float(params.get("factor") or hf_config.max_position_embeddings / original),
                original_max_position_embeddings=original, beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), mscale=float(mscale) if both else 1.0,
                mscale_all_dim=float(mscale_all_dim) if both else 0.0)
    return float(theta), yarn


def _rope_halves_to_pairs(tensors: list[torch.Tensor], *, block: int, rope: int) -> torch.Tensor:
    """A weight of row blocks of ``block`` rows each ending in ``rope`` rope rows, those reordered from
    transformers' halves ``(x_0..x_{d/2-1}, y_0..)`` to megatron's pairs ``(x_0, y_0, x_1, y_1..)``."""
    (weight,) = tensors
    rest = weight.shape[1:]
    blocks = weight.reshape(-1, block, *rest)
    pairs = blocks[:, -rope:].reshape(-1, 2, rope // 2, *rest).transpose(1, 2).reshape(-1, rope, *rest)
    return torch.cat([blocks[:, :-rope], pairs], dim=1).reshape(weight.shape)


def _rope_pairs_to_halves(weight: torch.Tensor, *, block: int, rope: int) -> list[torch.Tensor]:
    """Inverse of :func:`_rope_halves_to_pairs`."""
    rest = weight.shape[1:]
    blocks = weight.reshape(-1, block, *rest)
    halves = blocks[:, -rope:].reshape(-1, rope // 2, 2, *rest).transpose(1, 2).reshape(-1, rope, *rest)
    return [torch.cat([blocks[:, :-rope], halves], dim=1).reshape(weight.shape)]


def mla_attention_rules(mla: Mla, layer: int) -> list[Rule]:
    """Layer ``layer``'s input norm (never fused: the MLA specs keep every norm separate) and attention."""
    hf, mc = layer_prefixes(layer)
    q = ([("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_a_layernorm.weight", "q_layernorm.weight"),
          ("q_b_proj.weight", "linear_q_up_proj.weight")] if mla.q_lora_rank is not None else
         [("q_proj.weight", "linear_q_proj.weight")])
    names = [*q, ("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
             ("kv_a_layernorm.weight", "kv_layernorm.weight"), ("kv_b_proj.weight", "linear_kv_up_proj.weight"),
             ("o_proj.weight", "linear_proj.weight")]
    # the weights whose rows rope rotates: the rows of each block end in its rope slice (a query head's; the key's)
    rope_blocks = {"q_b_proj.weight": mla.qk_head_dim, "q_proj.weight": mla.qk_head_dim,
                   "kv_a_proj_with_mqa.weight": mla.kv_lora_rank + mla.qk_rope_head_dim}

    def rule(h: str, m: str) -> Rule:
        if mla.rope_interleaved or h not in rope_blocks:
            return Rule((f"{hf}self_attn.{h}",), f"{mc}self_attention.{m}")
        shape = dict(block=rope_blocks[h], rope=mla.qk_rope_head_dim)
        return Rule((f"{hf}self_attn.{h}",), f"{mc}self_attention.{m}", partial(_rope_halves_to_pairs, **shape),
                    partial(_rope_pairs_to_halves, **shape))

    return [Rule((hf + "input_layernorm.weight",), mc + "input_layernorm.weight"), *(rule(h, m) for h, m in names)]


def mla_attention_tensors(arch: Architecture, layer: Optional[int], prefix: str) -> list[Tensor]:
    """The MLA's tensors under ``prefix`` (``model_tensors.AttentionTensors``), without an indexer."""
    m = arch.mla
    return mla_tensors(f"{prefix}.self_attention", arch.hidden_size, arch.num_attention_heads, m.q_lora_rank,
                       m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)


def mla_config_kwargs(mla: Mla, rope_theta: float) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of multi-latent attention, its rotary embedding the default or YaRN
    (on top of model.py's common ones)."""
    return dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        kv_channels=mla.qk_head_dim,
        qk_layernorm=True,  # the q / kv latent norms (built by mla_layers.LatentNorm with transformers' fixed eps)
        rotary_base=rope_theta, rotary_percent=1.0, **_rope_kwargs(mla.yarn),
    )


def _rope_kwargs(yarn: Optional[Yarn]) -> dict[str, Any]:
    if yarn is None:  # softmax scale 1/sqrt(qk_head_dim), as HF
        return dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return dict(rope_type="yarn", rotary_scaling_factor=yarn.factor,
                original_max_position_embeddings=yarn.original_max_position_embeddings, beta_fast=yarn.beta_fast,
                beta_slow=yarn.beta_slow, mscale=yarn.mscale, mscale_all_dim=yarn.mscale_all_dim)
