"""The Megatron binding's side of the checkpoint coverage check, and its cleanup when a chain member fails.

megatron-core is not installed on the CPU test host: these run bind/megatron_optimizer.py against
stand-ins (a `megatron.core.parallel_state` module, DDP buffers with `param_index_map`, a class named
DistributedOptimizer with the attributes the binding reads, as megatron-core 0.19 spells them). They
check the binding's own logic only; on a GPU with real megatron-core it is unverified.
"""

import logging
import sys
import threading
from types import ModuleType, SimpleNamespace

import pytest
import torch

from miles_plugins.optimizers.nvme_stream import StreamConfig
from miles_plugins.optimizers.streaming.bind import megatron_optimizer as binding
from miles_plugins.optimizers.streaming.bucket import StreamEntry
from miles_plugins.optimizers.streaming.errors import StoreConfigError

BF16 = torch.bfloat16


@pytest.fixture
def parallel_state(monkeypatch):
    """megatron.core.parallel_state at pipeline stage 1, tensor rank 0, expert rank 2, expert-tensor rank 0."""
    ps = ModuleType("megatron.core.parallel_state")
    ps.get_pipeline_model_parallel_rank = lambda: 1
    ps.get_tensor_model_parallel_rank = lambda: 0
    ps.get_expert_model_parallel_rank = lambda: 2
    ps.get_expert_tensor_parallel_rank = lambda: 0
    core = ModuleType("megatron.core")
    core.parallel_state = ps
    megatron = ModuleType("megatron")
    megatron.core = core
    for name, module in (("megatron", megatron), ("megatron.core", core), ("megatron.core.parallel_state", ps)):
        monkeypatch.setitem(sys.modules, name, module)


class Chunk(torch.nn.Module):
    """A model chunk: two dense bf16 weights, an expert weight (allreduce=False) and an fp32 router."""

    def __init__(self, width=4):
        super().__init__()
        self.dense = torch.nn.Parameter(torch.zeros(width, 3, dtype=BF16))
        self.bias = torch.nn.Parameter(torch.zeros(width, dtype=BF16))
        self.expert = torch.nn.Parameter(torch.zeros(width, 5, dtype=BF16))
        self.expert.allreduce = False
        self.router = torch.nn.Parameter(torch.zeros(2, width))  # native fp32: the resident Adam's


def buffer_of(params):
    """A DDP buffer as the optimizer sees it: every data-parallel rank's params, by their range in it."""
    index, offset = {}, 0
    for p in params:
        index[p] = (offset, offset + p.numel(), 0)
        offset += p.numel()
    return SimpleNamespace(param_index_map=index, param_dtype=params[0].dtype,
                           buckets=[SimpleNamespace(param_data=torch.zeros(offset, dtype=params[0].dtype))])


def entry_of(name, param, start, stop):
    """This rank's shard [start, stop) of `param`, as the binding names it."""
    return StreamEntry(main=torch.zeros(stop - start), group=0, name=name, start=start, full_numel=param.numel())


def test_expected_params_are_every_low_precision_param_of_the_buffers_on_all_ranks(parallel_state):
    chunk = Chunk()
    opt = SimpleNamespace(model_chunks=[chunk])
    names = binding._param_names(opt)
    dense = buffer_of([chunk.dense, chunk.bias, chunk.router])
    experts = buffer_of([chunk.expert])
    # this rank holds only part of `dense`; the others are on other data-parallel ranks
    entries = [entry_of("pp1.chunk0.tp0.dense", chunk.dense, 4, 12)]
    sizes = binding.streamed_param_sizes([dense, experts], names, entries)
    assert sizes == {"pp1.chunk0.tp0.dense": 12, "pp1.chunk0.tp0.bias": 4, "pp1.chunk0.ep2.etp0.expert": 20}


def test_without_parallel_state_nothing_is_expected():
    chunk = Chunk()
    names = binding._param_names(SimpleNamespace(model_chunks=[chunk]))
    assert names == {}
    assert binding.streamed_param_sizes([buffer_of([chunk.dense])], names, []) is None


def test_a_streamed_param_missing_from_the_buffers_disables_the_check_with_a_warning(parallel_state, caplog):
    chunk = Chunk()
    names = binding._param_names(SimpleNamespace(model_chunks=[chunk]))
    entries = [entry_of("pp1.chunk0.tp0.bias", chunk.bias, 0, 4)]
    with caplog.at_level(logging.WARNING):
        assert binding.streamed_param_sizes([buffer_of([chunk.dense])], names, entries) is None
    assert "first: pp1.chunk0.tp0.bias" in caplog.text


def Range(start, end):  # megatron.core.optimizer.distrib_optimizer.Range: start, end
    return SimpleNamespace(start=start, end=end)


class DistributedOptimizer:
    """What the binding reads of a megatron-core DistributedOptimizer: this rank holds the whole of each
    bf16 param (one data-parallel rank), its fp32 main shards under an AdamW."""

    is_stub_optimizer = False
    distributed_optimizer_instance_id = 0

    def __init__(self, chunk, config=None):
        self.config, self.ddp_config = config or SimpleNamespace(), SimpleNamespace(overlap_param_gather=True)
        self.model_chunks = [chunk]
        self.model_float16_groups = [[chunk.dense, chunk.bias]]
        self.shard_fp32_from_float16_groups = [[p.detach().float().view(-1) for p in self.model_float16_groups[0]]]
        self.shard_fp32_groups = [[]]
        self.optimizer = torch.optim.AdamW([{"params": self.shard_fp32_from_float16_groups[0]}])
        self.buffers = [buffer_of(self.model_float16_groups[0])]
        self.model_param_gbuf_map = {p: (0, BF16, 0) for p in self.model_float16_groups[0]}

    def _get_model_param_range_map(self, p):
        start, stop, _ = self.buffers[0].param_index_map[p]
        return {"gbuf_world_in_bucket": Range(start, stop), "param": Range(0, p.numel())}

    def _is_distopt_quantized_param(self, p):
        return False


def config_of(tmp_path):
    return StreamConfig(dir=str(tmp_path), rank=0, bucket_numel=1000, depth=1)


def test_a_bound_member_lists_the_params_a_checkpoint_must_hold(tmp_path, parallel_state):
    store = binding.bind_megatron(DistributedOptimizer(Chunk()), config_of(tmp_path))
    try:
        assert store.model_params == {"pp1.chunk0.tp0.dense": 12, "pp1.chunk0.tp0.bias": 4}
    finally:
        store.close()


def test_a_chain_whose_member_fails_to_bind_closes_the_stores_it_built(tmp_path, parallel_state, monkeypatch):
    """Before: each failed construction leaked the I/O threads (6) of the members bound before it."""
    built = []
    bind_distributed = binding._bind_distributed
    monkeypatch.setattr(binding, "_bind_distributed", lambda *a, **k: built.append(bind_distributed(*a, **k)) or built[-1])
    refused = SimpleNamespace(use_precision_aware_optimizer=True)
    chain = SimpleNamespace(chained_optimizers=[DistributedOptimizer(Chunk()), DistributedOptimizer(Chunk(), refused)])
    threads = threading.active_count()
    with pytest.raises(StoreConfigError, match="precision-aware optimizer"):
        binding.bind_megatron(chain, config_of(tmp_path))
    assert len(built) == 1, "member 0 was bound before member 1 failed"
    assert built[0]._closed
    assert threading.active_count() == threads
    assert not list(tmp_path.rglob("bucket*.bin")), "member 0's bucket files removed"
