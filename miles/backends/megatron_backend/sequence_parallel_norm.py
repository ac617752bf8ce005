"""The local spec's norms under sequence parallelism, without apex or Transformer Engine.

megatron-core's local spec builds its norms with ``WrappedTorchNorm`` when apex is absent (the GPU host's
bundle), and that refuses ``sequence_parallel``: each TP rank then holds a slice of the sequence, so a norm's
weight grad is partial per rank and must be summed over the TP group. :class:`SequenceParallelRMSNorm` is torch's
RMSNorm (the same ``weight``, so convert.py's names hold) with its params marked ``sequence_parallel``, which is
how megatron's ``finalize_model_grads`` knows to sum their grads over TP (apex's FusedLayerNorm marks them the
same way). The q/k norms act on whole-sequence activations but hold one weight for the heads of every TP rank;
megatron sums their grads over TP by name (``q_layernorm``/``k_layernorm``) with or without the mark.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["SequenceParallelRMSNorm", "with_norm"]


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built as megatron builds a norm (``config, hidden_size, eps``), params marked for the
    TP grad sum when ``config.sequence_parallel``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm builds RMSNorm, not {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def with_norm(spec: Any, old: type, new: type) -> Any:
    """A copy of a megatron spec (nested ModuleSpec / submodule dataclasses) with every ``old`` norm builder
    replaced by ``new``."""
    if spec is old:
        return new
    if isinstance(spec, (list, tuple)):
        return type(spec)(with_norm(s, old, new) for s in spec)
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return spec
    changes = {f.name: with_norm(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)}
    changed = {k: v for k, v in changes.items() if v is not getattr(spec, k)}
    return dataclasses.replace(spec, **changed) if changed else spec
