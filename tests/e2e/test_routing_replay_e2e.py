"""A tiny MoE run under --use-rollout-routing-replay through Ray (1 train rank, 1 embedded engine, 2 rollouts): the
engine records routes, they reach the train rank with the samples, the trainer replays them, and every rollout
record and line carries the routing shares (docs/advanced/train-rollout-mismatch.md)."""

import json
import logging

import pytest

pytestmark = pytest.mark.e2e


def test_every_rollout_replays_routes_and_reports_them(ray_cluster, tmp_path, caplog):
    from miles.config import parse_args
    from miles.models import write_random_model
    from miles.preflight import validate_args
    from miles.train import run

    model = write_random_model(str(tmp_path / "qwen3-moe"), "qwen3-moe-tiny", dtype="fp32")
    metrics = tmp_path / "metrics.jsonl"
    config = validate_args(parse_args([
        "--hf-checkpoint", model, "--model-dtype", "fp32", "--num-train-ranks", "1", "--num-rollout-engines", "1",
        "--metrics-file", str(metrics), "--offload-train-disk-dir", str(tmp_path / "root"), "--num-rollout", "2",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--micro-batch-size", "2", "--use-rollout-routing-replay"]))
    with caplog.at_level(logging.INFO, logger="miles"):
        run(config)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1]
    for r in records:
        assert r["step_skipped"] is None
        # fp32, the engine's and the trainer's weights equal: their routers choose alike (a near tie aside)
        assert 0 <= r["routing_replay_mismatch_first"] <= 0.05 and 0 <= r["routing_replay_mismatch_last"] <= 0.05, r
    lines = [m for m in caplog.messages if m.startswith("rollout ") and " | lp " in m]
    assert len(lines) == 2 and all(" r3 " in m for m in lines), caplog.messages
