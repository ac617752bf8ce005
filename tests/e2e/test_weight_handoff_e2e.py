"""The weight handoff through the whole loop on CPU: by reference (a /dev/shm file) and by a gloo
broadcast over the weight-update group give the engine the same weights (same samples, same rewards)."""

import json

import pytest

pytestmark = pytest.mark.e2e


def _run(tmp_path, name, *extra):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    argv = ["--tiny-model", "--num-train-ranks", "1", "--num-rollout-engines", "1",
            "--offload-train-disk-dir", str(tmp_path / name), "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--weight-sync-bucket-mb", "1",
            "--metrics-file", str(tmp_path / f"{name}.jsonl"), *extra]
    run(validate_args(parse_args(argv)))
    with open(tmp_path / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_reference_and_broadcast_handoffs_give_the_engine_the_same_weights(ray_cluster, tmp_path):
    by_reference = _run(tmp_path, "ipc", "--weight-sync", "ipc")
    by_broadcast = _run(tmp_path, "dist", "--weight-sync", "distributed")
    for a, b in zip(by_reference, by_broadcast):
        assert a["weight_handoff_bytes"] == b["weight_handoff_bytes"] > 0
        assert a["weight_handoff_buckets"] == b["weight_handoff_buckets"] >= 1
        assert a["weight_handoff_largest_bucket_bytes"] <= 1 << 20 or a["weight_handoff_buckets"] == 1
        assert a["reward_mean"] == b["reward_mean"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9)
        assert a["forward_backward_seconds"] > 0 and a["other_seconds"] >= -1e-6
