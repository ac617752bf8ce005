"""The model families the Megatron backend builds: one folder each (``family.py`` says what a family states),
and this registry, the one list of the model types the backend builds.

Adding a family: its folder, and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from ..architecture import Architecture, UnsupportedModelError
from .deepseek_v3 import DEEPSEEK_V3
from .family import Family
from .glm_moe_dsa import GLM_MOE_DSA
from .gpt import GPT, MIXTRAL
from .qwen3_5_moe import QWEN3_5_MOE

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "LINEAR_ATTENTION_MODEL_TYPES", "Family", "family_of", "describe",
           "UnsupportedModelError"]

FAMILIES: tuple[Family, ...] = (
    GPT,
    MIXTRAL,
    QWEN3_5_MOE,
    GLM_MOE_DSA,
    DEEPSEEK_V3,
)

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)
# Families with Gated DeltaNet layers: megatron-core builds those with flash-linear-attention's kernels on GPUs
LINEAR_ATTENTION_MODEL_TYPES = QWEN3_5_MOE.model_types


def family_of(model_type: Any) -> Family:
    """The family that builds ``model_type``; raises :class:`UnsupportedModelError` for any other."""
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported by the Megatron backend; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)} (use --train-backend torch)")
    return family


def describe(hf_config: Any) -> Architecture:
    """The :class:`Architecture` of a transformers config; raises :class:`UnsupportedModelError`."""
    return family_of(getattr(hf_config, "model_type", None)).describe(hf_config)
