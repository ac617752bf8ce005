"""What a model family states, once, for the Megatron backend: a :class:`Family`, one per folder of ``families/``.

The shared modules ask the family of a model (``families.family_of``) and never branch on it:

- ``describe(hf_config) -> Architecture``: how it reads a transformers config (raises ``UnsupportedModelError``
  naming the field it cannot build exactly); its TP rules ride on the result (``Architecture.tp_rules``);
- ``config_kwargs(arch)``: its megatron-core config fields beyond ``model.py``'s common GPT / MoE ones, and
  ``transformer_config(kwargs)``: the config object built from them (megatron-core imported inside);
- ``block_spec(config, options)``: the decoder block spec of the pipeline stage ``options.pp_rank`` and whether
  it is Transformer Engine's (megatron-core imported inside);
- ``layer_rules(arch, layer, fused_norms)``: decoder layer ``layer``'s HF <-> Megatron weight rules
  (``weight_rules.py``);
- ``attention_tensors(arch, layer, prefix)``: the tensors of decoder layer ``layer``'s token mixer, as ``miles plan``
  and validation count them (``model_tensors.py`` adds what every family shares);
- ``layout_sizes(arch)``: the sizes of its own pieces that Megatron's layout rules check
  (``miles.parallel.layout.check_layout``: a sparse-attention indexer's layers, a Gated DeltaNet's heads) beyond
  the shared ones (``families.layout_sizes``);
- ``native_fp32_params``: Megatron parameter-name suffixes that train in fp32 in a bf16 model;
- ``hf_per_expert_names``: how transformers 4.x names its per-expert weights when not as Qwen3-MoE does;
- ``tiny_preset``: the random-model preset its tests build (``miles.models.RANDOM_MODEL_PRESETS``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..architecture import Architecture
from ..model_tensors import AttentionTensors
from ..weight_rules import Rule

__all__ = ["Family", "BlockOptions", "PerExpertNames", "stage_of", "no_layout_sizes", "gpt_transformer_config",
           "mla_transformer_config"]


def no_layout_sizes(arch: Architecture) -> dict[str, Any]:
    return {}


def gpt_transformer_config(kwargs: dict[str, Any]) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**kwargs)


def mla_transformer_config(kwargs: dict[str, Any]) -> Any:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(**kwargs)


@dataclass(frozen=True)
class BlockOptions:
    """How ``model.build_gpt_model`` asks for a block: the pipeline stage, Transformer Engine's spec (None: when
    it imports; families that build their own spec ignore it) and the local spec's fused attention."""

    pp_rank: int = 0
    use_te: Optional[bool] = None
    fused_attention: bool = True


@dataclass(frozen=True)
class PerExpertNames:
    """transformers 4.x per-expert names of a family that does not spell them as Qwen3-MoE: ``module`` the MoE
    block's attribute (``block_sparse_moe``), ``projections`` canonical projection -> its name (``gate_proj`` ->
    ``w1``)."""

    module: str
    projections: dict[str, str]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    describe: Callable[[Any], Architecture]
    config_kwargs: Callable[[Architecture], dict[str, Any]]
    block_spec: Callable[[Any, BlockOptions], tuple[Any, bool]]
    layer_rules: Callable[[Architecture, int, bool], list[Rule]]
    attention_tensors: AttentionTensors
    tiny_preset: str
    transformer_config: Callable[[dict[str, Any]], Any] = gpt_transformer_config
    layout_sizes: Callable[[Architecture], dict[str, Any]] = no_layout_sizes
    native_fp32_params: tuple[str, ...] = ()
    hf_per_expert_names: Optional[PerExpertNames] = None


def stage_of(spec: Any, config: Any, pp_rank: int) -> Any:
    """A block spec of every decoder layer cut to pipeline stage ``pp_rank``'s (as megatron's own
    ``get_gpt_decoder_block_spec`` cuts its spec: ``TransformerBlock`` builds every layer spec it is given)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    return dataclasses.replace(spec, layer_specs=spec.layer_specs[offset:offset + count])
