"""The MoE routers of transformers models, and how each family turns router logits into gate weights.

Every supported router module returns ``(router_logits, gate_weights, expert_ids)`` for the ``[N, hidden]``
tokens its MoE block hands it (``N`` = batch x sequence, row-major), ``expert_ids`` ``[N, top_k]`` int64, and
its block runs the experts with exactly those ids and weights. Recording and replay hook that output
(:func:`torch.nn.Module.register_forward_hook`): no function of transformers is patched.

The families (transformers 5.x; the class names are the routers'):

==========================  ==================  ===============================================================
router                      family              gate weights of the chosen experts
==========================  ==================  ===============================================================
``Qwen3MoeTopKRouter``      Qwen3-MoE           softmax over all experts (fp32), gathered; renormalised when
                                                ``norm_topk_prob``; cast to the logits' dtype
``Qwen3_5MoeTopKRouter``    Qwen3.5-MoE         softmax (fp32), gathered, renormalised; cast to the logits' dtype
``MixtralTopKRouter``       Mixtral             softmax (fp32), gathered, renormalised; kept fp32
``GlmMoeDsaTopkRouter``     GLM-5 (glm_moe_dsa) sigmoid of fp32 logits, gathered (the selection bias is not part
``DeepseekV3TopkRouter``    DeepSeek-V3         of the weight), renormalised with +1e-20 when ``norm_topk_prob``,
                                                times ``routed_scaling_factor``
==========================  ==================  ===============================================================

A model with an MoE block of another family is refused (:class:`UnsupportedRouterError`) rather than recorded
or replayed partly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from miles.routing.routes import RouteShape, UnsupportedRouterError

__all__ = ["GateRule", "RouterSite", "UnsupportedRouterError", "find_routers", "sites_shape", "route_shape",
           "route_shape_of_config", "moe_decoder_layers_of_config", "SUPPORTED_ROUTERS"]

# Class-name endings of modules that route tokens to experts (routers and the blocks around them): a module
# ending so that is neither a known router nor a block whose ``gate`` is one is a family this module lacks.
_MOE_NAME_ENDINGS = ("Router", "SparseMoeBlock", "MoE", "MoeBlock")
# glm_moe_dsa / deepseek_v3 add this to the renormalising sum (a token's chosen sigmoids can all underflow)
_SIGMOID_NORM_EPS = 1e-20


@dataclass(frozen=True)
class GateRule:
    """How a router family weights the experts it chose, from its logits (the table of the module docstring)."""

    activation: str            # "softmax" (over all experts) or "sigmoid" (per expert)
    normalize: bool            # divide the chosen experts' scores by their sum
    norm_eps: float            # added to that sum
    scale: float               # then multiply by this (routed_scaling_factor)
    cast_to_logits_dtype: bool  # the weights take the logits' dtype (else they stay fp32)

    def weights(self, logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The gate weights ``[N, top_k]`` of ``expert_ids`` ``[N, top_k]`` from router ``logits`` ``[N, experts]``,
        computed as the family's router computes those of its own choice (bit for bit when the ids are its
        choice, in its order), differentiable in ``logits``."""
        scores = torch.softmax(logits.float(), dim=-1) if self.activation == "softmax" else logits.float().sigmoid()
        chosen = scores.gather(1, expert_ids)
        if self.normalize:
            chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + self.norm_eps)
        chosen = chosen * self.scale
        return chosen.to(logits.dtype) if self.cast_to_logits_dtype else chosen


def _softmax_rule(normalize: bool, cast_to_logits_dtype: bool = True) -> GateRule:
    return GateRule("softmax", normalize, 0.0, 1.0, cast_to_logits_dtype)


def _sigmoid_rule(router: torch.nn.Module) -> GateRule:
    return GateRule("sigmoid", bool(router.norm_topk_prob), _SIGMOID_NORM_EPS, float(router.routed_scaling_factor),
                    cast_to_logits_dtype=True)


