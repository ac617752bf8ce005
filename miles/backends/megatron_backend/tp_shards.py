"""Megatron state dicts cut into tensor- and pipeline-parallel shards, and gathered back (pure, CPU-testable).

    cut = dict(vocab_size=arch.vocab_size, sections=arch.tp_row_sections)
    shard = tp_shard(full_mcore_state, tp_rank=1, tp=2, etp_rank=0, etp=1, **cut)
    full = tp_gather([shard_0, shard_1], tp_rank=0, etp=1, **cut)  # == the full state
    stage = pp_stage(full_mcore_state, stage_layers(arch.num_layers, layout), stage=2, tied_embeddings=False)
    full = pp_unstage([stage_0, ..., stage_3], stages, tied_embeddings=False)

The full state is :func:`~.convert.hf_to_megatron`'s (global layer numbers; experts local to an expert-parallel
rank, so ETP cuts the experts a rank holds). How megatron-core 0.19 splits each tensor:

- column-parallel (output rows split over TP): ``linear_qkv`` (weight and bias) -- its rows are grouped per
  query group, so a contiguous cut gives each rank whole groups (the layout check makes groups divide by
  TP); multi-latent attention's (GLM-5) up projections (rows head by head: whole heads per rank) and its
  down projections (megatron's local MLA builds them column-parallel and gathers the latent); the Gated
  DeltaNet's (Qwen3.5) per-head ``dt_bias`` and ``A_log``;
- sectioned column-parallel: ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]`` and each rank holds
  ``[gate_r; up_r]``: gate and up are cut each, not the fused rows; so are the sections of the Gated DeltaNet's
  ``in_proj`` (``[q; k; v; z; beta; alpha]``) and of its depthwise ``conv1d`` (``[q; k; v]``), whose full row
  counts come from the model (``sections``; megatron splits the projection's output by the local ones);
- row-parallel (input columns split): ``linear_proj``, ``linear_fc2``, the Gated DeltaNet's ``out_proj``;
- vocab-parallel: ``embedding.word_embeddings`` and ``output_layer`` rows, after padding the vocabulary to a
  multiple of 128 x TP (Megatron-LM's ``--make-vocab-size-divisible-by 128``). At TP 1 the backend builds the
  HF vocabulary unpadded (as before TP existed): :func:`padded_vocab_size` says which. Padding rows are
  zero; the vocab-parallel log-softmax masks their logits;
- replicated: norms (``*layernorm*``, ``layer_norm_weight``), q/k norms and the Gated DeltaNet's output norm
  (per head dim), the MoE router, the shared expert's gate, the sparse-attention indexer (its projections are
  duplicated on every rank);
- routed experts (``mlp.experts.local_experts.{i}``) the same rules over the expert-tensor-parallel group
  (ETP), not TP.
Pipeline stages hold their decoder layers renumbered from 0 (``decoder.layers.{local}``); the first stage the
embedding, the last the final norm and the output layer. With tied embeddings and PP > 1 the last stage holds
``output_layer.weight`` too (Megatron keeps a copy there and all-reduces its grad with the first stage's).
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

import torch

__all__ = ["VOCAB_DIVISIBLE_BY", "padded_vocab_size", "split_kind", "tp_shard", "tp_gather", "pp_stage",
           "pp_unstage"]

VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default (times TP)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_COLUMN = re.compile(r"(linear_qkv\.(weight|bias)|linear_(q|kv)_(down|up)_proj\.weight"
                     r"|self_attention\.(dt_bias|A_log))$")
_SWIGLU = re.compile(r"linear_fc1\.weight$")
_SECTIONS = re.compile(r"self_attention\.(in_proj|conv1d)\.(weight|bias)$")  # group 1: the key of ``sections``
_ROW = re.compile(r"(linear_proj|linear_fc2|self_attention\.out_proj)\.weight$")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_REPLICATED = re.compile(r"(layernorm\.weight|layernorm\.bias|layer_norm_weight|layer_norm_bias|router\.weight"
                         r"|router\.expert_bias|\.indexer\..*|self_attention\.out_norm\.weight"
                         r"|shared_experts\.gate_weight)$")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and output layer the backend builds: the HF vocabulary at TP 1, else padded to a
    multiple of 128 x TP (each rank then holds an equal slice)."""
    if tp == 1:
        return vocab_size
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab_size // multiple) * multiple


