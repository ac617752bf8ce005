"""Routed experts built as one grouped GEMM per projection (``grouped_experts_layers.py``), not megatron's
``SequentialMLP`` (one small GEMM per expert in a Python loop): their weight layout, HF <-> Megatron rules and
expert-parallel joins (pure, no megatron import).

Each MoE layer's experts module (megatron-core's ``TEGroupedMLP`` with this backend's grouped linears) holds one
parameter per projection, every local expert on its leading axis:

- ``mlp.experts.linear_fc1.weight`` ``[E_local, 2 * I, H]``: expert e's ``[gate; up]`` rows (SequentialMLP's
  ``local_experts.{e}.linear_fc1.weight`` stacked; transformers 5's ``mlp.experts.gate_up_proj``);
- ``mlp.experts.linear_fc2.weight`` ``[E_local, H, I]`` (transformers 5's ``mlp.experts.down_proj``).

With expert parallelism rank r holds experts ``r * E_local ..`` on that axis, so the global tensor is the ranks'
concatenated in rank order. Under expert-tensor parallelism each expert's ``[out, in]`` slice is cut as
SequentialMLP's expert is (fc1 gate and up rows each, fc2 columns: ``tp_shards.py``).

Which build the backend uses is ``--moe-grouped-gemm`` (``model.build_gpt_model``'s ``grouped_experts``).
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from ..weight_rules import Rule

__all__ = ["is_grouped_expert", "grouped_expert_rules", "stacked_rule", "hf_names_of_experts", "join_expert_ranks"]

# SequentialMLP's per-expert projection weights (``weight_rules.routed_expert_rules``) and the grouped tensor each
# joins: the name without ``local_experts.{e}.``
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_GROUPED = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight$")


def is_grouped_expert(name: str) -> bool:
    """Whether Megatron tensor ``name`` holds every local expert of a layer on its leading axis."""
    return _GROUPED.search(name) is not None


def stacked_rule(per_expert: Sequence[Rule], mcore: str) -> Rule:
    """One rule for ``per_expert`` (expert 0 first; one merge and split for all, each taking the same number of
    HF tensors): its Megatron tensor ``mcore`` is theirs stacked on a new leading axis. ``merge`` takes the HF
    tensors of any run of consecutive experts (an expert-parallel rank's), ``split`` returns views."""
    first = per_expert[0]
    odd = [r.mcore for r in per_expert if (r.merge, r.split, len(r.hf)) != (first.merge, first.split, len(first.hf))]
    if odd:
        raise ValueError(f"{mcore}: the per-expert rules of {odd[:3]} convert unlike {first.mcore}'s; a grouped "
                         "tensor stacks experts that all convert alike")
    width = len(first.hf)

    def merge(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([first.merge(tensors[i:i + width]) for i in range(0, len(tensors), width)])

    def split(stacked: torch.Tensor) -> list[torch.Tensor]:
        return [t for expert in stacked.unbind(0) for t in first.split(expert)]

    return Rule(tuple(name for r in per_expert for name in r.hf), mcore, merge, split)


def grouped_expert_rules(rules: list[Rule]) -> list[Rule]:
    """A layer's rules with SequentialMLP's per-expert projection rules replaced by the grouped tensors' (each
    where its expert 0 stood); every other rule as it was."""
    groups: dict[str, dict[int, Rule]] = {}
    order: list["Rule | str"] = []
    for rule in rules:
        m = _PER_EXPERT.match(rule.mcore)
        if m is None:
            order.append(rule)
            continue
        name = m.group(1) + m.group(3)
        if name not in groups:
            groups[name] = {}
            order.append(name)
        groups[name][int(m.group(2))] = rule
    for name, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{name}: per-expert rules of experts {sorted(experts)[:8]}..., not 0..{len(experts) - 1}"
                             ": a grouped tensor needs every expert of the layer")
    return [stacked_rule([groups[x][e] for e in range(len(groups[x]))], x) if isinstance(x, str) else x
            for x in order]


def hf_names_of_experts(rule: Rule, experts: range, num_experts: int) -> tuple[str, ...]:
    """The HF tensors of grouped ``rule`` that make experts ``experts`` (an expert-parallel rank's) of
    ``num_experts``: what its ``merge`` takes for that rank's tensor."""
    width, odd = divmod(len(rule.hf), num_experts)
    if odd or not width:
        raise ValueError(f"{rule.mcore}: {len(rule.hf)} HF tensors do not make {num_experts} experts")
    return rule.hf[experts.start * width:experts.stop * width]


def join_expert_ranks(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One grouped tensor of every expert-parallel rank (rank order) as the layer's global tensor."""
    return torch.cat(list(parts), dim=0)
