"""megatron-core's DSA decoder block (multi-latent attention + sparse-attention indexer) without Transformer
Engine: GLM-5's layer spec for ``model.build_gpt_model`` (megatron-core is imported inside the functions).

megatron-core 0.19.2 writes its DSA spec for Transformer Engine: the block-level helper asserts
``transformer_impl == "transformer_engine"``, and ``LocalSpecProvider`` has no ``linear()``. The per-layer
helper (``get_transformer_layer_with_experimental_attention_variant_spec``) takes any backend, so this module
supplies one: megatron's local modules plus

- ``linear()``: ``ColumnParallelLinear`` for the MLA down projections (the one non-TE class absorbed MLA
  accepts there); the indexer's projections, which megatron builds with ``parallel_mode="duplicated"`` (a
  TE argument), are :func:`duplicated_linear`'s class (tensor parallelism is 1 here);
- the q/kv latent norms with transformers' fixed eps (``glm_moe_dsa.LATENT_NORM_EPS``) and the indexer's key
  LayerNorm with the configured one (``dsa_indexer_k_norm_epsilon``);
- no fused norm+linear: every norm is its own module (``convert.py``'s unfused names).

Sparse attention runs megatron's PyTorch path (``dsa_kernel_backend="none"``: no tilelang, no cuDNN).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .glm_moe_dsa import LATENT_NORM_EPS

__all__ = ["dsa_decoder_block_spec", "duplicated_linear", "LocalDsaSpecProvider", "QKNorm"]


@functools.cache
def duplicated_linear() -> type:
    """``DuplicatedLinear``: a projection every tensor-parallel rank holds whole (megatron's DSA indexer asks
    for TE's ``parallel_mode="duplicated"``); with tensor parallelism 1, a plain ``ColumnParallelLinear``.
    Made on first use: megatron-core is imported only on the GPU host."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class DuplicatedLinear(ColumnParallelLinear):
        def __init__(self, input_size: int, output_size: int, *, parallel_mode: str = "duplicated", **kwargs):
            if parallel_mode != "duplicated":
                raise ValueError(f"DuplicatedLinear builds parallel_mode='duplicated' only, not {parallel_mode!r}")
            kwargs.pop("gather_output", None)
            super().__init__(input_size, output_size, gather_output=False, **kwargs)

    return DuplicatedLinear


class QKNorm:
    """Builder of the attention-internal norms: RMSNorm with transformers' fixed eps (GLM-5's q/kv latent
    norms ignore ``rms_norm_eps``), LayerNorm with the eps megatron passes (the indexer's key norm)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            return torch.nn.RMSNorm(hidden_size, eps=LATENT_NORM_EPS)
        if config.normalization == "LayerNorm":
            return torch.nn.LayerNorm(hidden_size, eps=eps)
        raise ValueError(f"no attention-internal norm for normalization={config.normalization!r}")


class LocalDsaSpecProvider:
    """megatron's ``LocalSpecProvider`` (every method it has, by delegation), plus what its DSA spec asks of a
    backend: ``linear()`` and the attention-internal norms (see the module doc)."""

    def __init__(self):
        from megatron.core.models.backends import LocalSpecProvider

        self._local = LocalSpecProvider()

    def __getattr__(self, name: str):
        if name == "_local":  # not set yet: __init__ failed
            raise AttributeError(name)
        return getattr(self._local, name)

    def linear(self) -> type:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        return ColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        return QKNorm if for_qk else WrappedTorchNorm


def _with_duplicated_indexer_linears(layer_spec):
    """The layer spec with its DSA indexer's three projections built as ``DuplicatedLinear``."""
    indexer = layer_spec.submodules.self_attention.submodules.core_attention.submodules.indexer
    linear = duplicated_linear()
    indexer.submodules = dataclasses.replace(indexer.submodules, linear_wq_b=linear, linear_wk=linear,
                                             linear_weights_proj=linear)
    return layer_spec


def dsa_decoder_block_spec(config):
    """The decoder block (``TransformerBlockSubmodules``) of an ``MLATransformerConfig`` with
    ``experimental_attention_variant="dsa"``: DSA attention on every layer, MoE or dense MLP by
    ``config.moe_layer_freq``, a final RMSNorm."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if config.experimental_attention_variant != "dsa" or config.transformer_impl != "local":
        raise ValueError("dsa_decoder_block_spec builds DSA layers of transformer_impl='local' only, not "
                         f"{config.experimental_attention_variant!r} / {config.transformer_impl!r}")
    backend = LocalDsaSpecProvider()
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config, backend=backend)
    # One attention spec object is shared by every layer: patch it once.
    _with_duplicated_indexer_linears(layers[0])
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=backend.layer_norm(rms_norm=True))
