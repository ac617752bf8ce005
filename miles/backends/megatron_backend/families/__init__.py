"""The model families the Megatron backend builds: one folder each (``family.py`` says what a family states),
and this registry, the one list of the model types the backend builds.

Adding a family: its folder, and one line in :data:`FAMILIES`.

Every reader of a model the backend builds goes through here: the trainer (:func:`describe` of the checkpoint's
transformers config), validation and ``miles plan`` (:func:`read_config` of its config.json, then
:func:`count_tensors`), so what they size is what the backend builds, and a config it cannot build is refused with
the same words before a run starts.
"""

from __future__ import annotations

from typing import Any

from miles.models import ModelFolderError, check_hf_config
from miles.sizing.model_params import check_config_bounds
from miles.sizing.tensors import ModelConfigError, ModelTensors

from ..architecture import Architecture, UnsupportedModelError
from ..model_tensors import model_tensors
from .deepseek_v3 import DEEPSEEK_V3
from .family import Family
from .glm_moe_dsa import GLM_MOE_DSA
from .gpt import GPT, MIXTRAL
from .qwen3_5_moe import QWEN3_5_MOE

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "LINEAR_ATTENTION_MODEL_TYPES", "Family", "family_of", "describe",
           "read_config", "count_tensors", "layout_sizes", "UnsupportedModelError"]

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


def read_config(config: Any, name: str = "config.json") -> Architecture:
    """The :class:`Architecture` of a config.json's contents (untrusted): its sizes in the planner's ranges and
    the checks validation makes of every config before transformers sees it (``ModelConfigError`` naming the key
    and the value), read by transformers' config class of its ``model_type`` (the defaults the trainer's
    checkpoint gets; what that class refuses is a ``ModelConfigError`` too) and described by its family
    (:class:`UnsupportedModelError`, the trainer's own refusal). ``name`` names the config in the messages."""
    check_config_bounds(config, name)
    try:
        check_hf_config(config)
    except ModelFolderError as exc:
        raise ModelConfigError(f"{name}: {exc.problem}; {exc.fix}") from None
    family = family_of(config["model_type"])
    from transformers import AutoConfig

    fields = {key: value for key, value in config.items() if key != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
    except Exception as exc:  # transformers' config classes validate with assorted exception types
        reason = " ".join(str(exc).split())[:300]  # one line, short: the file is untrusted
        raise ModelConfigError(f"{name}: transformers' {config['model_type']} config refuses it: {reason}") from None
    try:
        return family.describe(hf_config)
    except UnsupportedModelError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:  # a value transformers let through
        reason = " ".join(str(exc).split())[:300]
        raise ModelConfigError(f"{name}: the {family.name} family cannot read it ({type(exc).__name__}: "
                               f"{reason})") from None


def count_tensors(arch: Architecture, name: str = "model", tp: int = 1, mtp: bool = True) -> ModelTensors:
    """The tensors of the model ``arch`` describes as its family builds them (``model_tensors.py``)."""
    return model_tensors(arch, family_of(arch.model_type).attention_tensors, name, tp, mtp)


def layout_sizes(arch: Architecture) -> dict[str, Any]:
    """The model's sizes Megatron's layout rules check (``miles.parallel.layout.check_layout``'s keywords)."""
    return dict(num_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                num_query_groups=arch.num_query_groups, num_experts=arch.num_experts or 0,
                **family_of(arch.model_type).layout_sizes(arch))
