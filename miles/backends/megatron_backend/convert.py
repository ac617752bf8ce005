"""Weight conversion between HuggingFace state dicts and megatron-core GPTModel state dicts.

Pure functions on dicts of tensors (no megatron import), so every layout rule is tested on CPU::

    mcore = hf_to_megatron(hf_state, hf_config, fused_norms=False, ep_rank=0, ep_size=1)
    hf = megatron_to_hf(mcore_state, hf_config, fused_norms=False, hf_moe_layout="fused")
    full = experts_to_global(rank_state, hf_config, ep_rank, ep_size)   # before megatron_to_hf with EP > 1

Megatron names are those of the bare ``GPTModel`` (no ``module.`` prefixes of the DDP / Float16Module
wrappers). Each layer's rules are its family's (``families/``, from the pieces of ``weight_rules.py``, which
says how Megatron's layouts differ from HF's). Routed experts are megatron's SequentialMLP's
``mlp.experts.local_experts.{i}``, or, when the backend builds them grouped (``--moe-grouped-gemm``),
``mlp.experts.linear_fc1/2.weight`` with every local expert on the leading axis (``pieces/grouped_experts.py``):
with expert parallelism each rank holds experts ``ep_rank * E/ep_size + i``. :func:`megatron_to_hf` takes
globally numbered experts: at EP 1 that is any rank's state, with EP > 1 :func:`join_experts` of the ranks'.
Tied embeddings: Megatron has no ``output_layer.weight``; :func:`megatron_to_hf` returns ``lm_head.weight`` as the
same tensor as ``model.embed_tokens.weight`` (the HF model's state dict has both keys).

HF expert layouts: transformers >= 5 stacks experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``, router ``mlp.gate.weight``); 4.x has one module per expert
(Qwen3-MoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, Mixtral
``block_sparse_moe.experts.{e}.w1/w3/w2`` and ``block_sparse_moe.gate``). Both are read; which one
:func:`megatron_to_hf` writes is ``hf_moe_layout`` (default: the installed transformers' layout).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .architecture import Architecture
from .families import describe, family_of
from .pieces.grouped_experts import grouped_expert_rules, hf_names_of_experts, is_grouped_expert, join_expert_ranks
from .weight_rules import Rule, canonical_expert, canonical_router

__all__ = ["hf_to_megatron", "megatron_to_hf", "iter_megatron_to_hf", "experts_to_global", "join_experts",
           "hf_moe_layout", "HF_MOE_LAYOUTS",
           "ConversionError", "part_to_hf", "EMBEDDING", "HEAD"]

HF_MOE_LAYOUTS = ("fused", "per_expert")
_EXTRA_STATE = "._extra_state"  # Transformer Engine's fp8 metadata: not a weight


class ConversionError(KeyError):
    """A state dict that does not match the config's layout (the message names the keys)."""

    def __str__(self) -> str:  # KeyError would print the message repr'd
        return str(self.args[0])


def _rules(arch: Architecture, fused_norms: bool, grouped: bool) -> list[Rule]:
    rules = _part_rules(arch, EMBEDDING, fused_norms, grouped)
    for i in range(arch.num_layers):
        rules += _part_rules(arch, i, fused_norms, grouped)
    return rules + _part_rules(arch, HEAD, fused_norms, grouped)


# ---- HF expert layouts <-> the canonical per-expert names -----------------------------------------
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def hf_moe_layout(hf_state: dict[str, torch.Tensor]) -> Optional[str]:
    """``"fused"`` or ``"per_expert"`` by the keys of an HF MoE state dict; None for a dense one."""
    if any(_FUSED_EXPERTS.match(k) for k in hf_state):
        return "fused"
    if any(".experts." in k for k in hf_state):
        return "per_expert"
    return None


def _installed_moe_layout() -> str:
    import transformers

    return "fused" if int(transformers.__version__.split(".")[0]) >= 5 else "per_expert"


