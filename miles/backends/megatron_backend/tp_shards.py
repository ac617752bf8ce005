"""Megatron state dicts cut into tensor- and pipeline-parallel shards, and gathered back (pure, CPU-testable).

    shard = tp_shard(full_mcore_state, tp_rank=1, tp=2, etp_rank=0, etp=1, vocab_size=arch.vocab_size,
                     rules=arch.tp_rules)
    full = tp_gather([shard_0, shard_1], tp_rank=0, etp=1, vocab_size=arch.vocab_size, rules=arch.tp_rules)
    stage = pp_stage(full_mcore_state, stage_layers(arch.num_layers, layout), stage=2, tied_embeddings=False)
    full = pp_unstage([stage_0, ..., stage_3], stages, tied_embeddings=False)

The full state is :func:`~.convert.hf_to_megatron`'s (global layer numbers; experts local to an expert-parallel
rank, so ETP cuts the experts a rank holds). How megatron-core 0.19 splits each tensor:

- column-parallel (output rows split over TP): ``linear_qkv`` (weight and bias) -- its rows are grouped per
  query group, so a contiguous cut gives each rank whole groups (the layout check makes groups divide by
  TP);
- sectioned column-parallel: ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]`` and each rank holds
  ``[gate_r; up_r]``: gate and up are cut each, not the fused rows;
- row-parallel (input columns split): ``linear_proj``, ``linear_fc2``;
- vocab-parallel: ``embedding.word_embeddings`` and ``output_layer`` rows, after padding the vocabulary to a
  multiple of 128 x TP (Megatron-LM's ``--make-vocab-size-divisible-by 128``). At TP 1 the backend builds the
  HF vocabulary unpadded (as before TP existed): :func:`padded_vocab_size` says which. Padding rows are
  zero; the vocab-parallel log-softmax masks their logits;
- replicated: norms (``*layernorm*``, ``layer_norm_weight``), q/k norms, the MoE router and its expert bias;
- a family's own tensors by its :class:`TpRules` (``Architecture.tp_rules``): more names of each kind, and the
  row sections of tensors whose fused rows are cut section by section (a Gated DeltaNet's ``in_proj``: megatron
  splits the projection's output by the local sections);
- routed experts (``mlp.experts.local_experts.{i}``) the same rules over the expert-tensor-parallel group
  (ETP), not TP; grouped experts (``mlp.experts.linear_fc1/2.weight``, every local expert on the leading axis:
  ``pieces/grouped_experts.py``) cut each expert's slice as that rule says.
Pipeline stages hold their decoder layers renumbered from 0 (``decoder.layers.{local}``); the first stage the
embedding, the last the final norm and the output layer. With tied embeddings and PP > 1 the last stage holds
``output_layer.weight`` too (Megatron keeps a copy there and all-reduces its grad with the first stage's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

__all__ = ["VOCAB_DIVISIBLE_BY", "TpRules", "padded_vocab_size", "split_kind", "tp_shard", "tp_gather", "pp_stage",
           "pp_unstage"]

VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default (times TP)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
# The GPT layer's tensors, by how they split (name suffixes, regular expressions)
_GPT_KINDS = {"swiglu": (r"linear_fc1\.weight",), "column": (r"linear_qkv\.(weight|bias)",),
              "row": (r"linear_proj\.weight", r"linear_fc2\.weight"),
              "replicated": (r"layernorm\.(weight|bias)", r"layer_norm_(weight|bias)", r"router\.weight",
                             r"router\.expert_bias")}


@dataclass(frozen=True)
class TpRules:
    """How a family's own tensors split over tensor parallelism, beyond the GPT layer's: name suffixes (regular
    expressions) per kind, and ``sections``: ``(name, rows)`` pairs, a sectioned tensor's name without its
    ``.weight``/``.bias`` and its full row sections, each cut over TP (``("self_attention.in_proj", (q, k, v, z,
    beta, alpha))``)."""

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    sections: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def section_rows(self, name: str) -> tuple[int, ...]:
        base = name.rsplit(".", 1)[0]
        return next(rows for key, rows in self.sections if base.endswith(key))

    def joined(self, *others: "TpRules") -> "TpRules":
        """The rules of this and ``others`` together (a family composing pieces)."""
        every = (self, *others)
        return TpRules(column=sum((r.column for r in every), ()), row=sum((r.row for r in every), ()),
                       replicated=sum((r.replicated for r in every), ()), sections=sum((r.sections for r in every), ()))


@lru_cache(maxsize=64)
def _kinds(rules: TpRules) -> tuple[tuple[str, "re.Pattern[str]"], ...]:
    """(kind, pattern) in the order a name is matched: the sectioned ones before their column kin."""
    def pattern(*suffixes: str) -> "re.Pattern[str]":
        return re.compile("(" + "|".join(suffixes) + ")$") if suffixes else re.compile(r"(?!)")

    sectioned = tuple(re.escape(name) + r"\.(weight|bias)" for name, _ in rules.sections)
    return (("swiglu", pattern(*_GPT_KINDS["swiglu"])), ("sections", pattern(*sectioned)),
            ("column", pattern(*_GPT_KINDS["column"], *rules.column)),
            ("row", pattern(*_GPT_KINDS["row"], *rules.row)),
            ("replicated", pattern(*_GPT_KINDS["replicated"], *rules.replicated)))


GPT_RULES = TpRules()


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and output layer the backend builds: the HF vocabulary at TP 1, else padded to a
    multiple of 128 x TP (each rank then holds an equal slice)."""
    if tp == 1:
        return vocab_size
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def split_kind(name: str, rules: TpRules = GPT_RULES) -> str:
    """How Megatron splits the tensor ``name`` over its tensor-parallel group: ``column``, ``swiglu`` (column,
    gate and up cut each), ``sections`` (column, each of the model's row sections cut), ``row``, ``vocab`` or
    ``replicated``. A name no rule knows is an error: a tensor
    silently replicated where Megatron splits it would train a wrong model."""
    if name in _VOCAB:
        return "vocab"
    for kind, pattern in _kinds(rules):
        if pattern.search(name):
            return kind
    raise KeyError(f"no tensor-parallel rule for Megatron tensor {name!r}")


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _lead(name: str) -> int:
    """Leading axes before a tensor's rows: 1 for a routed-expert tensor not numbered per expert (grouped experts
    hold every local expert on axis 0), else 0."""
    return int(_is_expert(name) and ".local_experts." not in name)