def split_kind(name: str) -> str:
    """How Megatron splits the tensor ``name`` over its tensor-parallel group: ``column``, ``swiglu`` (column,
    gate and up cut each), ``sections`` (column, each of the model's row sections cut), ``row``, ``vocab`` or
    ``replicated``. A name no rule knows is an error: a tensor
    silently replicated where Megatron splits it would train a wrong model."""
    if name in _VOCAB:
        return "vocab"
    for kind, pattern in (("swiglu", _SWIGLU), ("sections", _SECTIONS), ("column", _COLUMN), ("row", _ROW),
                          ("replicated", _REPLICATED)):
        if pattern.search(name):
            return kind
    raise KeyError(f"no tensor-parallel rule for Megatron tensor {name!r}")


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _section_rows(name: str, kind: str, full_rows: int,
                  sections: Optional[Mapping[str, Sequence[int]]]) -> list[int]:
    """The full tensor's row sections that are cut each (``swiglu``: gate and up; ``sections``: the model's);
    [] for the other kinds."""
    if kind not in ("swiglu", "sections"):
        return []
    if kind == "swiglu":
        return [full_rows // 2] * 2
    key = _SECTIONS.search(name).group(1)
    if key not in (sections or {}):
        raise KeyError(f"{name}: its row sections ({key!r}) were not given: pass the model's (Architecture."
                       "tp_row_sections)")
    rows = [int(r) for r in sections[key]]
    if sum(rows) != full_rows:
        raise ValueError(f"{name}: {full_rows} rows, and its sections {rows} sum to {sum(rows)}")
    return rows


def _cut(tensor: torch.Tensor, kind: str, rank: int, size: int, padded_rows: int,
         rows: Sequence[int]) -> torch.Tensor:
    if size == 1 and kind != "vocab":
        return tensor
    if kind == "replicated":
        return tensor
    if kind == "column":
        return torch.chunk(tensor, size, dim=0)[rank]
    if kind == "row":
        return torch.chunk(tensor, size, dim=1)[rank]
    if kind in ("swiglu", "sections"):
        return torch.cat([torch.chunk(part, size, dim=0)[rank] for part in torch.split(tensor, list(rows), dim=0)])
    vocab_rows = padded_rows // size
    padded = torch.zeros(padded_rows, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    padded[:tensor.shape[0]] = tensor
    return padded[rank * vocab_rows:(rank + 1) * vocab_rows].clone()


def _join(shards: Sequence[torch.Tensor], kind: str, vocab_size: int, rows: Sequence[int]) -> torch.Tensor:
    if kind == "replicated":
        return shards[0]
    if len(shards) == 1 and kind != "vocab":
        return shards[0]
    if kind == "column":
        return torch.cat(list(shards), dim=0)
    if kind == "row":
        return torch.cat(list(shards), dim=1)
    if kind in ("swiglu", "sections"):
        local = [r // len(shards) for r in rows]
        pieces = [torch.split(s, local, dim=0) for s in shards]
        return torch.cat([p[i] for i in range(len(local)) for p in pieces], dim=0)
    return torch.cat(list(shards), dim=0)[:vocab_size]


def _check_divides(name: str, tensor: torch.Tensor, kind: str, size: int, rows: Sequence[int]) -> None:
    if kind in ("swiglu", "sections"):
        bad = [r for r in rows if r % size]
        if bad:
            raise ValueError(f"{name}: its row sections {list(rows)} do not each split over {size} tensor-parallel "
                             "ranks")
        return
    dim = {"column": 0, "row": 1}.get(kind)
    if dim is not None and tensor.shape[dim] % size:
        raise ValueError(f"{name}: {tensor.shape[dim]} {'rows' if dim == 0 else 'columns'} do not split over "
                         f"{size} tensor-parallel ranks")


def tp_shard(state: dict[str, torch.Tensor], *, tp_rank: int, tp: int, etp_rank: int = 0, etp: int = 1,
             vocab_size: int, sections: Optional[Mapping[str, Sequence[int]]] = None) -> dict[str, torch.Tensor]:
    """The tensors tensor-parallel rank ``tp_rank`` (and expert-tensor-parallel rank ``etp_rank``) holds.
    ``sections``: the full row counts of the sectioned tensors (``{"in_proj": [...], "conv1d": [...]}`` of a Gated
    DeltaNet; ``Architecture.tp_row_sections``)."""
    if not (0 <= tp_rank < tp and 0 <= etp_rank < etp):
        raise ValueError(f"tp_rank {tp_rank} / etp_rank {etp_rank} outside TP {tp} / ETP {etp}")
    out = {}
    for name, tensor in state.items():
        kind = split_kind(name)
        rank, size = (etp_rank, etp) if _is_expert(name) else (tp_rank, tp)
        rows = _section_rows(name, kind, tensor.shape[0], sections)
        _check_divides(name, tensor, kind, size, rows)
        out[name] = _cut(tensor, kind, rank, size, padded_vocab_size(vocab_size, tp), rows)
    return out


def tp_gather(shards: Sequence[dict[str, torch.Tensor]], *, tp_rank: int, etp: int = 1, vocab_size: int,
              sections: Optional[Mapping[str, Sequence[int]]] = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tp_shard`, as TP rank ``tp_rank`` of the group sees it: ``shards[r]`` is TP rank r's
    state. The dense tensors join over every rank; a routed expert's over ``tp_rank``'s expert-tensor-parallel
    group only, the ``etp`` ranks ``(tp_rank // etp) * etp ..`` (ranks number ETP fastest, then EP, and ETP
    divides TP): with expert parallelism the other TP ranks hold other experts under the same local names."""
    first = (tp_rank // etp) * etp
    out = {}
    for name in shards[0]:
        kind = split_kind(name)
        parts = [s[name] for s in (shards[first:first + etp] if _is_expert(name) else shards)]
        out[name] = _join(parts, kind, vocab_size, _section_rows(name, kind, parts[0].shape[0] * len(parts), sections))
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
