"""The grouped experts' modules (``grouped_experts.py`` says their layout; megatron-core imported inside).

megatron-core 0.19.2 runs experts grouped in ``TEGroupedMLP``, which takes its two projections from the spec as
builders (``GroupedLinearFc1Builder``: ``(num_local_experts, input_size, output_size, *, config, init_method,
...)`` -> a module whose ``forward(permuted_tokens, tokens_per_expert)`` returns ``(output, bias)``); its own are
Transformer Engine's. :class:`ColumnParallelGroupedLinear` and :class:`RowParallelGroupedLinear` are those builders
without Transformer Engine: one ``[E_local, out, in]`` weight each and one ``torch.nn.functional.grouped_mm`` over the tokens of
every local expert (CUDA: CUTLASS's grouped GEMM for bf16 on sm90/sm100, torch's per-group fallback otherwise; CPU:
fp32 and bf16). :func:`with_grouped_experts` puts them in a block spec.

Expert-tensor parallelism: the token dispatcher gathers and scatters the tokens over the ETP group (megatron's
explicit expert communication), so these linears only hold this rank's part of each expert (fc1's output rows,
fc2's input columns) and never communicate, as TE's grouped linears then do.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Optional

import torch

__all__ = ["ColumnParallelGroupedLinear", "RowParallelGroupedLinear", "with_grouped_experts"]

_GROUPED_MM_ALIGN_BYTES = 16  # torch.nn.functional.grouped_mm: every operand's row stride a multiple of 16 bytes


class _GroupedLinear(torch.nn.Module):
    """One projection of every local expert: ``weight[e]`` is expert e's ``[out, in]`` (this ETP rank's part),
    expert e's tokens the ``tokens_per_expert[e]`` rows after expert e-1's."""

    partition_axis: int  # the weight's axis split over ETP: 1, each expert's output rows; 2, its input columns

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config: Any,
                 init_method: Callable[[torch.Tensor], None], bias: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str], pg_collection: Any, name: Optional[str] = None):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

        super().__init__()
        if bias or not is_expert:
            raise ValueError(f"{name}: grouped experts are routed experts without biases (got bias={bias}, "
                             f"is_expert={is_expert}); build this model's experts as SequentialMLP "
                             "(leave --moe-grouped-gemm off)")
        etp = pg_collection.expt_tp.size()
        shape = [num_local_experts, output_size, input_size]
        if shape[self.partition_axis] % etp:
            raise ValueError(f"{name}: {shape[self.partition_axis]} {'rows' if self.partition_axis == 1 else 'columns'}"
                             f" per expert do not split over expert-tensor-parallel size {etp}")
        shape[self.partition_axis] //= etp
        _check_grouped_mm_alignment(name, shape[1:], config.params_dtype)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_method(self.weight.data)
        # megatron's parallel linears' attributes, which its DDP, optimizer and grad-norm read: split over ETP;
        # reduced over the expert data-parallel group (allreduce False) where megatron gives experts their own groups
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=self.partition_axis, stride=1)
        expert_groups = (config.expert_model_parallel_size > 1
                         or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        self.weight.allreduce = not expert_groups

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> tuple[torch.Tensor, None]:
        ends = list(itertools.accumulate(tokens_per_expert))
        if len(ends) != self.weight.shape[0] or ends[-1] != tokens.shape[0]:
            raise ValueError(f"tokens_per_expert {tokens_per_expert} does not split {tokens.shape[0]} tokens over "
                             f"{self.weight.shape[0]} local experts")
        # non_blocking: from pageable memory CUDA stages the copy at once, with no wait for the stream to drain
        # (a blocking copy would synchronize the device at each projection of each MoE layer)
        offsets = torch.tensor(ends, dtype=torch.int32).to(tokens.device, non_blocking=True)
        return torch.nn.functional.grouped_mm(tokens, self.weight.transpose(1, 2), offs=offsets), None


class ColumnParallelGroupedLinear(_GroupedLinear):
    """The experts' ``linear_fc1`` (``[gate; up]`` rows), each expert's rows split over ETP."""

    partition_axis = 1


class RowParallelGroupedLinear(_GroupedLinear):
    """The experts' ``linear_fc2``, each expert's input columns split over ETP."""

    partition_axis = 2


def _check_grouped_mm_alignment(name: Optional[str], out_in: list[int], dtype: torch.dtype) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    odd = [n for n in out_in if n * itemsize % _GROUPED_MM_ALIGN_BYTES]
    if odd:
        raise ValueError(f"{name}: torch's grouped_mm needs each expert's sizes to be multiples of "
                         f"{_GROUPED_MM_ALIGN_BYTES // itemsize} in {dtype} (16 bytes), got [out, in] {out_in}; "
                         "build this model's experts as SequentialMLP (leave --moe-grouped-gemm off)")


def with_grouped_experts(block_spec: Any, config: Any) -> Any:
    """A copy of a decoder block spec (``TransformerBlockSubmodules``) whose MoE layers' routed experts are
    ``TEGroupedMLP`` over :class:`ColumnParallelGroupedLinear` / :class:`RowParallelGroupedLinear` when
    ``config.moe_grouped_gemm`` (``--moe-grouped-gemm``); else the spec
    as it is. Every family's block spec passes through here."""
    if not config.moe_grouped_gemm:
        return block_spec
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    experts = functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
        linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear))
    layers = []
    for layer in block_spec.layer_specs:
        mlp = layer.submodules.mlp
        if not (isinstance(mlp, functools.partial) and mlp.func is MoELayer):
            layers.append(layer)  # a dense MLP
            continue
        moe = functools.partial(MoELayer, *mlp.args, **{
            **mlp.keywords, "submodules": dataclasses.replace(mlp.keywords["submodules"], experts=experts)})
        layers.append(dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=moe)))
    return dataclasses.replace(block_spec, layer_specs=layers)