def _section_rows(name: str, kind: str, full_rows: int, rules: TpRules) -> list[int]:
    """The full tensor's row sections that are cut each (``swiglu``: gate and up; ``sections``: the model's);
    [] for the other kinds."""
    if kind not in ("swiglu", "sections"):
        return []
    if kind == "swiglu":
        return [full_rows // 2] * 2
    rows = [int(r) for r in rules.section_rows(name)]
    if sum(rows) != full_rows:
        raise ValueError(f"{name}: {full_rows} rows, and its sections {rows} sum to {sum(rows)}")
    return rows


def _cut(tensor: torch.Tensor, kind: str, rank: int, size: int, padded_rows: int, rows: Sequence[int],
         lead: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor``, its rows on axis ``lead`` (its columns the next)."""
    if size == 1 and kind != "vocab":
        return tensor
    if kind == "replicated":
        return tensor
    if kind == "column":
        return torch.chunk(tensor, size, dim=lead)[rank]
    if kind == "row":
        return torch.chunk(tensor, size, dim=lead + 1)[rank]
    if kind in ("swiglu", "sections"):
        return torch.cat([torch.chunk(part, size, dim=lead)[rank]
                          for part in torch.split(tensor, list(rows), dim=lead)], dim=lead)
    vocab_rows = padded_rows // size
    padded = torch.zeros(padded_rows, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    padded[:tensor.shape[0]] = tensor
    return padded[rank * vocab_rows:(rank + 1) * vocab_rows].clone()


def _join(shards: Sequence[torch.Tensor], kind: str, vocab_size: int, rows: Sequence[int],
          lead: int) -> torch.Tensor:
    """Inverse of :func:`_cut`."""
    if kind == "replicated":
        return shards[0]
    if len(shards) == 1 and kind != "vocab":
        return shards[0]
    if kind == "column":
        return torch.cat(list(shards), dim=lead)
    if kind == "row":
        return torch.cat(list(shards), dim=lead + 1)
    if kind in ("swiglu", "sections"):
        local = [r // len(shards) for r in rows]
        pieces = [torch.split(s, local, dim=lead) for s in shards]
        return torch.cat([p[i] for i in range(len(local)) for p in pieces], dim=lead)
    return torch.cat(list(shards), dim=0)[:vocab_size]


def _check_divides(name: str, tensor: torch.Tensor, kind: str, size: int, rows: Sequence[int], lead: int) -> None:
    if kind in ("swiglu", "sections"):
        bad = [r for r in rows if r % size]
        if bad:
            raise ValueError(f"{name}: its row sections {list(rows)} do not each split over {size} tensor-parallel "
                             "ranks")
        return
    dim = {"column": 0, "row": 1}.get(kind)
    if dim is not None and tensor.shape[lead + dim] % size:
        raise ValueError(f"{name}: {tensor.shape[lead + dim]} {'rows' if dim == 0 else 'columns'} do not split "
                         f"over {size} tensor-parallel ranks")


def tp_shard(state: dict[str, torch.Tensor], *, tp_rank: int, tp: int, etp_rank: int = 0, etp: int = 1,
             vocab_size: int, rules: TpRules = GPT_RULES) -> dict[str, torch.Tensor]:
    """The tensors tensor-parallel rank ``tp_rank`` (and expert-tensor-parallel rank ``etp_rank``) holds.
    ``rules``: how the model's own tensors split (``Architecture.tp_rules``)."""
    if not (0 <= tp_rank < tp and 0 <= etp_rank < etp):
        raise ValueError(f"tp_rank {tp_rank} / etp_rank {etp_rank} outside TP {tp} / ETP {etp}")
    out = {}
    for name, tensor in state.items():
        kind = split_kind(name, rules)
        rank, size = (etp_rank, etp) if _is_expert(name) else (tp_rank, tp)
        lead = _lead(name)
        rows = _section_rows(name, kind, tensor.shape[lead], rules)
        _check_divides(name, tensor, kind, size, rows, lead)
        out[name] = _cut(tensor, kind, rank, size, padded_vocab_size(vocab_size, tp), rows, lead)
    return out


def tp_gather(shards: Sequence[dict[str, torch.Tensor]], *, tp_rank: int, etp: int = 1, vocab_size: int,
              rules: TpRules = GPT_RULES) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tp_shard`, as TP rank ``tp_rank`` of the group sees it: ``shards[r]`` is TP rank r's
    state. The dense tensors join over every rank; a routed expert's over ``tp_rank``'s expert-tensor-parallel
    group only, the ``etp`` ranks ``(tp_rank // etp) * etp ..`` (ranks number ETP fastest, then EP, and ETP
    divides TP): with expert parallelism the other TP ranks hold other experts under the same local names."""
    first = (tp_rank // etp) * etp
    out = {}
    for name in shards[0]:
        kind = split_kind(name, rules)
        parts = [s[name] for s in (shards[first:first + etp] if _is_expert(name) else shards)]
        lead = _lead(name)
        rows = _section_rows(name, kind, parts[0].shape[lead] * len(parts), rules)
        out[name] = _join(parts, kind, vocab_size, rows, lead)
    return out


def _stage_name(name: str, layers: range) -> str | None:
    """``name`` as the stage holding ``layers`` spells it, or None when the stage does not hold it."""
    m = _LAYER.match(name)
    if m is None:
        return None
    layer = int(m.group(1))
    return f"decoder.layers.{layer - layers.start}.{m.group(2)}" if layer in layers else None


def pp_stage(state: dict[str, torch.Tensor], stages: Sequence[range], stage: int, *,
             tied_embeddings: bool) -> dict[str, torch.Tensor]:
    """The tensors pipeline stage ``stage`` of ``stages`` holds, layers renumbered from 0."""
    first, last = stage == 0, stage == len(stages) - 1
    out = {}
    for name, tensor in state.items():
        local = _stage_name(name, stages[stage])
        if local is not None:
            out[local] = tensor
        elif name == "embedding.word_embeddings.weight":
            if first:
                out[name] = tensor
            if last and tied_embeddings and not first:
                out["output_layer.weight"] = tensor
        elif name in ("decoder.final_layernorm.weight", "output_layer.weight") and last:
            out[name] = tensor
    return out


def pp_unstage(stage_states: Sequence[dict[str, torch.Tensor]], stages: Sequence[range], *,
               tied_embeddings: bool) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pp_stage`: one state with global layer numbers (a tied copy on the last stage is
    dropped: the first stage's embedding is the weight)."""
    out = {}
    last = len(stages) - 1
    for stage, (layers, state) in enumerate(zip(stages, stage_states)):
        for name, tensor in state.items():
            m = _LAYER.match(name)
            if m is not None:
                out[f"decoder.layers.{int(m.group(1)) + layers.start}.{m.group(2)}"] = tensor
            elif name == "output_layer.weight" and tied_embeddings and stage == last and last > 0:
                continue
            else:
                out[name] = tensor
    return out
