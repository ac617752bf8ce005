"""Tensor parallelism in the megatron trainer: what one rank of a TP group does differently from TP 1.

``ModelParallelRank.of(config)`` after ``parallel_state.initialize_model_parallel`` (``initialize``) gives:

- ``shard(full_mcore)``: this rank's stage and TP/ETP shard of the full Megatron state (tp_shards.py), loaded
  into the GPTModel built with the padded vocabulary (``padded_vocab_size``);
- ``logprobs(logits, targets, temperature)``: the target log-probs from this rank's vocabulary slice of the
  logits (vocab_parallel.py: three all-reduces over the TP group, no gathered fp32 logits);
- ``iter_hf(local, ...)``: the full HF tensors for the weight handoff and checkpoints, gathered part by part
  over the TP group (parallel_export.py), with ``broadcast_gather``: TP rank r broadcasts its piece in turn,
  which NCCL and gloo (CUDA tensors: all-reduce and broadcast only) both carry.

Under pipeline parallelism each stage holds its layers; ``iter_hf`` hands every part from the stage holding it
to the other stages (``broadcast_share``), so every rank feeds its engine the whole model, and pipeline.py runs
Megatron's schedule. Checked with the ranks sharing one GPU (tests/gpu/test_parallel_megatron_gpu.py), not yet
across GPUs: validation asks for --experimental-model-parallel to train TP/PP > 1
(miles/preflight/parallel_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from miles.parallel.layout import ParallelLayout, stage_layers

from .architecture import Architecture
from .parallel_export import PipelineShare, TensorParallelGather, iter_model_hf, iter_stage_hf
from .tp_shards import padded_vocab_size, pp_stage, tp_shard
from .vocab_parallel import vocab_parallel_logprobs

__all__ = ["ModelParallelRank", "initialize", "broadcast_gather", "broadcast_share", "pad_sequence"]


def initialize(layout: ParallelLayout) -> None:
    """Megatron's process groups for ``layout`` (once per process; the world is already joined)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():  # one trainer per process, or tests' sequence
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)


def pad_sequence(input_ids: torch.Tensor, position_ids: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L]`` token and position ids right-padded (with 0) to a length that divides by ``multiple``: what
    sequence parallelism needs (the embedding's output is reduce-scattered over TP along the sequence).
    Causal attention: the padding changes no earlier position; the caller cuts the outputs back to ``L``."""
    pad = (-input_ids.shape[1]) % multiple
    if not pad:
        return input_ids, position_ids
    return (torch.nn.functional.pad(input_ids, (0, pad), value=0),
            torch.nn.functional.pad(position_ids, (0, pad), value=0))


def broadcast_gather(group, group_ranks: list[int]) -> TensorParallelGather:
    """The TP all-gather of parallel_export as one broadcast per rank and tensor (names sorted: the same
    order on every rank; shapes are equal across a TP group for every tensor of a part)."""
    def gather(mine: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        me = dist.get_rank()
        out = [{} for _ in group_ranks]
        for name in sorted(mine):
            for i, src in enumerate(group_ranks):
                buf = mine[name].contiguous() if src == me else torch.empty_like(mine[name])
                dist.broadcast(buf, src=src, group=group)
                out[i][name] = buf
        return out

    return gather


def broadcast_share(group, group_ranks: list[int], device: torch.device) -> PipelineShare:
    """The pipeline hand-over of parallel_export.iter_model_hf: the owner stage's rank broadcasts the names,
    shapes and dtypes of one part's tensors, then each tensor, to the ranks of its pipeline group."""
    def share(owner: int, items):
        src = group_ranks[owner]
        header = [[(name, tuple(t.shape), t.dtype) for name, t in items] if items is not None else None]
        dist.broadcast_object_list(header, src=src, group=group)
        own = [t for _, t in items] if items is not None else [None] * len(header[0])
        out = []
        for (name, shape, dtype), tensor in zip(header[0], own):
            buf = tensor.contiguous() if tensor is not None else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(buf, src=src, group=group)
            out.append((name, buf))
        return out

    return share


@dataclass(frozen=True)
class ModelParallelRank:
    """This process's place in the layout, read from megatron's parallel_state."""

    layout: ParallelLayout
    tp_rank: int
    pp_rank: int
    etp_rank: int
    vocab_size: int  # the HF vocabulary
    tp_group: Any
    tp_ranks: tuple[int, ...]
    pp_group: Any
    pp_ranks: tuple[int, ...]

    @classmethod
    def of(cls, layout: ParallelLayout, vocab_size: int) -> "ModelParallelRank":
        from megatron.core import parallel_state as ps

        return cls(layout=layout, tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(),
                   etp_rank=ps.get_expert_tensor_parallel_rank(), vocab_size=vocab_size,
                   tp_group=ps.get_tensor_model_parallel_group(),
                   tp_ranks=tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
                   pp_group=ps.get_pipeline_model_parallel_group(),
                   pp_ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())))

    @property
    def sharded(self) -> bool:
        return self.layout.tp * self.layout.pp > 1

    @property
    def padded_vocab(self) -> int:
        return padded_vocab_size(self.vocab_size, self.layout.tp)

    def stages(self, num_layers: int) -> tuple[range, ...]:
        return stage_layers(num_layers, self.layout)

    def shard(self, full: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
        """This rank's tensors of the full Megatron state (experts already this EP rank's)."""
        staged = pp_stage(full, self.stages(arch.num_layers), self.pp_rank, tied_embeddings=arch.tied_embeddings)
        return tp_shard(staged, tp_rank=self.tp_rank, tp=self.layout.tp, etp_rank=self.etp_rank, etp=self.layout.etp,
                        vocab_size=self.vocab_size, rules=arch.tp_rules)

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """Target log-probs from this rank's vocabulary slice ``logits [B, T, V_local]`` (fp32)."""
        x = logits.float()
        if temperature and temperature != 1.0:
            x = x / temperature
        width = x.shape[-1]
        return vocab_parallel_logprobs(x, targets.long(), vocab_start=self.tp_rank * width,
                                       vocab_size=self.vocab_size, group=self.tp_group)

    def iter_hf(self, local: dict[str, torch.Tensor], hf_config, *, fused_norms: bool,
                hf_moe_layout: Optional[str], layer_experts=None) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model in HF tensors on every rank (a collective of the TP and PP groups)."""
        common = dict(stage=self.pp_rank, stages=self.stages(hf_config.num_hidden_layers), hf_config=hf_config,
                      gather=broadcast_gather(self.tp_group, list(self.tp_ranks)), tp_rank=self.tp_rank,
                      etp=self.layout.etp, fused_norms=fused_norms, hf_moe_layout=hf_moe_layout,
                      layer_experts=layer_experts)
        if self.layout.pp == 1:
            return iter_stage_hf(local, **common)
        device = next(iter(local.values())).device
        return iter_model_hf(local, share=broadcast_share(self.pp_group, list(self.pp_ranks), device), **common)
