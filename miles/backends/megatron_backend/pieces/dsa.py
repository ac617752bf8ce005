"""DeepSeek sparse attention's indexer on top of multi-latent attention (GLM-5): what a transformers config says
of it, its weights' names, how they split over TP, and megatron-core's DSA config fields (pure;
``dsa_layers.py`` builds the block).

Facts of transformers' modeling code (``modeling_glm_moe_dsa.py``, 5.17 and 5.24) this relies on: the indexer's
key norm is ``nn.LayerNorm(index_head_dim, eps=1e-6)`` (weight and bias); RoPE (default type only) on the rope
slice, pairs interleaved ``(x0, x1), (x2, x3)...`` (megatron's ``dsa_indexer_rope_interleaved``); the indexer puts
its rope slice first, relu's the q.k scores, sums heads weighted by ``weights_proj(x) / sqrt(heads)``, and applies
no Hadamard rotation. Its layers by ``indexer_types``: "full" computes its own top-k, "shared" reuses one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from miles.sizing.tensors import Tensor, indexer_tensors

from ..architecture import Architecture
from ..errors import UnsupportedModelError
from ..tp_shards import TpRules
from ..weight_rules import Rule, layer_prefixes

__all__ = ["Dsa", "INDEXER_K_NORM_EPS", "DSA_TP_RULES", "read_dsa", "indexer_rules", "indexer_layer_tensors",
           "dsa_layout_sizes", "dsa_config_kwargs"]

INDEXER_K_NORM_EPS = 1e-6  # the indexer's k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)

# Replicated: the indexer's projections are duplicated on every tensor-parallel rank.
DSA_TP_RULES = TpRules(replicated=(r"\.indexer\..*",))


@dataclass(frozen=True)
class Dsa:
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # Which layers run their own indexer: megatron's rule (1-based layer n computes iff
    # max(n - offset, 0) % freq == 0); freq 1 = every layer.
    index_topk_freq: int
    index_skip_topk_offset: int
    indexer_layers: tuple[bool, ...]  # per layer: has its own indexer (HF indexer_types == "full")


def _indexer_schedule(types: list[str]) -> tuple[int, int]:
    """(freq, offset) with which megatron's index-sharing rule reproduces HF's ``indexer_types``."""
    n = len(types)
    full = [t == "full" for t in types]
    if all(full):
        return 1, 0
    for freq in range(2, n + 1):
        for offset in range(1, n + 1):
            if all(full[i] == (max(i + 1 - offset, 0) % freq == 0) for i in range(n)):
                return freq, offset
    raise UnsupportedModelError(f"indexer_types={types!r}: megatron-core shares DSA top-k indices only on a "
                                "periodic schedule (index_topk_freq / index_skip_topk_offset); use such a config")


def read_dsa(hf_config: Any) -> Dsa:
    if hf_config.index_head_dim < hf_config.qk_rope_head_dim:
        raise UnsupportedModelError(f"index_head_dim={hf_config.index_head_dim} < qk_rope_head_dim="
                                    f"{hf_config.qk_rope_head_dim}: the indexer's rope slice must fit its head")
    types = list(hf_config.indexer_types)
    freq, offset = _indexer_schedule(types)
    return Dsa(index_n_heads=hf_config.index_n_heads, index_head_dim=hf_config.index_head_dim,
               index_topk=hf_config.index_topk, index_topk_freq=freq, index_skip_topk_offset=offset,
               indexer_layers=tuple(t == "full" for t in types))


def indexer_rules(dsa: Dsa, layer: int) -> list[Rule]:
    """Layer ``layer``'s indexer weights (none on a layer that shares another's top-k); every one maps unchanged."""
    if not dsa.indexer_layers[layer]:
        return []
    hf, mc = layer_prefixes(layer)
    hf, mc = hf + "self_attn.indexer.", mc + "self_attention.core_attention.indexer."
    names = [("wq_b.weight", "linear_wq_b.weight"), ("wk.weight", "linear_wk.weight"),
             ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias"),
             ("weights_proj.weight", "linear_weights_proj.weight")]
    return [Rule((hf + h,), mc + m) for h, m in names]


def indexer_layer_tensors(arch: Architecture, layer: Optional[int], prefix: str) -> list[Tensor]:
    """The indexer's tensors on a layer that computes its own top-k (a multi-token-prediction layer, ``layer``
    None, has one); none on a layer that shares another's."""
    if layer is not None and not arch.dsa.indexer_layers[layer]:
        return []
    return indexer_tensors(f"{prefix}.self_attention", arch.hidden_size, arch.mla.q_lora_rank,
                           arch.dsa.index_n_heads, arch.dsa.index_head_dim)


def dsa_layout_sizes(arch: Architecture) -> dict[str, Any]:
    """A pipeline stage must start on a layer with its own indexer (megatron shares top-k within a stage)."""
    return dict(indexer_layers=arch.dsa.indexer_layers)


def dsa_config_kwargs(dsa: Dsa) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of the sparse attention (on top of ``mla.mla_config_kwargs``)."""
    return dict(
        experimental_attention_variant="dsa", dsa_indexer_n_heads=dsa.index_n_heads,
        dsa_indexer_head_dim=dsa.index_head_dim, dsa_indexer_topk=dsa.index_topk,
        dsa_indexer_topk_freq=dsa.index_topk_freq, dsa_indexer_skip_topk_offset=dsa.index_skip_topk_offset,
        dsa_indexer_loss_coeff=0.0,  # HF trains no indexer loss (its indexer runs under no_grad)
        dsa_kernel_backend="none",  # megatron's PyTorch path: no tilelang / cuDNN kernels
        dsa_indexer_rope_interleaved=True, dsa_indexer_rotate_activation=False, dsa_indexer_scoring_relu=True,
        dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS, dsa_indexer_k_norm_fp32=False,
        transformer_impl="local",
    )
