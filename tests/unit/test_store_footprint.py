"""One cost model of a store: `miles plan` sizes the store a run builds. Over the same entries, the plan's
bucket count, bucket size, depth, state bytes and device bytes are a real store's `store.stats`, whether the
store fits its buckets to a small device budget or keeps its default, with fp32 or bf16 moments, mains
streamed or not; and the plan refuses what the store refuses. CPU only."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint import _restarted_process, build  # noqa: E402,F401

from miles.sizing.estimate import Hardware, SizingError, Training, estimate  # noqa: E402
from miles.sizing.sharding import Parallelism, rank_shards  # noqa: E402
from miles.sizing.store_plan import plan_store  # noqa: E402
from miles.sizing.tensors import flat_model  # noqa: E402
from miles_plugins.optimizers.nvme_stream import StoreConfigError  # noqa: E402
from miles_plugins.optimizers.streaming.config import DEFAULT_BUCKET_NUMEL  # noqa: E402
from miles_plugins.optimizers.streaming.footprint import smallest_bucket_numel, store_footprint  # noqa: E402
from miles_plugins.optimizers.streaming.units import MiB  # noqa: E402

PARAMS = 150_000  # `miles plan --params 150K`: 16 tensors of irregular sizes
MODEL = flat_model(PARAMS)
ENTRIES = list(rank_shards(MODEL, Parallelism())[0].dense_entries)  # one rank: it owns every tensor whole
SHAPES = [(n,) for n in ENTRIES]
BUDGET_MB = 1  # ~10-20 buckets of 8-24K elements here: the store fits them below its preferred minimum


def planned(moment_dtype, budget_mb, **training):
    # No reserve: the device bytes below are the streaming HBM less weights and grads, exact in integers.
    hw = Hardware(nodes=1, gpus_per_node=1, device_budget_mb=budget_mb, reserve_gb=0)
    return estimate(MODEL, Parallelism(), hw, Training(moment_dtype=moment_dtype, **training))


def planned_device_bytes(est) -> int:
    """What the plan puts on the GPU for the streamed state while the stores step."""
    return est.fit.device_bytes["streaming"] - est.fit.device_bytes["weights+grads+reserve"]


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("budget_mb", [BUDGET_MB, None], ids=["fitted-to-1MiB", "default-budget"])
def test_the_plan_is_the_store_a_megatron_style_run_builds(tmp_path, moment_dtype, budget_mb):
    # bf16 params with fp32 master shards (the sharded optimizer): the mains stream, as under Megatron
    params, _, store = build("sharded", tmp_path, shapes=SHAPES, bucket_numel=None, moment_dtype=moment_dtype,
                             device_budget_mb=budget_mb)
    assert [p.numel() for p in params] == ENTRIES
    est = planned(moment_dtype, budget_mb)
    plan, stats = est.binding.dense_store, store.stats
    assert est.binding.expert_store.num_buckets == 0
    assert (plan.num_buckets, plan.bucket_numel, plan.depth) == (stats.num_buckets, stats.bucket_numel, stats.depth)
    assert est.binding.streamed_state_bytes == stats.state_bytes
    assert planned_device_bytes(est) == stats.residency_bound_bytes <= stats.device_budget_bytes
    assert plan.device_budget_bytes == stats.device_budget_bytes
    assert stats.num_buckets > 1 if budget_mb else stats.num_buckets == 1


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_the_plan_of_moments_only_is_the_store_over_fp32_params(tmp_path, moment_dtype):
    # a plain AdamW over fp32 params: the params are the masters, only the moments stream
    _, _, store = build("plain", tmp_path, shapes=SHAPES, bucket_numel=None, moment_dtype=moment_dtype,
                        device_budget_mb=BUDGET_MB)
    plan = plan_store(ENTRIES, moment_dtype, device_budget_bytes=BUDGET_MB * MiB, streams_main=False)
    stats = store.stats
    assert stats.num_buckets > 1
    assert (plan.num_buckets, plan.bucket_numel, plan.depth) == (stats.num_buckets, stats.bucket_numel, stats.depth)
    assert (plan.state_bytes, plan.residency_bound_bytes) == (stats.state_bytes, stats.residency_bound_bytes)


@pytest.mark.parametrize("config", [{"bucket_numel": 10_000, "depth": 1}, {"io_engine": "sync"},
                                    {"bucket_numel": 20_000, "io_engine": "sync"}],
                         ids=["given-size-and-depth", "sync", "given-size-sync"])
def test_the_footprint_follows_every_knob_the_store_takes(tmp_path, config):
    _, _, store = build("sharded", tmp_path, shapes=SHAPES, moment_dtype="bf16", device_budget_mb=BUDGET_MB,
                        **{"bucket_numel": None, **config})
    footprint = store_footprint(ENTRIES, "bf16", bucket_numel=config.get("bucket_numel"), depth=config.get("depth"),
                                device_budget_bytes=BUDGET_MB * MiB, sync=config.get("io_engine") == "sync")
    s = store.stats
    assert (footprint.num_buckets, footprint.bucket_numel, footprint.depth) == (s.num_buckets, s.bucket_numel, s.depth)
    assert (footprint.state_bytes, footprint.residency_bound_bytes) == (s.state_bytes, s.residency_bound_bytes)
    assert (footprint.bucket_inflight_bytes, footprint.codec_scratch_bytes) == (s.bucket_inflight_bytes,
                                                                              s.codec_scratch_bytes)


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("entries, budget_mb", [(ENTRIES, BUDGET_MB), ([DEFAULT_BUCKET_NUMEL] * 5, 600),
                                                ([DEFAULT_BUCKET_NUMEL] * 5, None)],
                         ids=["below-the-minimum-bucket", "600MiB", "default-budget"])
def test_the_bucket_count_floor_is_the_bucket_a_large_state_is_cut_into(moment_dtype, entries, budget_mb):
    # `miles plan` bounds the bucket count with it before planning; a state of more buckets than a step keeps
    # in flight is cut at exactly this size
    budget = None if budget_mb is None else budget_mb * MiB
    footprint = store_footprint(entries, moment_dtype, device_budget_bytes=budget)
    assert footprint.num_buckets > 5
    assert smallest_bucket_numel(moment_dtype, device_budget_bytes=budget) == footprint.bucket_numel


def test_the_plan_refuses_a_bucket_size_the_store_refuses(tmp_path):
    too_big = 100_000  # at depth 0 alone, 100K elements of fp32 mains and moments need 1.2 MB
    with pytest.raises(StoreConfigError, match="bucket_numel=100000 at depth=0"):
        build("sharded", tmp_path, shapes=SHAPES, bucket_numel=too_big, device_budget_mb=BUDGET_MB)
    with pytest.raises(SizingError, match=r"bucket_numel=100000 at depth=0 .*--device-budget-mb .*--bucket-numel"):
        planned("fp32", BUDGET_MB, bucket_numel=too_big)
