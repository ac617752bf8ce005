"""Multi-latent attention's modules without Transformer Engine (megatron-core is imported inside the functions).

- :class:`LatentNorm`: the attention-internal norms: RMSNorm with transformers' fixed eps (``mla.LATENT_NORM_EPS``:
  the q/kv latent norms ignore ``rms_norm_eps``), LayerNorm with the eps megatron passes (DSA's indexer key norm);
  their params marked ``sequence_parallel`` as the config says (MLA scatters the latents back over the sequence:
  each rank's grads are partial, and megatron's ``finalize_model_grads`` sums the marked ones over TP).
- :func:`whole_latent_of_this_sequence_part`: a forward hook for the kv down projection. megatron's
  ColumnParallelLinear path gathers the latent over TP and uses the rope key of the whole sequence on every rank,
  so each rank's grad of the rope key holds only its own heads' share, and the down projection's rope rows
  trained on a partial grad (GLM-5 at TP2 drifted from TP1 by 0.0055 in ``kv_a_proj_with_mqa`` after 3 fp32
  steps). With the hook MLA gets the whole latent of this rank's sequence part, as Transformer Engine's
  duplicated projection hands it, and the rope key's gather over the sequence sums every rank's heads' grads.
  megatron's plain ``MLASelfAttention`` has the same bug: a tiny DeepSeek-V3 at TP2 + SP had grads up to 0.6%
  off TP1's (``linear_kv_down_proj`` first), 1e-6 with the hook.
- :func:`mla_decoder_block_spec`: the decoder block of plain multi-latent attention (DeepSeek-V3) on megatron's
  local spec: :func:`latent_mla` with the hook, :class:`LatentNorm` latent norms, :class:`MlaCoreAttention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..sdpa_attention import SDPACoreAttention
from .mla import LATENT_NORM_EPS

__all__ = ["LatentNorm", "whole_latent_of_this_sequence_part", "MlaCoreAttention", "latent_mla",
           "mla_decoder_block_spec"]


def whole_latent_of_this_sequence_part(module, inputs, output):
    """The kv down projection's output as MLA's duplicated-projection path takes it: the whole latent (gathered
    over TP; the backward keeps this rank's slice) of this rank's part of the sequence (the backward all-gathers
    it)."""
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                         scatter_to_sequence_parallel_region)

    latent, bias = output
    whole = gather_from_tensor_model_parallel_region(latent, group=module.tp_group)
    return scatter_to_sequence_parallel_region(whole, group=module.tp_group), bias


class LatentNorm:
    """Builder of the attention-internal norms (module doc), called as megatron calls a norm class."""

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


class MlaCoreAttention(SDPACoreAttention):
    """:class:`SDPACoreAttention` as MLA builds its core attention: with the key and value head sizes, which
    differ (``qk_head_dim`` and ``v_head_dim``; scaled_dot_product_attention reads them off the tensors; megatron's
    ``Attention`` base builds it once without them, then MLA again with them) and the softmax scale MLA computes
    (YaRN's mscale included)."""

    def __init__(self, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)


def latent_mla() -> type:
    """megatron's (non-absorbed) ``MLASelfAttention`` built with the modules its spec names, and under TP with
    :func:`whole_latent_of_this_sequence_part` on its kv down projection; made on first use (megatron-core is
    imported inside)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LatentMLA(MLASelfAttention):
        def __init__(self, config, *args, **kwargs):
            if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
                raise ValueError(f"multi-latent attention at tensor parallelism {config.tensor_model_parallel_size} "
                                 "is built for sequence parallelism only (its rope key's grads are summed over TP "
                                 "by the sequence gather); pass --sequence-parallel")
            super().__init__(config, *args, **kwargs)
            if config.tensor_model_parallel_size > 1:
                self.linear_kv_down_proj.register_forward_hook(whole_latent_of_this_sequence_part)

        def _resolve_qk_norm_config(self, submodules) -> dict[str, Any]:
            # the spec's modules as they are: megatron's resolver asks Transformer Engine's fused norm + linear for
            # q_proj when q_lora_rank is None, though there is no q norm to fuse
            return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=submodules.linear_q_up_proj,
                        linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=submodules.q_layernorm,
                        kv_layernorm=submodules.kv_layernorm)

    return LatentMLA


def mla_decoder_block_spec(config, pp_rank: int):
    """The decoder block (``TransformerBlockSubmodules``) of pipeline stage ``pp_rank`` for an
    ``MLATransformerConfig`` without an attention variant: megatron's local spec (MoE and dense layers by
    ``config.moe_layer_freq``, a final RMSNorm), its attention :func:`latent_mla` with :class:`LatentNorm` latent
    norms (no q norm without ``q_lora_rank``) and :class:`MlaCoreAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    if not config.multi_latent_attention or config.experimental_attention_variant is not None \
            or config.transformer_impl != "local":
        raise ValueError("mla_decoder_block_spec builds plain multi-latent attention of transformer_impl='local' only, "
                         f"not multi_latent_attention={config.multi_latent_attention}, experimental_attention_variant="
                         f"{config.experimental_attention_variant!r}, transformer_impl={config.transformer_impl!r}")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       pp_rank=pp_rank)
    attention_class = latent_mla()
    q_norm = LatentNorm if config.q_lora_rank is not None else IdentityOp

    def with_latent_mla(layer):
        attention = layer.submodules.self_attention
        attention = dataclasses.replace(attention, module=attention_class, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=q_norm, kv_layernorm=LatentNorm, core_attention=MlaCoreAttention))
        return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))

    return dataclasses.replace(block, layer_specs=[with_latent_mla(layer) for layer in block.layer_specs])
