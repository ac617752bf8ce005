"""megatron-core's DSA decoder block (multi-latent attention + sparse-attention indexer) without Transformer
Engine (megatron-core is imported inside the functions).

megatron-core 0.19.2 writes its DSA spec for Transformer Engine: the block-level helper asserts
``transformer_impl == "transformer_engine"``, and ``LocalSpecProvider`` has no ``linear()``. The per-layer
helper (``get_transformer_layer_with_experimental_attention_variant_spec``) takes any backend, so this module
supplies one: megatron's local modules plus

- ``linear()``: ``ColumnParallelLinear`` for the MLA down projections (the one non-TE class absorbed MLA
  accepts there: under TP each rank computes its slice of the latent, which MLA gathers); the indexer's
  projections, which megatron builds with ``parallel_mode="duplicated"`` (a TE argument), are
  :class:`DuplicatedLinear`: whole on every tensor-parallel rank (the indexer gathers its inputs over the
  sequence-parallel split, and megatron averages its grads over TP);
- the attention-internal norms of ``mla_layers.LatentNorm``;
- no fused norm+linear: every norm is its own module (``mla.mla_attention_rules``' unfused names);
- megatron's absorbed MLA whose kv down projection hands MLA the whole latent of this rank's sequence part
  (``mla_layers.whole_latent_of_this_sequence_part``).

Sparse attention runs megatron's PyTorch path (``dsa_kernel_backend="none"``: no tilelang, no cuDNN).
"""

from __future__ import annotations

import dataclasses

import torch

from .mla_layers import LatentNorm, whole_latent_of_this_sequence_part

__all__ = ["dsa_decoder_block_spec", "DuplicatedLinear", "LocalDsaSpecProvider", "sequence_parallel_latent_mla"]


class DuplicatedLinear(torch.nn.Module):
    """A projection every tensor-parallel rank holds whole, called as megatron's linears are (``(output,
    bias)``): megatron's DSA indexer asks for TE's ``parallel_mode="duplicated"``, which no local class has."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 parallel_mode: str = "duplicated", skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, **_unused):
        if parallel_mode != "duplicated" or bias or skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear builds a bias-free parallel_mode='duplicated' projection only, not "
                             f"parallel_mode={parallel_mode!r}, bias={bias}, skip_weight_param_allocation="
                             f"{skip_weight_param_allocation}")
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return torch.nn.functional.linear(x, self.weight), None


def sequence_parallel_latent_mla():
    """megatron's absorbed MLA (it requires sequence parallelism under TP) with its column-parallel kv down
    projection's output turned into the whole latent of this rank's sequence part; the class is made on first use
    (megatron-core is imported inside)."""
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    class SequenceParallelLatentMLA(AbsorbedMLASelfAttention):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if config.tensor_model_parallel_size > 1:
                self.linear_kv_down_proj.register_forward_hook(whole_latent_of_this_sequence_part)

    return SequenceParallelLatentMLA


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

        return LatentNorm if for_qk else WrappedTorchNorm


def _with_duplicated_indexer_linears(layer_spec):
    """The layer spec with its DSA indexer's three projections built as ``DuplicatedLinear``."""
    indexer = layer_spec.submodules.self_attention.submodules.core_attention.submodules.indexer
    indexer.submodules = dataclasses.replace(indexer.submodules, linear_wq_b=DuplicatedLinear,
                                             linear_wk=DuplicatedLinear, linear_weights_proj=DuplicatedLinear)
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
    layers[0].submodules.self_attention.module = sequence_parallel_latent_mla()
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=backend.layer_norm(rms_norm=True))