SUPPORTED_ROUTERS = {
    "Qwen3MoeTopKRouter": lambda router: _softmax_rule(bool(router.norm_topk_prob)),
    "Qwen3_5MoeTopKRouter": lambda router: _softmax_rule(True),
    "MixtralTopKRouter": lambda router: _softmax_rule(True, cast_to_logits_dtype=False),
    "GlmMoeDsaTopkRouter": _sigmoid_rule,
    "DeepseekV3TopkRouter": _sigmoid_rule,
}


@dataclass(frozen=True)
class RouterSite:
    """One MoE layer's router: ``layer`` is its index among the model's MoE layers (model order)."""

    layer: int
    name: str
    module: torch.nn.Module
    rule: GateRule
    num_experts: int
    top_k: int


def find_routers(model: torch.nn.Module) -> list[RouterSite]:
    """The routers of ``model``'s MoE layers in model order (empty for a dense model). All have one expert
    count and top-k (the routes' shape); :class:`UnsupportedRouterError` for an MoE block of a family the
    module docstring does not list, naming it."""
    sites, unknown = [], []
    routers = {id(m) for m in model.modules() if type(m).__name__ in SUPPORTED_ROUTERS}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in SUPPORTED_ROUTERS:
            sites.append(RouterSite(layer=len(sites), name=name, module=module,
                                    rule=SUPPORTED_ROUTERS[kind](module), num_experts=int(module.num_experts),
                                    top_k=int(module.top_k)))
        elif kind.endswith(_MOE_NAME_ENDINGS) and id(getattr(module, "gate", None)) not in routers:
            unknown.append(f"{name} ({kind})")
    if unknown:
        raise UnsupportedRouterError(
            f"{type(model).__name__} has MoE blocks whose routing miles cannot record or replay: {unknown[:3]}; "
            f"supported routers: {sorted(SUPPORTED_ROUTERS)}")
    shapes = {(s.num_experts, s.top_k) for s in sites}
    if len(shapes) > 1:
        raise UnsupportedRouterError(f"{type(model).__name__}'s MoE layers differ in (experts, top_k): "
                                     f"{sorted(shapes)}; routes hold one shape for every layer")
    return sites


def sites_shape(sites: list[RouterSite]) -> RouteShape:
    """The shape of the routes of the model whose routers are ``sites`` (at least one)."""
    return RouteShape(num_experts=sites[0].num_experts, top_k=sites[0].top_k, layers=len(sites))


def route_shape(model: torch.nn.Module) -> Optional[RouteShape]:
    """The shape of ``model``'s routes (None: it has no MoE layer; see :func:`find_routers`)."""
    sites = find_routers(model)
    return sites_shape(sites) if sites else None


def route_shape_of_config(model_config: Mapping[str, Any]) -> Optional[RouteShape]:
    """:func:`route_shape` of the transformers model a config.json describes, built on the meta device (no memory,
    no weights). None for a model without MoE layers and for a config transformers does not know (no
    ``model_type``, or one it has no causal-LM class for)."""
    sites = _sites_of_config(model_config)
    return sites_shape(sites) if sites else None


def moe_decoder_layers_of_config(model_config: Mapping[str, Any]) -> Optional[tuple[int, ...]]:
    """The decoder-layer index (``...layers.<i>....`` in the module name) of each MoE layer, in route order, of
    the model a config.json describes: where a per-decoder-layer record (sglang's routed experts) holds each
    MoE layer's ids. None where :func:`route_shape_of_config` is None, or a router sits outside a ``layers.<i>``."""
    sites = _sites_of_config(model_config)
    found = [re.search(r"(?:^|\.)layers\.(\d+)\.", site.name) for site in sites]
    if not sites or not all(found):
        return None
    return tuple(int(match.group(1)) for match in found)


def _sites_of_config(model_config: Mapping[str, Any]) -> list[RouterSite]:
    """:func:`find_routers` of the model a config.json describes, built on the meta device (empty where
    transformers does not know the config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_config)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        return []
    try:
        config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError):  # a type transformers does not know, or one without a causal LM
        return []
    return find_routers(model)
