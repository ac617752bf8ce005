"""The megatron-core layer spec of Qwen3.5-MoE (``__init__.py`` says what it must compute), without
Transformer Engine.

megatron-core 0.19.2's own hybrid spec (``get_transformer_block_with_experimental_attention_variant_spec``)
asserts Transformer Engine, and its local backend has no fused norm + linear for the Gated DeltaNet's input.
So the block is built here from the local GPT layer (SelfAttention, the MoE layer with SequentialMLP experts
and the shared expert), with:

- the Gated DeltaNet (``GatedDeltaNet``; needs the ``fla`` package) on the layers ``linear_attention_freq``
  marks, its input norm a separate layer norm and its ``in_proj`` a plain ``ColumnParallelLinear``; its
  kernels fla's, or megatron-core's torch ones where fla's backward is wrong (:func:`gated_delta_rule_kwargs`);
- :class:`ZeroCenteredRMSNorm` for the layer, q/k and final norms and :class:`GatedDeltaNetOutputNorm` for
  the Gated DeltaNet's output norm: the arithmetic (and the dtype of each step) of transformers'
  ``Qwen3_5MoeRMSNorm`` and ``Qwen3_5MoeRMSNormGated``, which megatron-core's norms do not reproduce. Their
  weights are marked ``sequence_parallel`` as the config says: under tensor parallelism (which megatron runs MoE
  layers with only under sequence parallelism) a layer norm sees this rank's slice of the sequence and the
  output norm this rank's heads, so megatron's ``finalize_model_grads`` sums their grads over TP.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import Any

import torch
from packaging.version import Version

from ..family import BlockOptions, stage_of

__all__ = ["ZeroCenteredRMSNorm", "GatedDeltaNetOutputNorm", "block_spec", "fla_gated_backward_is_exact",
           "gated_delta_rule_kwargs"]

logger = logging.getLogger(__name__)

# fla's gated chunk backward (chunk_bwd_dqkwg) is wrong on Hopper with Triton in [3.4.0, 3.7.1) unless tilelang
# provides it (fla issue #640; fla 0.6.0 raises there rather than train on wrong gradients).
_BAD_TRITON_ON_HOPPER = (Version("3.4.0"), Version("3.7.1"))


def fla_gated_backward_is_exact(*, hopper: bool, triton_version: str, tilelang: bool) -> bool:
    """Whether fla's Gated DeltaNet backward gives right gradients on this machine (fla's own rule)."""
    low, high = _BAD_TRITON_ON_HOPPER
    return not hopper or tilelang or not low <= Version(triton_version) < high


def gated_delta_rule_kwargs() -> dict[str, Any]:
    """``TransformerConfig`` keywords that choose the Gated DeltaNet's kernels on this GPU: fla's Triton kernels
    ({}), or, where their backward is wrong or there is no GPU, megatron-core's torch chunked delta rule and torch
    conv1d (``deterministic_mode``). In megatron-core 0.19.2 that flag changes nothing else this build uses:
    besides GatedDeltaNet it is read by VocabParallelEmbedding (an index instead of F.embedding: the same
    values, a deterministic backward), Transformer Engine's attention and the inference engines."""
    if not torch.cuda.is_available():  # fla's kernels are Triton's, for GPUs
        return {"deterministic_mode": True}
    import triton

    hopper = torch.cuda.get_device_capability()[0] == 9 or "NVIDIA H" in torch.cuda.get_device_name()
    tilelang = importlib.util.find_spec("tilelang") is not None
    if fla_gated_backward_is_exact(hopper=hopper, triton_version=triton.__version__, tilelang=tilelang):
        return {}
    logger.info("Gated DeltaNet: megatron-core's torch chunked delta rule (deterministic_mode), not fla's kernels: "
                "fla's gated backward is wrong on Hopper with Triton %s (< 3.7.1) and no tilelang (fla issue #640)",
                triton.__version__)
    return {"deterministic_mode": True}


def _rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _RmsNorm(torch.nn.Module):
    """An RMSNorm megatron builds as ``Norm(config, hidden_size, eps, ...)``: its weight starts at ``INITIAL``."""

    INITIAL = 1.0

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_megatron_norm_kwargs: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), self.INITIAL, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel


class ZeroCenteredRMSNorm(_RmsNorm):
    """``x / rms(x) * (1 + weight)`` in fp32, cast back to the input's dtype; ``weight`` starts at 0."""

    INITIAL = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedDeltaNetOutputNorm(_RmsNorm):
    """The norm half of transformers' gated RMSNorm: ``x / rms(x)`` in fp32, cast to the input's dtype, times
    ``weight`` (used as is). ``GatedDeltaNet`` multiplies by ``silu(gate)`` in fp32 after it, as HF does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _rms_normalized(x, self.eps).to(x.dtype)


def block_spec(config: Any, options: BlockOptions) -> tuple[Any, bool]:
    """``TransformerBlockSubmodules`` of stage ``options.pp_rank`` for a ``TransformerConfig`` made from a
    Qwen3.5-MoE config, and False: never Transformer Engine's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer

    local = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                           qk_layernorm=True, normalization="RMSNorm")
    attention = local.self_attention
    attention = ModuleSpec(module=attention.module, params=attention.params, submodules=dataclasses.replace(
        attention.submodules, q_layernorm=ZeroCenteredRMSNorm, k_layernorm=ZeroCenteredRMSNorm))
    gated_delta_net = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedDeltaNetOutputNorm, out_proj=RowParallelLinear))
    layers = [
        ModuleSpec(module=TransformerLayer, submodules=dataclasses.replace(
            local, input_layernorm=ZeroCenteredRMSNorm, pre_mlp_layernorm=ZeroCenteredRMSNorm,
            self_attention=gated_delta_net if linear else attention,
            sharded_state_dict_keys_map={}))  # the local spec's map is for norms fused into linears: none here
        for linear in config.linear_attention_freq
    ]
    block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)
    return stage_of(block, config, options.pp_rank), False
