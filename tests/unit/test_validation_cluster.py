"""Validation's free-space check when the run joins an existing cluster (RAY_ADDRESS): the driver's disk must
hold only what can land on the driver's node; each node's own disk is checked by the per-node probe once Ray
has placed the ranks (miles/ray/node_disk.py). The run that starts its own Ray keeps counting every rank."""

from __future__ import annotations

import pytest

from miles.config import ArgumentError, ClusterConfig, parse_args
from miles.preflight import Environment, validate_args
from miles.preflight.disk_budget import SMOLLM2_PARAMS, disk_budget, model_tensors_of_run, ranks_on_driver_node
from miles.preflight.resource_checks import driver_node_slots

GIB = 2**30
P = SMOLLM2_PARAMS
# 4 ranks of the default model (fp32 on CPU): 12 B/param of streamed state + 4 B/param of weights per rank
FOUR_RANKS = ["--stream-optimizer-state-to-disk", "--offload-train-target=disk", "--num-train-ranks", "4"]
ALL_RANKS_NEED = 12 * P + 4 * 4 * P  # 3.50 GiB
TWO_RANKS_NEED = 12 * P // 2 + 2 * 4 * P  # 1.75 GiB: the driver's 2 CPUs hold 2 bundles of 1 CPU


def env(tmp_path, **kw) -> Environment:
    base = dict(cuda_available=lambda: False, has_module=lambda m: True, scratch_root=str(tmp_path / "scratch"),
                run_id="test", ray_address=None, cpu_count=lambda: 2, gpu_count=lambda: 0)
    return Environment(**{**base, **kw})


def validate(tmp_path, *argv, **env_kw):
    argv = list(argv) + ["--metrics-file", str(tmp_path / "metrics.jsonl")]
    return validate_args(parse_args(argv), env(tmp_path, **env_kw))


def test_own_ray_counts_every_rank_on_the_driver_disk(tmp_path):
    free = lambda p: 2 * GIB  # noqa: E731  fits the driver's share, not the whole run
    with pytest.raises(ArgumentError) as ei:
        validate(tmp_path, *FOUR_RANKS, disk_free_bytes=free)
    assert f"needs about {ALL_RANKS_NEED / GIB:.2f} GiB" in str(ei.value)
    assert "train ranks can run on this node" not in str(ei.value)
    assert validate(tmp_path, *FOUR_RANKS, disk_free_bytes=lambda p: 4 * GIB,
                    cpu_count=lambda: 5).ray_address is None  # 4 ranks + 1 engine, one CPU each


def test_joining_a_cluster_counts_only_what_fits_on_the_driver_node(tmp_path):
    cfg = validate(tmp_path, *FOUR_RANKS, ray_address="head:6379", disk_free_bytes=lambda p: 2 * GIB)
    assert cfg.ray_address == "head:6379"


def test_the_driver_node_share_that_does_not_fit_is_refused_with_the_numbers(tmp_path):
    with pytest.raises(ArgumentError) as ei:
        validate(tmp_path, *FOUR_RANKS, ray_address="head:6379", disk_free_bytes=lambda p: GIB)
    msg = str(ei.value)
    assert f"{tmp_path / 'scratch'}" in msg  # which directory
    assert f"needs about {TWO_RANKS_NEED / GIB:.2f} GiB" in msg and "1.00 GiB free" in msg
    assert "at most 2 of the 4 train ranks can run on this node of the cluster at head:6379" in msg
    assert "Fix: free space, pass --offload-train-disk-dir on a larger disk" in msg


def test_ray_address_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert Environment().ray_address == "10.0.0.1:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    assert Environment().ray_address is None


def test_driver_node_slots_are_its_gpus_or_its_cpus_per_rank(tmp_path):
    a = ClusterConfig(num_cpus_per_rank=4)
    assert driver_node_slots(a, env(tmp_path, cpu_count=lambda: 18)) == 4
    assert driver_node_slots(a, env(tmp_path, cuda_available=lambda: True, gpu_count=lambda: 8)) == 8
    assert ranks_on_driver_node(16, 8) == 8 and ranks_on_driver_node(4, 8) == 4 and ranks_on_driver_node(4, 0) == 0


def test_budget_of_some_ranks(tmp_path):
    a = validate(tmp_path, *FOUR_RANKS, "--colocate", "--num-rollout-engines", "2", cpu_count=lambda: 8,
                 disk_free_bytes=lambda p: 1 << 50)
    assert a.model.model_dtype == "fp32" and a.trainer_offload_to_disk
    model = model_tensors_of_run("smollm2", None)
    assert disk_budget(a, model, ranks_here=4) == disk_budget(a, model)
    one = disk_budget(a, model, ranks_here=1)
    assert 12 * P // 4 <= one.state <= 12 * P // 4 * 1.001 and one.trainer_offload == 4 * P  # + bucket alignment
    assert disk_budget(a, model, ranks_here=0).scratch == 0
