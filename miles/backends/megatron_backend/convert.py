"""Weight conversion between HuggingFace state dicts and megatron-core GPTModel state dicts.

Pure functions on dicts of tensors (no megatron import), so every layout rule is tested on CPU::

    mcore = hf_to_megatron(hf_state, hf_config, fused_norms=False, ep_rank=0, ep_size=1)
    hf = megatron_to_hf(mcore_state, hf_config, fused_norms=False, hf_moe_layout="fused")
    full = experts_to_global(rank_state, hf_config, ep_rank, ep_size)   # before megatron_to_hf with EP > 1

Megatron names are those of the bare ``GPTModel`` (no ``module.`` prefixes of the DDP / Float16Module
wrappers). Layouts that differ from HF:

- ``linear_qkv`` is interleaved per query group: for each of the ``num_query_groups`` groups, the
  group's ``heads_per_group`` query heads, then its key head, then its value head (rows of
  ``head_dim`` each). The bias (Qwen2) follows the same row order.
- ``linear_fc1`` is ``cat(gate_proj, up_proj)`` along the output rows (SwiGLU).
- Norms: the local layer spec has ``input_layernorm`` / ``pre_mlp_layernorm``; Transformer Engine's
  spec fuses them into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``
  (``fused_norms=True``), except before an MoE block, which keeps ``pre_mlp_layernorm``.
- Experts (SequentialMLP, no grouped GEMM) are ``mlp.experts.local_experts.{i}``: with expert
  parallelism each rank holds experts ``ep_rank * E/ep_size + i``. :func:`megatron_to_hf` takes
  globally numbered experts: at EP 1 that is any rank's state, with EP > 1 the union of the ranks'
  states after :func:`experts_to_global`.
- Qwen3.5-MoE (``families/qwen3_5_moe.py``): its layers' own rules (Gated DeltaNet ``in_proj`` = HF's four
  input projections concatenated; gated ``linear_qkv``; the shared expert and its gate), then the
  router and routed experts below.
- Tied embeddings: Megatron has no ``output_layer.weight``; :func:`megatron_to_hf` returns
  ``lm_head.weight`` as the same tensor as ``model.embed_tokens.weight`` (the HF model's state dict
  has both keys).

HF expert layouts: transformers >= 5 stacks experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``, router ``mlp.gate.weight``); 4.x has one module per expert
(Qwen3-MoE ``mlp.experts.{e}.gate_proj/up_proj/down_proj``, Mixtral
``block_sparse_moe.experts.{e}.w1/w3/w2`` and ``block_sparse_moe.gate``). Both are read; which one
:func:`megatron_to_hf` writes is ``hf_moe_layout`` (default: the installed transformers' layout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .architecture import Architecture, describe
from .families import glm_moe_dsa, qwen3_5_moe

__all__ = ["hf_to_megatron", "megatron_to_hf", "iter_megatron_to_hf", "experts_to_global", "hf_moe_layout", "HF_MOE_LAYOUTS",
           "ConversionError", "part_to_hf", "EMBEDDING", "HEAD"]

HF_MOE_LAYOUTS = ("fused", "per_expert")
_EXTRA_STATE = "._extra_state"  # Transformer Engine's fp8 metadata: not a weight


class ConversionError(KeyError):
    """A state dict that does not match the config's layout (the message names the keys)."""

    def __str__(self) -> str:  # KeyError would print the message repr'd
        return str(self.args[0])


