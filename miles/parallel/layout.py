"""The parallel layout ``miles train`` builds and ``miles plan`` sizes: Megatron's rules, as arithmetic.

    layout = ParallelLayout(world=32, tp=8, pp=4, ep=8, etp=1, first_stage_layers=22, last_stage_layers=18)
    check_layout(layout, num_layers=78, num_attention_heads=64, num_query_groups=64, num_experts=256)
    rank_coordinates(layout)[r]       # (tp, pp, dp, ep, etp, edp) of global rank r
    stage_layers(78, layout)          # (range(0, 22), range(22, 41), range(41, 60), range(60, 78))

Facts from megatron-core 0.19.2 (``parallel_state.initialize_model_parallel``, ``RankGenerator``,
``transformer_block.get_num_layers_to_build``, ``ModelParallelConfig``/``TransformerConfig``):

- world = TP x PP x DP (no context parallelism here). Ranks are numbered in the order "tp-cp-ep-dp-pp",
  TP fastest: ``rank = tp + TP * (dp + DP * pp)``. The expert layers cut the same ranks as
  "etp-ep-edp-pp": ``rank = etp + ETP * (ep + EP * (edp + EDP * pp))``, with expert-DP
  ``EDP = world / (ETP x EP x PP)``; so EP x ETP must divide TP x DP (the ranks of one stage), and a
  rank's pipeline stage is the same in both views.
- Decoder layers: without uneven-stage counts, ``num_layers / PP`` per stage (it must divide). With
  ``--decoder-first-pipeline-num-layers`` and/or ``--decoder-last-pipeline-num-layers``, those stages
  take the counts given and the other stages split the rest evenly (it must divide).
- Attention heads and query groups split over TP (Megatron also replicates KV heads when TP is a
  multiple of the groups; the weight conversion here does not, so groups must divide by TP); so do a Gated
  DeltaNet's key and value heads (Qwen3.5).
- Sequence parallelism needs TP > 1. A MoE layer trains under TP > 1 only with sequence parallelism
  (``MoELayer.forward`` raises otherwise: its token dispatch expects the sequence split over TP).
- DeepSeek sparse attention (GLM-5) with index sharing: a layer whose indexer is shared reuses the top-k
  indices of the layer before it in the same stage, so every pipeline stage starts on a layer that computes
  its own (the DSA module raises otherwise, at the first forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["ParallelLayout", "RankCoordinates", "LayoutError", "check_layout", "rank_coordinates",
           "stage_layer_counts", "stage_layers", "rank_slices", "DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE",
           "TP_FLAG", "PP_FLAG", "EP_FLAG", "ETP_FLAG", "SP_FLAG", "FIRST_STAGE_FLAG", "LAST_STAGE_FLAG",
           "WORLD_FLAG"]

# Megatron's flag names (one spelling each; `miles train` and `miles plan` accept them)
TP_FLAG = "--tensor-model-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"
EP_FLAG = "--expert-model-parallel-size"
ETP_FLAG = "--expert-tensor-parallel-size"
SP_FLAG = "--sequence-parallel"
FIRST_STAGE_FLAG = "--decoder-first-pipeline-num-layers"
LAST_STAGE_FLAG = "--decoder-last-pipeline-num-layers"
WORLD_FLAG = "--num-train-ranks"

# Megatron-core's ModelParallelConfig defaults ETP to TP; MoE recipes (and the reference runs: GLM-5 at TP8 x
# EP8 on 32 GPUs cannot have ETP 8) set 1, which is miles' default for `miles train` and `miles plan` alike.
DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE = 1


class LayoutError(ValueError):
    """A layout Megatron would not build: ``problem`` (with the values), ``flags`` involved, ``fix``."""

    def __init__(self, problem: str, flags: tuple[str, ...], fix: str):
        super().__init__(f"{problem} Fix: {fix}")
        self.problem, self.flags, self.fix = problem, flags, fix


@dataclass(frozen=True)
class ParallelLayout:
    """World size and the parallel sizes (Megatron's names in the fields' docs); DP and expert-DP derive."""

    world: int
    tp: int = 1  # --tensor-model-parallel-size
    pp: int = 1  # --pipeline-model-parallel-size
    ep: int = 1  # --expert-model-parallel-size
    etp: int = DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE  # --expert-tensor-parallel-size
    first_stage_layers: Optional[int] = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: Optional[int] = None  # --decoder-last-pipeline-num-layers

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def describe(self) -> str:
        """``TP8 x PP4 x DP1, EP8 x ETP1 x EDP4`` (what the launchers and logs print)."""
        return (f"TP{self.tp} x PP{self.pp} x DP{self.dp}, EP{self.ep} x ETP{self.etp} x EDP{self.edp}")


@dataclass(frozen=True)
class RankCoordinates:
    """Where global ``rank`` sits: dense view (tp, pp, dp) and expert view (etp, ep, edp; same pp)."""

    rank: int
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    edp: int


def _check_sizes(layout: ParallelLayout) -> None:
    for value, flag in ((layout.world, WORLD_FLAG), (layout.tp, TP_FLAG), (layout.pp, PP_FLAG), (layout.ep, EP_FLAG),
                        (layout.etp, ETP_FLAG)):
        if value < 1:
            raise LayoutError(f"{flag} must be >= 1 (got {value}).", (flag,), f"pass {flag} 1 or more.")
    model = layout.tp * layout.pp
    if layout.world % model:
        raise LayoutError(
            f"{WORLD_FLAG} {layout.world} is not a multiple of {TP_FLAG} {layout.tp} x {PP_FLAG} {layout.pp} = "
            f"{model}: Megatron's world is TP x PP x DP.", (WORLD_FLAG, TP_FLAG, PP_FLAG),
            f"pass {WORLD_FLAG} as a multiple of {model} (TP x PP x DP), or change {TP_FLAG}/{PP_FLAG}.")
    expert = layout.ep * layout.etp
    stage = layout.world // layout.pp
    if stage % expert:
        raise LayoutError(
            f"{EP_FLAG} {layout.ep} x {ETP_FLAG} {layout.etp} = {expert} does not divide the {stage} ranks of one "
            f"pipeline stage (TP {layout.tp} x DP {layout.dp}): Megatron cuts each stage's ranks into ETP x EP x "
            "expert-DP.", (EP_FLAG, ETP_FLAG, TP_FLAG, WORLD_FLAG),
            f"pick {EP_FLAG} and {ETP_FLAG} whose product divides {stage}.")


def _check_stage_flags(layout: ParallelLayout) -> None:
    for value, flag in ((layout.first_stage_layers, FIRST_STAGE_FLAG), (layout.last_stage_layers, LAST_STAGE_FLAG)):
        if value is None:
            continue
        if layout.pp < 2:
            raise LayoutError(f"{flag} {value} needs pipeline parallelism ({PP_FLAG} is {layout.pp}).",
                              (flag, PP_FLAG), f"drop {flag}, or pass {PP_FLAG} 2 or more.")
        if value < 1:
            raise LayoutError(f"{flag} must be >= 1 (got {value}): every stage holds a decoder layer here.",
                              (flag,), f"pass {flag} 1 or more.")


def stage_layer_counts(num_layers: int, layout: ParallelLayout) -> tuple[int, ...]:
    """Decoder layers of each pipeline stage, as Megatron builds them (LayoutError when it would not)."""
    _check_stage_flags(layout)
    first, last, pp = layout.first_stage_layers, layout.last_stage_layers, layout.pp
    fixed = (first or 0) + (last or 0)
    rest_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - fixed
    given = [f for f, v in ((FIRST_STAGE_FLAG, first), (LAST_STAGE_FLAG, last)) if v is not None]
    if rest < 0 or (rest_stages == 0 and rest) or (rest_stages and (rest % rest_stages or rest == 0)):
        if not given:
            raise LayoutError(
                f"the model's {num_layers} decoder layers do not split evenly over {PP_FLAG} {pp} stages.",
                (PP_FLAG, FIRST_STAGE_FLAG, LAST_STAGE_FLAG),
                f"pass {FIRST_STAGE_FLAG} and/or {LAST_STAGE_FLAG} so that the other stages split the rest "
                f"evenly (e.g. {_uneven_example(num_layers, pp)}), or a {PP_FLAG} that divides {num_layers}.")
        spelled = " + ".join(f"{flag} {v}" for flag, v in ((FIRST_STAGE_FLAG, first), (LAST_STAGE_FLAG, last))
                             if v is not None)
        raise LayoutError(
            f"{spelled} leave {rest} of the model's {num_layers} decoder layers for the other {rest_stages} of "
            f"{PP_FLAG} {pp} stages, which must split them evenly (at least one each).",
            (*given, PP_FLAG), f"choose counts that leave a positive multiple of {rest_stages} layers"
            if rest_stages else f"make the counts add up to {num_layers}")
    middle = rest // rest_stages if rest_stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _uneven_example(num_layers: int, pp: int) -> str:
    """Flags that make ``num_layers`` buildable over ``pp`` stages: first/last take the remainder."""
    if pp == 2:
        return f"{FIRST_STAGE_FLAG} {num_layers - num_layers // 2}"
    middle = num_layers // pp
    rest = num_layers - middle * (pp - 2)
    return f"{FIRST_STAGE_FLAG} {rest - rest // 2} {LAST_STAGE_FLAG} {rest // 2}"


def stage_layers(num_layers: int, layout: ParallelLayout) -> tuple[range, ...]:
    """Global decoder-layer indices of each stage (contiguous, in stage order)."""
    ranges, start = [], 0
    for count in stage_layer_counts(num_layers, layout):
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def rank_coordinates(layout: ParallelLayout) -> tuple[RankCoordinates, ...]:
    """Every global rank's coordinates, in Megatron's default order (module doc)."""
    _check_sizes(layout)
    per_stage, expert_block = layout.world // layout.pp, layout.etp * layout.ep
    out = []
    for rank in range(layout.world):
        pp, in_stage = divmod(rank, per_stage)
        dp, tp = divmod(in_stage, layout.tp)
        edp, in_block = divmod(in_stage, expert_block)
        ep, etp = divmod(in_block, layout.etp)
        out.append(RankCoordinates(rank=rank, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, edp=edp))
    return tuple(out)


def check_layout(layout: ParallelLayout, *, num_layers: Optional[int] = None,
                 num_attention_heads: Optional[int] = None, num_query_groups: Optional[int] = None,
                 num_experts: Optional[int] = None, sequence_parallel: Optional[bool] = False,
                 indexer_layers: Optional[Sequence[bool]] = None, linear_key_heads: Optional[int] = None,
                 linear_value_heads: Optional[int] = None) -> None:
    """Raise :class:`LayoutError` for the first rule of the module doc the layout breaks for this model
    (a model size given as None is not checked: e.g. before the model's config is known; ``num_experts`` 0:
    a dense model, whose expert-parallel groups Megatron builds and leaves unused; ``sequence_parallel`` None:
    not known, as in ``miles plan``, which sizes memory and takes no training flags; ``indexer_layers``: per
    decoder layer, whether it computes its own sparse-attention indexer, None for a model without DSA;
    ``linear_key_heads`` / ``linear_value_heads``: a Gated DeltaNet's (Qwen3.5), None for a model without)."""
    _check_sizes(layout)
    _check_stage_flags(layout)
    if sequence_parallel and layout.tp < 2:
        raise LayoutError(f"{SP_FLAG} splits activations over tensor parallelism, and {TP_FLAG} is {layout.tp}.",
                          (SP_FLAG, TP_FLAG), f"drop {SP_FLAG}, or pass {TP_FLAG} 2 or more.")
    for count, what in ((num_attention_heads, "attention heads"), (num_query_groups, "query groups (KV heads)"),
                        (linear_key_heads, "Gated DeltaNet key heads"),
                        (linear_value_heads, "Gated DeltaNet value heads")):
        if count is not None and count % layout.tp:
            raise LayoutError(f"the model's {count} {what} do not split over {TP_FLAG} {layout.tp}.", (TP_FLAG,),
                              f"pass a {TP_FLAG} that divides {count}.")
    if num_experts and layout.tp > 1 and sequence_parallel is False:
        raise LayoutError(f"the model has {num_experts} experts per MoE layer, and Megatron trains MoE layers under "
                          f"{TP_FLAG} {layout.tp} only with sequence parallelism.", (TP_FLAG, SP_FLAG),
                          f"add {SP_FLAG}, or pass {TP_FLAG} 1 (expert parallelism, {EP_FLAG}, splits the experts).")
    if num_experts and num_experts % layout.ep:
        raise LayoutError(f"the model's {num_experts} experts do not split over {EP_FLAG} {layout.ep}.", (EP_FLAG,),
                          f"pass an {EP_FLAG} that divides {num_experts}.")
    if num_layers is not None:
        stage_layer_counts(num_layers, layout)
    if num_layers is not None and indexer_layers is not None and layout.pp > 1:
        for stage, layers in enumerate(stage_layers(num_layers, layout)):
            if not indexer_layers[layers.start]:
                starts = [i for i in range(1, num_layers) if indexer_layers[i]]
                raise LayoutError(
                    f"pipeline stage {stage} starts at decoder layer {layers.start}, whose sparse-attention indexer "
                    "is shared (it reuses the previous layer's top-k, and megatron shares them within a stage "
                    "only).", (PP_FLAG, FIRST_STAGE_FLAG, LAST_STAGE_FLAG),
                    f"choose stage sizes so that every stage starts on a layer with its own indexer: one of "
                    f"{_listed(starts)} ({FIRST_STAGE_FLAG} / {LAST_STAGE_FLAG} set the first and last stage's).")


def _listed(values: list[int], most: int = 12) -> str:
    return ", ".join(map(str, values[:most])) + (" ..." if len(values) > most else "")


def rank_slices(count: int, layout: ParallelLayout) -> list[slice]:
    """Each global rank's slice of ``count`` samples: split over data parallelism (the first ``count % DP``
    replicas one more), the same slice for every TP/PP rank of a replica (they compute one model together)."""
    per, extra = divmod(count, layout.dp)
    starts = [r * per + min(r, extra) for r in range(layout.dp + 1)]
    return [slice(starts[c.dp], starts[c.dp + 1]) for c in rank_coordinates(layout)]
