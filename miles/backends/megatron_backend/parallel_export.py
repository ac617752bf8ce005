"""The weight handoff under tensor and pipeline parallelism: a rank's stage-local shards -> full HF tensors.

Every rank of pipeline stage ``s`` runs :func:`iter_stage_hf` over its own shards (:func:`iter_model_hf`: and
receives the other stages' parts over the pipeline group, so that it can feed its engine the whole model); the
parts of the model come out in the engines' order (stage by stage: the embedding, the stage's decoder layers,
then the head on the last stage), each part gathered over the tensor-parallel group just before it is converted, so a rank holds at most
one part's gathered tensors beyond its own shards (the caller drops what it has sent)::

    for hf_name, tensor in iter_stage_hf(local_state, stage=s, stages=stages, hf_config=cfg,
                                         gather=all_gather_over_tp, tp_rank=1, etp=1):
        bucket.add(hf_name, tensor)

``gather(part_state)`` is the collective (an all-gather over the TP group, on the device): it takes this
rank's tensors of one part and returns every TP rank's tensors of the same names, in TP-rank order. Injected,
so the order and the arithmetic are tested on fake shards without a process group. Expert parallelism's
gather of a MoE layer's experts is ``layer_experts``, as in :func:`~.convert.iter_megatron_to_hf`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from .families import describe
from .convert import EMBEDDING, HEAD, LayerExperts, part_to_hf
from .tp_shards import tp_gather

__all__ = ["iter_stage_hf", "iter_model_hf", "stage_parts", "TensorParallelGather", "PipelineShare"]

TensorParallelGather = Callable[[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]
_EMBEDDING_KEY = "embedding.word_embeddings.weight"
_HEAD_KEYS = ("decoder.final_layernorm.weight", "output_layer.weight")


def stage_parts(stage: int, stages: Sequence[range]) -> list:
    """The parts stage ``stage`` sends, in order: EMBEDDING (first stage), its global layer numbers, HEAD (last)."""
    return ([EMBEDDING] if stage == 0 else []) + list(stages[stage]) + ([HEAD] if stage == len(stages) - 1 else [])


def _local_part(local: dict[str, torch.Tensor], part, layers: range) -> dict[str, torch.Tensor]:
    """This rank's tensors of ``part``, named as the full model names them (global layer numbers)."""
    if part == EMBEDDING:
        return {_EMBEDDING_KEY: local[_EMBEDDING_KEY]}
    if part == HEAD:
        return {k: local[k] for k in _HEAD_KEYS if k in local}
    prefix, full = f"decoder.layers.{part - layers.start}.", f"decoder.layers.{part}."
    return {full + k[len(prefix):]: v for k, v in local.items() if k.startswith(prefix)}


def _part_hf(local: dict[str, torch.Tensor], part, *, stage: int, stages: Sequence[range], hf_config,
             gather: TensorParallelGather, tp_rank: int, etp: int, fused_norms: bool, hf_moe_layout: Optional[str],
             layer_experts: Optional[LayerExperts]) -> list[tuple[str, torch.Tensor]]:
    """One part of stage ``stage``, gathered over TP and converted: its ``(hf_name, tensor)`` pairs (the routed
    experts this rank's expert-parallel rank holds, before ``layer_experts`` gathers them over EP)."""
    arch = describe(hf_config)
    full = tp_gather(gather(_local_part(local, part, stages[stage])), tp_rank=tp_rank, etp=etp,
                     vocab_size=arch.vocab_size, rules=arch.tp_rules)
    if layer_experts is not None and isinstance(part, int) and arch.is_moe_layer(part):
        prefix = f"decoder.layers.{part}.mlp.experts."  # the routed experts, per expert or grouped
        experts = {k: v for k, v in full.items() if k.startswith(prefix)}
        full = {**{k: v for k, v in full.items() if not k.startswith(prefix)}, **layer_experts(part, experts)}
    tied_copy = full.pop("output_layer.weight", None) if arch.tied_embeddings and part == HEAD else None
    items = list(part_to_hf(part, full, hf_config, fused_norms=fused_norms, hf_moe_layout=hf_moe_layout).items())
    if arch.tied_embeddings and part == EMBEDDING and len(stages) == 1:
        items.append(("lm_head.weight", full[_EMBEDDING_KEY]))
    if tied_copy is not None:
        items.append(("lm_head.weight", tied_copy))
    return items


def iter_stage_hf(local: dict[str, torch.Tensor], *, stage: int, stages: Sequence[range], hf_config,
                  gather: TensorParallelGather, tp_rank: int, etp: int = 1, fused_norms: bool = False,
                  hf_moe_layout: Optional[str] = None,
                  layer_experts: Optional[LayerExperts] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The full HF tensors of stage ``stage``, part by part (module doc). A tied output layer is sent as
    ``lm_head.weight`` next to the embedding at PP 1, and from the last stage's copy at PP > 1."""
    for part in stage_parts(stage, stages):
        yield from _part_hf(local, part, stage=stage, stages=stages, hf_config=hf_config, gather=gather,
                            tp_rank=tp_rank, etp=etp, fused_norms=fused_norms, hf_moe_layout=hf_moe_layout,
                            layer_experts=layer_experts)


PipelineShare = Callable[[int, Optional[list]], list]


def iter_model_hf(local: dict[str, torch.Tensor], *, stage: int, stages: Sequence[range], hf_config,
                  gather: TensorParallelGather, share: PipelineShare, tp_rank: int, etp: int = 1,
                  fused_norms: bool = False,
                  hf_moe_layout: Optional[str] = None,
                  layer_experts: Optional[LayerExperts] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every part of the model on every stage's ranks, in the engines' order: the stage holding a part gathers
    and converts it, and ``share(owner_stage, items)`` hands its ``(hf_name, tensor)`` pairs over the pipeline
    group (the owner passes its items, the others None and receive them; a collective). So each rank's
    engine gets the whole model, one part's tensors at a time."""
    for owner in range(len(stages)):
        for part in stage_parts(owner, stages):
            items = (_part_hf(local, part, stage=stage, stages=stages, hf_config=hf_config, gather=gather,
                              tp_rank=tp_rank, etp=etp, fused_norms=fused_norms, hf_moe_layout=hf_moe_layout,
                              layer_experts=layer_experts)
                     if owner == stage else None)
            yield from share(owner, items)
