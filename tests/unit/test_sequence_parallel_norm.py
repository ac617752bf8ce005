"""sequence_parallel_norm.py without megatron: the norm is torch's RMSNorm (same weight name, same output) with
its params marked for megatron's TP grad sum under sequence parallelism, and with_norm swaps a norm builder
everywhere in a nested spec, leaving the rest as it was."""

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from miles.backends.megatron_backend.sequence_parallel_norm import SequenceParallelRMSNorm, with_norm


def _config(sequence_parallel: bool, normalization: str = "RMSNorm"):
    return SimpleNamespace(sequence_parallel=sequence_parallel, normalization=normalization)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_norm_is_torch_rmsnorm_marked_for_the_tp_grad_sum(sequence_parallel):
    norm = SequenceParallelRMSNorm(config=_config(sequence_parallel), hidden_size=8, eps=1e-6)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    assert norm.weight.sequence_parallel is sequence_parallel
    x = torch.randn(3, 2, 8)
    torch.testing.assert_close(norm(x), torch.nn.RMSNorm(8, eps=1e-6)(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="LayerNorm"):
        SequenceParallelRMSNorm(config=_config(True, "LayerNorm"), hidden_size=8)


class OldNorm:
    pass


@dataclasses.dataclass
class Spec:  # megatron's ModuleSpec / submodules shape: dataclasses holding builders, nested, in lists
    module: Any
    submodules: Any = None


def test_with_norm_swaps_every_occurrence_and_nothing_else():
    attention = Spec(module="attention", submodules={"q": OldNorm})  # a dict is not a spec: left alone
    layer = Spec(module="layer", submodules=Spec(module=OldNorm, submodules=attention))
    block = Spec(module=[layer, layer], submodules=OldNorm)
    out = with_norm(block, OldNorm, SequenceParallelRMSNorm)
    assert out.submodules is SequenceParallelRMSNorm
    assert all(l.submodules.module is SequenceParallelRMSNorm for l in out.module)
    assert out.module[0].submodules.submodules is attention, "unchanged parts are the same objects"
    assert block.submodules is OldNorm and layer.submodules.module is OldNorm, "the input spec is not modified"
