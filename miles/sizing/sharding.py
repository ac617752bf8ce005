"""Which parameter elements one training rank holds, and which of them its optimizer shards own.

Megatron's rules, as modelled here:
  * world = TP x PP x DP (context parallelism is not modelled); decoder layers are cut into PP
    contiguous stages, the embedding on the first, final norm / output layer / MTP on the last;
  * dense tensors: split over TP (or replicated), and the distributed optimizer shards their state
    over DP: a rank owns a contiguous 1/DP of the stage's dense buffer;
  * routed experts: EP ranks hold experts/EP whole experts each, split over ETP, and the expert
    optimizer shards their state over expert-DP, edp = world / (PP x EP x ETP);
  * dense and expert parts are two optimizers (Megatron chains them), hence two stores per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .bounds import PARALLEL_SIZE, PIPELINE_SIZE, STAGE_LAYERS, PlanInputError, check_bound, check_bounds
from .model_params import ModelTensors, Tensor

DEFAULT_ETP = 1  # Megatron's own default is ETP = TP; MoE recipes (and the reference runs) set 1


class LayoutError(PlanInputError):
    """A parallel layout that Megatron would not build; the message names the sizes and what to change."""


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = DEFAULT_ETP
    pipeline_layers: Optional[tuple[int, ...]] = None  # decoder layers per stage; None: as even as possible

    def __post_init__(self) -> None:
        check_bounds(LayoutError, vars(self), {"tp": PARALLEL_SIZE, "pp": PIPELINE_SIZE, "dp": PARALLEL_SIZE,
                                                "ep": PARALLEL_SIZE, "etp": PARALLEL_SIZE})
        if self.pipeline_layers is not None:
            if len(self.pipeline_layers) != self.pp:
                raise LayoutError(f"--pipeline-layers lists {len(self.pipeline_layers)} stages but --pp is {self.pp}: "
                                  "give one layer count per pipeline stage")
            for layers in self.pipeline_layers:
                check_bound(LayoutError, "--pipeline-layers: a stage of", layers, STAGE_LAYERS)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.world // (self.pp * self.ep * self.etp)


def check_parallelism(par: Parallelism, model: ModelTensors, experts: int) -> None:
    per_stage = par.world // par.pp
    if per_stage % (par.ep * par.etp):
        raise LayoutError(f"EP x ETP = {par.ep} x {par.etp} must divide TP x DP = {per_stage} (the GPUs of one "
                          "pipeline stage): choose --ep/--etp that divide it")
    if experts and experts % par.ep:
        raise LayoutError(f"--ep {par.ep} must divide the model's {experts} experts")
    if not experts and par.ep > 1:
        raise LayoutError(f"--ep {par.ep} needs a MoE model; {model.name} has no routed experts (use --ep 1)")
    if par.pipeline_layers is not None:
        if sum(par.pipeline_layers) != len(model.layers):
            raise LayoutError(f"--pipeline-layers sum to {sum(par.pipeline_layers)} layers, but the model has "
                              f"{len(model.layers)}: give layer counts per stage that add up to it")
    elif par.pp > max(len(model.layers), 1):
        raise LayoutError(f"--pp {par.pp} exceeds the model's {len(model.layers)} layers")


def stage_layer_counts(n_layers: int, par: Parallelism) -> list[int]:
    """Decoder layers per stage: --pipeline-layers, or an even split whose first stages take the remainder."""
    if par.pipeline_layers is not None:
        return list(par.pipeline_layers)
    base, extra = divmod(n_layers, par.pp)
    return [base + (1 if s < extra else 0) for s in range(par.pp)]


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
