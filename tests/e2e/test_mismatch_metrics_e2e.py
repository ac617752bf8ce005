"""A tiny torch-backend run under --advantage-estimator gspo --use-tis (1 train rank, 1 embedded engine, 2
rollouts): every rollout record carries the train/rollout mismatch and the TIS figures, and each rollout's log line
shows them (docs/advanced/train-rollout-mismatch.md)."""

import json
import logging

import pytest

pytestmark = pytest.mark.e2e

MISMATCH_KEYS = ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max", "train_rollout_kl",
                 "tis_weight_mean", "tis_clipfrac")


def test_every_rollout_records_and_logs_the_mismatch(ray_cluster, tmp_path, caplog):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    metrics = tmp_path / "metrics.jsonl"
    config = validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "1", "--num-rollout-engines", "1", "--metrics-file", str(metrics),
        "--offload-train-disk-dir", str(tmp_path / "root"), "--num-rollout", "2", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--micro-batch-size", "2",
        "--advantage-estimator", "gspo", "--eps-clip", "4e-4", "--use-tis", "--tis-clip-low", "0.5"]))
    with caplog.at_level(logging.INFO, logger="miles"):
        run(config)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1]
    for r in records:
        assert all(isinstance(r[key], float) for key in MISMATCH_KEYS), r
        assert 0 <= r["train_rollout_logprob_abs_diff"] <= r["train_rollout_logprob_abs_diff_max"]
        assert r["train_rollout_kl"] >= 0 and 0.5 <= r["tis_weight_mean"] <= 2.0 and 0 <= r["tis_clipfrac"] <= 1
    lines = [m for m in caplog.messages if m.startswith("rollout ") and " | lp " in m]
    assert len(lines) == 2 and all(" kl " in m and " tis " in m for m in lines), caplog.messages
