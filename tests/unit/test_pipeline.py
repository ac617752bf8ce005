"""The step pipeline (streaming/pipeline.py) on CPU: its order, its read-ahead and what it holds between steps."""

import pytest
import torch

from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

SIZES = (3000, 5000, 7000, 9000, 11000, 13000)
BUCKET_NUMEL = 4096 + 100  # several buckets from these sizes
MOMENT_BYTES = 8 * sum(SIZES)  # torch AdamW: the mains are the model's params; the store streams the moments


def make(tmp_path, **store_kwargs):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]
    opt = torch.optim.AdamW(params, lr=1e-2)
    store = stream_optimizer_state(opt, dir=str(tmp_path), bucket_numel=BUCKET_NUMEL, **store_kwargs)
    return params, opt, store


def step(params, opt, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def test_the_order_alternates_every_step_and_a_restored_order_flips_it(tmp_path):
    params, opt, store = make(tmp_path)
    pipeline = store.pipeline
    ascending = [b.index for b in store.buckets]
    assert len(ascending) > 3 and [b.index for b in pipeline.next_order()] == ascending
    step(params, opt, 1)
    assert pipeline.next_order_descending() and [b.index for b in pipeline.next_order()] == ascending[::-1]
    pipeline.restore_next_order(False)  # what a load of a checkpoint saved after an even number of steps does
    assert [b.index for b in pipeline.next_order()] == ascending
    step(params, opt, 2)
    assert [b.index for b in pipeline.next_order()] == ascending[::-1]
    store.close()


def test_between_steps_it_holds_at_most_depth_reads_and_depth_write_backs(tmp_path):
    params, opt, store = make(tmp_path, depth=2)
    pipeline = store.pipeline
    for seed in range(1, 4):
        step(params, opt, seed)
        assert len(pipeline.held) <= store.depth and not pipeline.fetching and pipeline.current is None
        started = store.prefetch()
        assert 0 < started <= store.depth and len(pipeline.fetching) == started
        assert store.stats.peak_resident_bytes <= store.stats.residency_bound_bytes
    store.flush()
    assert not pipeline.held and not pipeline.fetching and store.stats.resident_bytes == 0
    store.close()


def test_prefetch_reads_nothing_the_host_tier_holds(tmp_path):
    params, opt, store = make(tmp_path, depth=2, host_cache_mb=64)  # the whole state in RAM
    assert store.stats.ram_state_bytes == store.stats.state_bytes
    step(params, opt, 1)
    assert store.prefetch() == 0 and not store.pipeline.fetching
    step(params, opt, 2)
    last = store.stats.last_step
    assert last.bytes_read == last.cache_bytes_read == MOMENT_BYTES and last.disk_bytes_read == 0
    assert last.prefetched_buckets == 0
    store.close()


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_the_walk_reports_its_reads_and_stays_within_the_bound(tmp_path, depth):
    params, opt, store = make(tmp_path, depth=depth, write_behind=depth > 0)
    for seed in range(1, 4):
        step(params, opt, seed)
        last = store.stats.last_step
        assert last.buckets == len(store.buckets) and last.compute_seconds > 0
        assert last.bytes_read == (MOMENT_BYTES if seed > 1 else 0)  # no moments to read before the first step
        assert last.bytes_written == MOMENT_BYTES
        assert last.peak_resident_bytes <= store.stats.residency_bound_bytes
    store.close()
