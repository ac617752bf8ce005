"""The sleep plan in the RL loop (CPU, local Ray, tiny model, colocated, streamed state): 3 rollouts with
--offload-train-plan auto give the loss and reward series of the forced offload, bit for bit, and the
records say what each sleep and wake moved."""

import json

import pytest

pytestmark = pytest.mark.e2e


def _run(tmp, plan, ranks=1):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    metrics = tmp / f"{plan}.jsonl"
    argv = ["--tiny-model", "--num-train-ranks", str(ranks), "--num-rollout-engines", "1", "--colocate",
            "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
            "--stream-optimizer-state-host-cache-mb", "64", "--offload-train-plan", plan,
            "--offload-train-disk-dir", str(tmp / f"offload-{plan}"), "--seed", "7",
            "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "8", "--micro-batch-size", "2", "--metrics-file", str(metrics)]
    run(validate_args(parse_args(argv)))
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_plan_trains_as_the_forced_offload(ray_cluster, tmp_path):
    forced = _run(tmp_path, "offload-all")
    planned = _run(tmp_path, "auto")
    assert [r["loss"] for r in planned] == [r["loss"] for r in forced]
    assert [r["reward_mean"] for r in planned] == [r["reward_mean"] for r in forced]
    for f, p in zip(forced, planned):
        assert f["sleep_plan"] == "offload-all" and f["sleep_moved_bytes"] == f["sleep_to_disk_bytes"] > 0
        assert f["wake_moved_bytes"] == f["wake_from_disk_bytes"] == f["sleep_moved_bytes"]
        # CPU: the engine's KV need (its largest dynamic cache, a few KB) fits in host memory: nothing moves
        assert p["sleep_plan"] == "auto" and p["sleep_moved_bytes"] == 0 and p["sleep_kept_bytes"] > 0
        assert any("engine copy not used" in n for n in p["sleep_plan_notes"])
    # the first wake undoes the sleep before the first generate, when the engine's need was not measured
    # yet (taken as the whole device): the weights were released and come back from the masters in RAM
    first = planned[0]
    assert first["wake_rebuilt_from_masters_bytes"] > 0 and first["wake_masters_read_bytes"] > 0
    assert first["wake_moved_bytes"] == first["wake_rebuilt_from_masters_bytes"] + first["wake_from_disk_bytes"]
    assert all(p["wake_moved_bytes"] == 0 for p in planned[1:])


def test_two_ranks_rebuild_their_weights_from_sharded_masters_as_the_forced_offload(ray_cluster, tmp_path):
    """Two data-parallel ranks, each store holding the masters of its optimizer shard only: the first wake
    rebuilds every rank's whole bf16 weights from the masters of both shards, and the run trains as the forced
    offload bit for bit."""
    forced = _run(tmp_path, "offload-all", ranks=2)
    planned = _run(tmp_path, "auto", ranks=2)
    assert [r["loss"] for r in planned] == [r["loss"] for r in forced]
    assert [r["reward_mean"] for r in planned] == [r["reward_mean"] for r in forced]
    assert planned[0]["wake_rebuilt_from_masters_bytes"] > 0
