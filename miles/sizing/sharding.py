"""Which parameter elements one training rank holds, and which of them its optimizer shards own.

Megatron's rules, as modelled here (the layout itself is miles/parallel/layout.py's, `miles train`'s):
  * world = TP x PP x DP (context parallelism is not modelled); decoder layers are cut into PP
    contiguous stages (evenly, or with Megatron's uneven first/last stage counts), the embedding on the
    first, final norm / output layer / MTP on the last;
  * dense tensors: split over TP (or replicated), and the distributed optimizer shards their state
    over DP: a rank owns a contiguous 1/DP of the stage's dense buffer;
  * routed experts: EP ranks hold experts/EP whole experts each, split over ETP, and the expert
    optimizer shards their state over expert-DP, edp = world / (PP x EP x ETP);
  * dense and expert parts are two optimizers (Megatron chains them), hence two stores per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from miles.parallel.layout import (DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE, FIRST_STAGE_FLAG, LAST_STAGE_FLAG,
                                   ParallelLayout, check_layout)
from miles.parallel.layout import LayoutError as ParallelLayoutError
from miles.parallel.layout import stage_layer_counts as layout_stage_layer_counts

from .bounds import PARALLEL_SIZE, PIPELINE_SIZE, STAGE_LAYERS, PlanInputError, check_bound, check_bounds
from .tensors import ModelTensors, Tensor

DEFAULT_ETP = DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE  # `miles train`'s default too (miles/parallel/layout.py says why)


class LayoutError(PlanInputError):
    """A parallel layout that Megatron would not build; the message names the sizes and what to change."""


@dataclass(frozen=True)
class Parallelism:
    """The plan's layout: `miles train`'s :class:`~miles.parallel.layout.ParallelLayout` with DP given instead of
    the world size (``layout()`` is the one `miles train` builds for these sizes)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = DEFAULT_ETP
    first_stage_layers: Optional[int] = None  # --decoder-first-pipeline-num-layers; None: an even split
    last_stage_layers: Optional[int] = None  # --decoder-last-pipeline-num-layers

    def __post_init__(self) -> None:
        check_bounds(LayoutError, vars(self), {"tp": PARALLEL_SIZE, "pp": PIPELINE_SIZE, "dp": PARALLEL_SIZE,
                                                "ep": PARALLEL_SIZE, "etp": PARALLEL_SIZE})
        for flag, layers in ((FIRST_STAGE_FLAG, self.first_stage_layers), (LAST_STAGE_FLAG, self.last_stage_layers)):
            if layers is not None:
                check_bound(LayoutError, flag, layers, STAGE_LAYERS)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.world // (self.pp * self.ep * self.etp)

    def layout(self) -> ParallelLayout:
        return ParallelLayout(world=self.world, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp,
                              first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers)


def check_parallelism(par: Parallelism, model: ModelTensors, experts: int) -> None:
    """Megatron's layout rules (miles/parallel/layout.py, the same check `miles train` runs), then the plan's
    own: expert parallelism on a model without experts sizes nothing."""
    try:
        check_layout(par.layout(), num_layers=len(model.layers), num_experts=experts, sequence_parallel=None)
    except ParallelLayoutError as e:
        raise LayoutError(str(e)) from None
    if not experts and par.ep > 1:
        raise LayoutError(f"--ep {par.ep} needs a MoE model; {model.name} has no routed experts (use --ep 1)")


def stage_layer_counts(n_layers: int, par: Parallelism) -> list[int]:
    """Decoder layers per stage, as Megatron builds them (miles/parallel/layout.py)."""
    try:
        return list(layout_stage_layer_counts(n_layers, par.layout()))
    except ParallelLayoutError as e:
        raise LayoutError(str(e)) from None


def stage_tensors(model: ModelTensors, par: Parallelism) -> list[list[Tensor]]:
    counts, stages, start = stage_layer_counts(len(model.layers), par), [], 0
    for s, count in enumerate(counts):
        tensors = list(model.first) if s == 0 else []
        for layer in model.layers[start:start + count]:
            tensors += layer
        if s == par.pp - 1:
            tensors += model.last
        stages.append(tensors)
        start += count
    return stages


def _split(numel: int, parts: int) -> int:
    return -(-numel // parts)


@dataclass(frozen=True)
class RankShard:
    """One rank of one pipeline stage (data-parallel rank 0, expert-parallel rank 0).

    *_local: element counts of the tensors the rank holds (weights and grads live at this size);
    *_entries: the elements its optimizer owns, one entry per (piece of a) tensor, in buffer order:
    what a store on this rank plans its buckets over."""

    stage: int
    dense_local: tuple[int, ...]
    expert_local: tuple[int, ...]
    dense_entries: tuple[int, ...]
    expert_entries: tuple[int, ...]

    @property
    def local_params(self) -> int:
        return sum(self.dense_local) + sum(self.expert_local)

    @property
    def owned_params(self) -> int:
        return sum(self.dense_entries) + sum(self.expert_entries)


def owned_slice(numels: list[int], parts: int) -> list[int]:
    """Entries of the first contiguous 1/parts of a buffer made of `numels` (the distributed optimizer's
    shard of data-parallel rank 0; the other ranks' shards differ by at most one element per rank)."""
    size = _split(sum(numels), parts)
    out, used = [], 0
    for n in numels:
        if used >= size:
            break
        take = min(n, size - used)
        out.append(take)
        used += take
    return out


def rank_shards(model: ModelTensors, par: Parallelism) -> list[RankShard]:
    """One RankShard per pipeline stage."""
    shards = []
    for s, tensors in enumerate(stage_tensors(model, par)):
        dense = [_split(t.numel, par.tp) if t.tp_split else t.numel for t in tensors if t.expert is None]
        experts = {t.expert for t in tensors if t.expert is not None}
        per_ep_rank = len(experts) // par.ep if experts else 0
        mine = set(sorted(experts)[:per_ep_rank])  # EP rank 0's experts of every layer
        expert = [_split(t.numel, par.etp) for t in tensors if t.expert in mine]
        shards.append(RankShard(s, tuple(dense), tuple(expert), tuple(owned_slice(dense, par.dp)),
                                tuple(owned_slice(expert, par.edp))))
    return shards
