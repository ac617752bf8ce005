"""megatron-core's DSA decoder block (multi-latent attention + sparse-attention indexer) without Transformer
Engine: GLM-5's layer spec for ``model.build_gpt_model`` (megatron-core is imported inside the functions).

megatron-core 0.19.2 writes its DSA spec for Transformer Engine: the block-level helper asserts
``transformer_impl == "transformer_engine"``, and ``LocalSpecProvider`` has no ``linear()``. The per-layer
helper (``get_transformer_layer_with_experimental_attention_variant_spec``) takes any backend, so this module
supplies one: megatron's local modules plus

- ``linear()``: ``ColumnParallelLinear`` for the MLA down projections (the one non-TE class absorbed MLA
  accepts there: under TP each rank computes its slice of the latent, which MLA gathers); the indexer's
  projections, which megatron builds with ``parallel_mode="duplicated"`` (a TE argument), are
  :class:`DuplicatedLinear`: whole on every tensor-parallel rank (the indexer gathers its inputs over the
  sequence-parallel split, and megatron averages its grads over TP);
- the q/kv latent norms with transformers' fixed eps (``glm_moe_dsa.LATENT_NORM_EPS``) and the indexer's key
  LayerNorm with the configured one (``dsa_indexer_k_norm_epsilon``), their params marked ``sequence_parallel``
  under sequence parallelism (MLA scatters the latents back over the sequence: each rank's grads are partial,
  and megatron's ``finalize_model_grads`` sums the marked ones over TP);
- no fused norm+linear: every norm is its own module (``convert.py``'s unfused names);
- :class:`SequenceParallelLatentMLA`: megatron's absorbed MLA whose kv down projection hands MLA the whole latent
  of this rank's sequence part, as TE's duplicated projection does (megatron's ColumnParallelLinear path gathers
  the latent over TP and uses the rope key of the whole sequence on every rank, so each rank's grad of the rope
  key holds only its own heads' share, and the down projection's rope rows trained on a partial grad: GLM-5 at
  TP2 drifted from TP1 by 0.0055 in ``kv_a_proj_with_mqa`` after 3 fp32 steps).

Sparse attention runs megatron's PyTorch path (``dsa_kernel_backend="none"``: no tilelang, no cuDNN).
"""

from __future__ import annotations

import dataclasses

import torch

from .glm_moe_dsa import LATENT_NORM_EPS

__all__ = ["dsa_decoder_block_spec", "DuplicatedLinear", "LocalDsaSpecProvider", "QKNorm", "sequence_parallel_latent_mla"]


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


def _latent_of_this_sequence_part(module, inputs, output):
    """The kv down projection's output as MLA's duplicated-projection path takes it: the whole latent (gathered
    over TP; the backward keeps this rank's slice) of this rank's part of the sequence (the backward all-gathers
    it). MLA then gathers the rope key over the sequence, whose backward sums every rank's heads' grads."""
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                         scatter_to_sequence_parallel_region)

    latent, bias = output
    whole = gather_from_tensor_model_parallel_region(latent, group=module.tp_group)
    return scatter_to_sequence_parallel_region(whole, group=module.tp_group), bias


def sequence_parallel_latent_mla():
    """:class:`SequenceParallelLatentMLA`, made on first use (megatron-core is imported inside the functions)."""
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    class SequenceParallelLatentMLA(AbsorbedMLASelfAttention):
        """megatron's absorbed MLA (it requires sequence parallelism under TP) with its column-parallel kv down
        projection's output turned into the whole latent of this rank's sequence part (module doc)."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if config.tensor_model_parallel_size > 1:
                self.linear_kv_down_proj.register_forward_hook(_latent_of_this_sequence_part)

    return SequenceParallelLatentMLA


class QKNorm:
    """Builder of the attention-internal norms: RMSNorm with transformers' fixed eps (GLM-5's q/kv latent
    norms ignore ``rms_norm_eps``), LayerNorm with the eps megatron passes (the indexer's key norm); params
    marked ``sequence_parallel`` as the config says (module doc)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=LATENT_NORM_EPS)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"no attention-internal norm for normalization={config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


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
