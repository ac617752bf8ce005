"""Pure parts of multi-node placement (miles.ray.layout, miles.ray.node_disk): which rank sits on which bundle,
where colocated engines go, what each node's disk must hold and the one line when a node is short."""

import os

import pytest

from miles.config import parse_args
from miles.preflight import Environment, validate_args
from miles.preflight.disk_budget import model_tensors_of_run
from miles.ray import layout, node_disk

# the root's parent /scratch exists on the pretended machine (validation refuses a root whose parent is missing)
SCRATCH_EXISTS = dict(path_exists=lambda p: p == "/scratch" or os.path.exists(p),
                      is_dir=lambda p: p == "/scratch" or os.path.isdir(p), dir_writable=lambda p: True,
                      disk_free_bytes=lambda p: 1 << 50)


def _cfg(*argv):
    base = ["--tiny-model", "--num-train-ranks", "4", "--num-rollout-engines", "2", "--colocate",
            "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
            "--offload-train-disk-dir", "/scratch/run", "--metrics-file", "/scratch/m.jsonl",
            "--rollout-batch-size", "4"]
    return validate_args(parse_args(base + list(argv)), Environment(**SCRATCH_EXISTS, has_module=lambda m: False,
                                                                     cuda_available=lambda: False,
                                                                     cpu_count=lambda: 64))


def test_ranks_follow_the_nodes_whatever_order_ray_placed_the_bundles_in():
    assert layout.rank_bundles(["a", "a", "b", "b"], 4) == [0, 1, 2, 3]
    assert layout.rank_bundles(["a", "b", "a", "b"], 4) == [0, 2, 1, 3]
    assert layout.rank_bundles(["b", "a", "a", "b", "engine-node"], 4) == [0, 3, 1, 2]
    assert layout.ranks_by_node(["a", "b", "a", "b"], [0, 2, 1, 3]) == {"a": [0, 1], "b": [2, 3]}
    with pytest.raises(ValueError, match="4 train ranks but the placement group has 3"):
        layout.rank_bundles(["a", "a", "b"], 4)


def test_colocated_engines_spread_over_the_ranks_and_follow_their_bundles():
    cfg = _cfg()
    assert [layout.colocated_rank(cfg, e) for e in range(2)] == [0, 2]
    assert [layout.rollout_engine_placement(cfg, e, [0, 2, 1, 3]) for e in range(2)] == [0, 1]
    assert [layout.rollout_engine_placement(cfg, e) for e in range(2)] == [0, 2]


def test_each_node_needs_its_ranks_share_of_the_plan():
    cfg = _cfg()
    per_rank = node_disk.per_rank_disk_bytes(cfg, model_tensors_of_run("tiny", None))
    assert per_rank > 0
    assert node_disk.per_rank_disk_bytes(_cfg("--stream-optimizer-state-moment-dtype", "bf16"),
                                         model_tensors_of_run("tiny", None)) < per_rank
    needs = node_disk.node_needs({"a": [0, 1, 2], "b": [3]}, per_rank=lambda node, count: 100 * count)
    assert needs == {"a": 900, "b": 100} and list(needs) == ["a", "b"]


def test_a_short_node_gives_one_line_naming_it_and_the_numbers():
    ok = node_disk.NodeDisk("aaaa", "10.0.0.1", (0, 1), 2 * 10**12, 3 * 10**12, "/nvme/run")
    short = node_disk.NodeDisk("bbbb", "10.0.0.2", (2, 3), 2 * 10**12, 5 * 10**11, "/nvme")
    assert node_disk.shortfall_line([ok]) is None
    line = node_disk.shortfall_line([ok, short])
    assert "\n" not in line and "aaaa" not in line
    assert "node bbbb (10.0.0.2): 2 train rank(s) [2, 3] need 2.00 TB under /nvme, 500.00 GB free" in line
    assert "`miles plan`" in line


def test_a_nodes_auto_host_tier_takes_its_share_of_the_state_off_that_nodes_disk():
    cfg = _cfg("--stream-optimizer-state-host-cache-mb", "auto")
    model = model_tensors_of_run("tiny", None)
    unknown = node_disk.per_rank_disk_bytes(cfg, model, 2, memory_available=None)  # no tier counted
    roomy = node_disk.per_rank_disk_bytes(cfg, model, 2, memory_available=64 * 2**30)
    # what is left is the trainer offload: the whole streamed state lives in the tier
    assert unknown == node_disk.per_rank_disk_bytes(_cfg(), model) and 0 < roomy < unknown