def _per_expert_renamer(arch: Architecture) -> Callable[[str], Optional[str]]:
    """The canonical name of a per-expert weight or router in the family's own 4.x spelling (None for others)."""
    legacy = family_of(arch.model_type).hf_per_expert_names
    if legacy is None:
        return lambda key: None
    block = re.escape(legacy.module)
    expert = re.compile(rf"model\.layers\.(\d+)\.{block}\.experts\.(\d+)\.(\w+)\.weight$")
    router = re.compile(rf"model\.layers\.(\d+)\.{block}\.gate\.weight$")
    projections = {name: proj for proj, name in legacy.projections.items()}

    def rename(key: str) -> Optional[str]:
        if (m := expert.match(key)) and m.group(3) in projections:
            return canonical_expert(int(m.group(1)), int(m.group(2)), projections[m.group(3)])
        if m := router.match(key):
            return canonical_router(int(m.group(1)))
        return None

    return rename


def _hf_to_canonical(hf_state: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    legacy_name = _per_expert_renamer(arch)
    for key, t in hf_state.items():
        if m := _FUSED_EXPERTS.match(key):
            layer, which = int(m.group(1)), m.group(2)
            for e in range(t.shape[0]):
                if which == "down_proj":
                    out[canonical_expert(layer, e, "down_proj")] = t[e]
                else:
                    gate, up = torch.chunk(t[e], 2, dim=0)
                    out[canonical_expert(layer, e, "gate_proj")] = gate
                    out[canonical_expert(layer, e, "up_proj")] = up
        else:
            out[legacy_name(key) or key] = t
    return out


def _canonical_to_hf(state: dict[str, torch.Tensor], arch: Architecture, layout: str,
                     layers: Optional[Sequence[int]] = None) -> dict[str, torch.Tensor]:
    """The canonical per-expert names of ``layers`` (default: every MoE layer) in the HF ``layout``."""
    if layout not in HF_MOE_LAYOUTS:
        raise ValueError(f"hf_moe_layout must be one of {HF_MOE_LAYOUTS}, got {layout!r}")
    out = dict(state)
    for i in (i for i in (range(arch.num_layers) if layers is None else layers) if arch.is_moe_layer(i)):
        names = {proj: [canonical_expert(i, e, proj) for e in range(arch.num_experts)]
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        legacy = family_of(arch.model_type).hf_per_expert_names
        if layout == "fused":
            experts = f"model.layers.{i}.mlp.experts."
            out[experts + "gate_up_proj"] = torch.stack(
                [torch.cat([out.pop(g), out.pop(u)], dim=0) for g, u in zip(names["gate_proj"], names["up_proj"])])
            out[experts + "down_proj"] = torch.stack([out.pop(d) for d in names["down_proj"]])
        elif legacy is not None:
            block = f"model.layers.{i}.{legacy.module}."
            out[block + "gate.weight"] = out.pop(canonical_router(i))
            for proj, w in legacy.projections.items():
                for e, name in enumerate(names[proj]):
                    out[f"{block}experts.{e}.{w}.weight"] = out.pop(name)
    return out


# ---- the model's parts, in the order the weight handoff sends them --------------------------------
EMBEDDING, HEAD = "embedding", "head"  # the parts around the decoder layers (which are numbered)


def _holds_grouped_experts(mcore_state: dict[str, torch.Tensor]) -> bool:
    """Whether a Megatron state dict's routed experts are grouped (its names say: ``pieces/grouped_experts.py``)."""
    return any(is_grouped_expert(name) for name in mcore_state)


def _part_rules(arch: Architecture, part: "int | str", fused_norms: bool, grouped: bool) -> list[Rule]:
    if part == EMBEDDING:
        return [Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight")]
    if part == HEAD:
        tail = [Rule(("model.norm.weight",), "decoder.final_layernorm.weight")]
        if not arch.tied_embeddings:
            tail.append(Rule(("lm_head.weight",), "output_layer.weight"))
        return tail
    rules = family_of(arch.model_type).layer_rules(arch, part, fused_norms)
    return grouped_expert_rules(rules) if grouped else rules


def part_to_hf(part: "int | str", mcore_state: dict[str, torch.Tensor], hf_config: Any, *, fused_norms: bool = False,
               hf_moe_layout: Optional[str] = None) -> dict[str, torch.Tensor]:
    """One part of the model in HF names: :data:`EMBEDDING`, decoder layer ``part`` (global number, experts
    globally numbered) or :data:`HEAD` (final norm, and the output layer unless tied), from the Megatron tensors
    of that part in ``mcore_state`` (other keys are ignored). Views where the split rules allow."""
    arch = describe(hf_config)
    out = {}
    for rule in _part_rules(arch, part, fused_norms, _holds_grouped_experts(mcore_state)):
        if rule.mcore not in mcore_state:
            raise ConversionError(f"the Megatron state of part {part!r} lacks {rule.mcore!r}")
        out.update(zip(rule.hf, rule.split(mcore_state[rule.mcore])))
    if isinstance(part, int) and arch.is_moe_layer(part):
        out = _canonical_to_hf(out, arch, hf_moe_layout or _installed_moe_layout(), layers=(part,))
    return out


# ---- public ---------------------------------------------------------------------------------------
def _local_experts(arch: Architecture, ep_rank: int, ep_size: int) -> range:
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert-parallel rank {ep_rank} is not in [0, ep_size={ep_size})")
    if arch.num_experts is None:
        return range(0)
    if arch.num_experts % ep_size:
        raise ValueError(f"{arch.num_experts} experts cannot be split over expert-parallel size {ep_size}: "
                         "choose an EP size that divides the number of experts")
    n = arch.num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _renumber_experts(state: dict[str, Any], offset: int) -> dict[str, Any]:
    def rename(key: str) -> str:
        m = _LOCAL_EXPERT.match(key)
        return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}" if m else key

    return {rename(k): v for k, v in state.items()}


def experts_to_global(mcore_state: dict[str, torch.Tensor], hf_config: Any, ep_rank: int,
                      ep_size: int) -> dict[str, torch.Tensor]:
    """One expert-parallel rank's state with its ``local_experts.{i}`` renumbered to global expert ids (grouped
    experts hold every rank's only together: :func:`join_experts`)."""
    grouped = [k for k in mcore_state if is_grouped_expert(k)]
    if grouped:
        raise ValueError(f"{grouped[:2]} hold this rank's experts on their leading axis, which one rank's state "
                         "cannot number globally: join every rank's with join_experts")
    return _renumber_experts(mcore_state, _local_experts(describe(hf_config), ep_rank, ep_size).start)


def join_experts(rank_states: Sequence[dict[str, torch.Tensor]], hf_config: Any) -> dict[str, torch.Tensor]:
    """Every expert-parallel rank's expert tensors (``rank_states[r]``: rank r's, the same keys on each) as one
    state of globally numbered experts: per-expert tensors renumbered, grouped ones joined on their expert axis."""
    out: dict[str, torch.Tensor] = {}
    for rank, state in enumerate(rank_states):
        out.update(experts_to_global({k: v for k, v in state.items() if not is_grouped_expert(k)}, hf_config, rank,
                                     len(rank_states)))
    for key in filter(is_grouped_expert, rank_states[0]):
        out[key] = join_expert_ranks([state[key] for state in rank_states])
    return out


def hf_to_megatron(hf_state: dict[str, torch.Tensor], hf_config: Any, *, fused_norms: bool = False,
                   ep_rank: int = 0, ep_size: int = 1, grouped_experts: bool = False) -> dict[str, torch.Tensor]:
    """The Megatron state dict of expert-parallel rank ``ep_rank`` (all dense weights, its own experts; grouped as
    ``build_gpt_model``'s ``grouped_experts`` builds them)."""
    arch = describe(hf_config)
    local = _local_experts(arch, ep_rank, ep_size)
    state = _hf_to_canonical(hf_state, arch)
    out, used = {}, set()
    for rule in _rules(arch, fused_norms, grouped_experts):
        missing = [k for k in rule.hf if k not in state]
        if missing:
            raise ConversionError(f"the HF state dict lacks {missing} (needed for Megatron's {rule.mcore}); "
                                  f"is it a {arch.model_type} model of this config?")
        used.update(rule.hf)
        m = _LOCAL_EXPERT.match(rule.mcore)
        if m and int(m.group(2)) not in local:
            continue  # another expert-parallel rank's expert
        names = hf_names_of_experts(rule, local, arch.num_experts) if is_grouped_expert(rule.mcore) else rule.hf
        out[rule.mcore] = rule.merge([state[k] for k in names])
    ignorable = {"lm_head.weight"} if arch.tied_embeddings else set()
    unused = sorted(set(state) - used - ignorable)
    if unused:
        raise ConversionError(f"the HF state dict has weights the {arch.model_type} layout does not place: "
                              f"{unused[:6]}{' ...' if len(unused) > 6 else ''}")
    return _renumber_experts(out, -local.start) if local.start else out


def megatron_to_hf(mcore_state: dict[str, torch.Tensor], hf_config: Any, *, fused_norms: bool = False,
                   hf_moe_layout: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The HF state dict of a Megatron state dict with globally numbered experts (see module doc)."""
    return dict(iter_megatron_to_hf(mcore_state, hf_config, fused_norms=fused_norms, hf_moe_layout=hf_moe_layout))


LayerExperts = Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def iter_megatron_to_hf(mcore_state: dict[str, torch.Tensor], hf_config: Any, *, fused_norms: bool = False,
                        hf_moe_layout: Optional[str] = None,
                        layer_experts: Optional[LayerExperts] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`megatron_to_hf` one layer at a time, as ``(hf_name, tensor)`` pairs: the weight handoff
    converts on the device with scratch bounded by one layer (split rules return views; only the fused
    HF expert layout stacks a layer's experts into new tensors).

    ``layer_experts(i, local)``: with expert parallelism > 1, ``mcore_state`` holds this rank's experts
    only; the callback receives layer ``i``'s local expert tensors and returns that layer's experts of
    every rank, globally numbered (a collective over the expert-parallel group, on the device)."""
    arch = describe(hf_config)
    layout = hf_moe_layout or _installed_moe_layout()
    if arch.num_experts is not None and layout not in HF_MOE_LAYOUTS:
        raise ValueError(f"hf_moe_layout must be one of {HF_MOE_LAYOUTS}, got {layout!r}")
    used: set[str] = set()
    grouped = _holds_grouped_experts(mcore_state)

    def convert(rules: list[Rule], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for rule in rules:
            if rule.mcore not in state:
                raise ConversionError(f"the Megatron state dict lacks {rule.mcore!r}; with expert parallelism, "
                                      "join every rank's experts through join_experts first")
            used.add(rule.mcore)
            out.update(zip(rule.hf, rule.split(state[rule.mcore])))
        return out

    embedding = convert(_part_rules(arch, EMBEDDING, fused_norms, grouped), mcore_state)
    yield from embedding.items()
    for i in range(arch.num_layers):
        state = mcore_state
        if layer_experts is not None and arch.is_moe_layer(i):
            prefix = f"decoder.layers.{i}.mlp.experts."  # the routed experts, per expert or grouped
            local = {k: v for k, v in mcore_state.items() if k.startswith(prefix)}
            state = {**{k: v for k, v in mcore_state.items() if not k.startswith(prefix)}, **layer_experts(i, local)}
            used.update(local)
        layer = convert(_part_rules(arch, i, fused_norms, grouped), state)
        if arch.is_moe_layer(i):
            layer = _canonical_to_hf(layer, arch, layout, layers=(i,))
        yield from layer.items()
    yield from convert(_part_rules(arch, HEAD, fused_norms, grouped), mcore_state).items()
    if arch.tied_embeddings:
        yield "lm_head.weight", embedding["model.embed_tokens.weight"]
    unused = sorted(k for k in set(mcore_state) - used if not k.endswith(_EXTRA_STATE))
    if unused:
        raise ConversionError(f"the Megatron state dict has tensors the {arch.model_type} layout does not map: "
                              f"{unused[:6]}{' ...' if len(unused) > 6 else ''}")