# ---- the two fused layouts ------------------------------------------------------------------------
def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """HF q/k/v projections (weights ``[out, in]`` or biases ``[out]``) -> Megatron's grouped ``linear_qkv``."""
    g, d = arch.num_query_groups, arch.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, arch.heads_per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def qkv_to_hf(qkv: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`qkv_to_megatron`."""
    g, d = arch.num_query_groups, arch.head_dim
    rest = qkv.shape[1:]
    q, k, v = torch.split(qkv.reshape(g, (arch.heads_per_group + 2) * d, *rest), [arch.heads_per_group * d, d, d],
                          dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _identity(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _single(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _halves(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.chunk(tensor, 2, dim=0))


@dataclass(frozen=True)
class _Rule:
    """HF tensors ``hf`` (in the order ``merge`` takes them) <-> the Megatron tensor ``mcore``."""

    hf: tuple[str, ...]
    mcore: str
    merge: Callable[[list[torch.Tensor]], torch.Tensor] = _identity
    split: Callable[[torch.Tensor], list[torch.Tensor]] = _single


# ---- the name tables ------------------------------------------------------------------------------
def _canonical_expert(layer: int, expert: int, proj: str) -> str:
    """The per-expert HF name used inside this module (Qwen3-MoE 4.x spelling) for every layout."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def _canonical_router(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def _attention_rules(arch: Architecture, i: int, fused_norms: bool) -> list[_Rule]:
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    if arch.mla_dsa is not None:  # GLM-5: its own names, all unchanged layouts; the input norm is never fused
        return [_Rule((hf + "input_layernorm.weight",), mc + "input_layernorm.weight"),
                *(_Rule((h,), m) for h, m in glm_moe_dsa.attention_names(arch.mla_dsa, i))]
    attn = hf + "self_attn."
    qkv = lambda ts: qkv_to_megatron(*ts, arch)  # noqa: E731
    unqkv = lambda t: list(qkv_to_hf(t, arch))  # noqa: E731
    rules = [
        _Rule((hf + "input_layernorm.weight",),
              mc + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight")),
        _Rule(tuple(f"{attn}{p}_proj.weight" for p in "qkv"), mc + "self_attention.linear_qkv.weight", qkv, unqkv),
        _Rule((attn + "o_proj.weight",), mc + "self_attention.linear_proj.weight"),
    ]
    if arch.qkv_bias:
        rules.append(_Rule(tuple(f"{attn}{p}_proj.bias" for p in "qkv"), mc + "self_attention.linear_qkv.bias",
                           qkv, unqkv))
    if arch.qk_norm:
        rules += [_Rule((attn + "q_norm.weight",), mc + "self_attention.q_layernorm.weight"),
                  _Rule((attn + "k_norm.weight",), mc + "self_attention.k_layernorm.weight")]
    return rules


def _layer_rules(arch: Architecture, i: int, fused_norms: bool) -> list[_Rule]:
    if arch.linear_attention is not None:  # Qwen3.5's hybrid layers: families/qwen3_5_moe.py
        if fused_norms:
            raise ValueError(f"{arch.model_type} is built with its own layer spec, whose norms are never fused "
                             "into the linear layers: convert with fused_norms=False")
        return [_Rule(*rule) for rule in qwen3_5_moe.layer_rules(arch, i)] + _routed_expert_rules(arch, i)
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    rules = _attention_rules(arch, i, fused_norms)
    fused_norms = fused_norms and arch.mla_dsa is None  # the DSA spec keeps every norm separate
    moe = arch.is_moe_layer(i)
    pre_mlp = "mlp.linear_fc1.layer_norm_weight" if fused_norms and not moe else "pre_mlp_layernorm.weight"
    rules.append(_Rule((hf + "post_attention_layernorm.weight",), mc + pre_mlp))
    if not moe:
        return rules + [
            _Rule((hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), mc + "mlp.linear_fc1.weight",
                  _cat_rows, _halves),
            _Rule((hf + "mlp.down_proj.weight",), mc + "mlp.linear_fc2.weight"),
        ]
    if arch.router_expert_bias:  # DeepSeek-V3 / GLM-5 name; an fp32 buffer on both sides
        rules.append(_Rule((hf + "mlp.gate.e_score_correction_bias",), mc + "mlp.router.expert_bias"))
    if arch.shared_expert_ffn_hidden_size:  # DeepSeek-V3 / GLM-5 names: one SwiGLU for all shared experts
        shared = hf + "mlp.shared_experts."
        rules += [_Rule((shared + "gate_proj.weight", shared + "up_proj.weight"),
                        mc + "mlp.shared_experts.linear_fc1.weight", _cat_rows, _halves),
                  _Rule((shared + "down_proj.weight",), mc + "mlp.shared_experts.linear_fc2.weight")]
    return rules + _routed_expert_rules(arch, i)


def _routed_expert_rules(arch: Architecture, i: int) -> list[_Rule]:
    """MoE layer ``i``'s router and routed experts (globally numbered)."""
    mc = f"decoder.layers.{i}."
    rules = [_Rule((_canonical_router(i),), mc + "mlp.router.weight")]
    for e in range(arch.num_experts):
        expert = f"{mc}mlp.experts.local_experts.{e}."
        rules += [
            _Rule((_canonical_expert(i, e, "gate_proj"), _canonical_expert(i, e, "up_proj")),
                  expert + "linear_fc1.weight", _cat_rows, _halves),
            _Rule((_canonical_expert(i, e, "down_proj"),), expert + "linear_fc2.weight"),
        ]
    return rules


def _rules(arch: Architecture, fused_norms: bool) -> list[_Rule]:
    rules = [_Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight")]
    for i in range(arch.num_layers):
        rules += _layer_rules(arch, i, fused_norms)
    rules.append(_Rule(("model.norm.weight",), "decoder.final_layernorm.weight"))
    if not arch.tied_embeddings:
        rules.append(_Rule(("lm_head.weight",), "output_layer.weight"))
    return rules


# ---- HF expert layouts <-> the canonical per-expert names -----------------------------------------
_MIXTRAL_4X = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MIXTRAL_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_MIXTRAL_ROUTER = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


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


def _hf_to_canonical(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, t in hf_state.items():
        if m := _FUSED_EXPERTS.match(key):
            layer, which = int(m.group(1)), m.group(2)
            for e in range(t.shape[0]):
                if which == "down_proj":
                    out[_canonical_expert(layer, e, "down_proj")] = t[e]
                else:
                    gate, up = torch.chunk(t[e], 2, dim=0)
                    out[_canonical_expert(layer, e, "gate_proj")] = gate
                    out[_canonical_expert(layer, e, "up_proj")] = up
        elif m := _MIXTRAL_EXPERT.match(key):
            out[_canonical_expert(int(m.group(1)), int(m.group(2)), _MIXTRAL_4X[m.group(3)])] = t
        elif m := _MIXTRAL_ROUTER.match(key):
            out[_canonical_router(int(m.group(1)))] = t
        else:
            out[key] = t
    return out


def _canonical_to_hf(state: dict[str, torch.Tensor], arch: Architecture, layout: str,
                     layers: Optional[Sequence[int]] = None) -> dict[str, torch.Tensor]:
    """The canonical per-expert names of ``layers`` (default: every MoE layer) in the HF ``layout``."""
    if layout not in HF_MOE_LAYOUTS:
        raise ValueError(f"hf_moe_layout must be one of {HF_MOE_LAYOUTS}, got {layout!r}")
    out = dict(state)
    for i in (i for i in (range(arch.num_layers) if layers is None else layers) if arch.is_moe_layer(i)):
        names = {proj: [_canonical_expert(i, e, proj) for e in range(arch.num_experts)]
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        if layout == "fused":
            experts = f"model.layers.{i}.mlp.experts."
            out[experts + "gate_up_proj"] = torch.stack(
                [torch.cat([out.pop(g), out.pop(u)], dim=0) for g, u in zip(names["gate_proj"], names["up_proj"])])
            out[experts + "down_proj"] = torch.stack([out.pop(d) for d in names["down_proj"]])
        elif arch.model_type == "mixtral":
            block = f"model.layers.{i}.block_sparse_moe."
            out[block + "gate.weight"] = out.pop(_canonical_router(i))
            for w, proj in _MIXTRAL_4X.items():
                for e, name in enumerate(names[proj]):
                    out[f"{block}experts.{e}.{w}.weight"] = out.pop(name)
    return out


# ---- the model's parts, in the order the weight handoff sends them --------------------------------
EMBEDDING, HEAD = "embedding", "head"  # the parts around the decoder layers (which are numbered)


def _part_rules(arch: Architecture, part: "int | str", fused_norms: bool) -> list[_Rule]:
    if part == EMBEDDING:
        return [_Rule(("model.embed_tokens.weight",), "embedding.word_embeddings.weight")]
    if part == HEAD:
        tail = [_Rule(("model.norm.weight",), "decoder.final_layernorm.weight")]
        if not arch.tied_embeddings:
            tail.append(_Rule(("lm_head.weight",), "output_layer.weight"))
        return tail
    return _layer_rules(arch, part, fused_norms)


def part_to_hf(part: "int | str", mcore_state: dict[str, torch.Tensor], hf_config: Any, *, fused_norms: bool = False,
               hf_moe_layout: Optional[str] = None) -> dict[str, torch.Tensor]:
    """One part of the model in HF names: :data:`EMBEDDING`, decoder layer ``part`` (global number, experts
    globally numbered) or :data:`HEAD` (final norm, and the output layer unless tied), from the Megatron tensors
    of that part in ``mcore_state`` (other keys are ignored). Views where the split rules allow."""
    arch = describe(hf_config)
    out = {}
    for rule in _part_rules(arch, part, fused_norms):
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
    """One expert-parallel rank's state with its ``local_experts.{i}`` renumbered to global expert ids."""
    return _renumber_experts(mcore_state, _local_experts(describe(hf_config), ep_rank, ep_size).start)


def hf_to_megatron(hf_state: dict[str, torch.Tensor], hf_config: Any, *, fused_norms: bool = False,
                   ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron state dict of expert-parallel rank ``ep_rank`` (all dense weights, its own experts)."""
    arch = describe(hf_config)
    local = _local_experts(arch, ep_rank, ep_size)
    state = _hf_to_canonical(hf_state)
    out, used = {}, set()
    for rule in _rules(arch, fused_norms):
        missing = [k for k in rule.hf if k not in state]
        if missing:
            raise ConversionError(f"the HF state dict lacks {missing} (needed for Megatron's {rule.mcore}); "
                                  f"is it a {arch.model_type} model of this config?")
        used.update(rule.hf)
        m = _LOCAL_EXPERT.match(rule.mcore)
        if m and int(m.group(2)) not in local:
            continue  # another expert-parallel rank's expert
        out[rule.mcore] = rule.merge([state[k] for k in rule.hf])
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

    def convert(rules: list[_Rule], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for rule in rules:
            if rule.mcore not in state:
                raise ConversionError(f"the Megatron state dict lacks {rule.mcore!r}; with expert parallelism, "
                                      "gather every rank's experts through experts_to_global first")
            used.add(rule.mcore)
            out.update(zip(rule.hf, rule.split(state[rule.mcore])))
        return out

    embedding = convert(_part_rules(arch, EMBEDDING, fused_norms), mcore_state)
    yield from embedding.items()
    for i in range(arch.num_layers):
        state = mcore_state
        if layer_experts is not None and arch.is_moe_layer(i):
            prefix = f"decoder.layers.{i}.mlp.experts.local_experts."
            local = {k: v for k, v in mcore_state.items() if k.startswith(prefix)}
            state = {**{k: v for k, v in mcore_state.items() if not k.startswith(prefix)}, **layer_experts(i, local)}
            used.update(local)
        layer = convert(_part_rules(arch, i, fused_norms), state)
        if arch.is_moe_layer(i):
            layer = _canonical_to_hf(layer, arch, layout, layers=(i,))
        yield from layer.items()
    yield from convert(_part_rules(arch, HEAD, fused_norms), mcore_state).items()
    if arch.tied_embeddings:
        yield "lm_head.weight", embedding["model.embed_tokens.weight"]
    unused = sorted(k for k in set(mcore_state) - used if not k.endswith(_EXTRA_STATE))
    if unused:
        raise ConversionError(f"the Megatron state dict has tensors the {arch.model_type} layout does not map: "
                              f"{unused[:6]}{' ...' if len(unused) > 6 else ''}")
