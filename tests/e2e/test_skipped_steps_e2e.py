"""The RL loop on Ray (CPU, 2 train ranks): a rollout whose engine output carries a NaN log-prob is not
trained on by any rank; the run goes on, the record says why, and --max-consecutive-skipped-steps skips
in a row stop the run with one line (exit 1 from `miles train`), its records and teardown intact."""

import json
import os

import pytest

pytestmark = pytest.mark.e2e


def test_poisoned_rollouts_are_skipped_then_stop_the_run(ray_cluster, tmp_path, monkeypatch):
    from miles.config import backends
    from miles.config import parse_args, validate_args
    from miles.train import RunError, run

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setitem(backends.BACKENDS, "torch", "poisoned_backend:PoisonedLogprobTrainer")
    monkeypatch.setenv("PYTHONPATH", here + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    metrics = tmp_path / "metrics.jsonl"
    config = validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "2", "--num-rollout-engines", "1", "--colocate",
        "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", str(tmp_path / "offload"), "--metrics-file", str(metrics),
        "--num-rollout", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--micro-batch-size", "2", "--max-consecutive-skipped-steps", "2"]))
    with pytest.raises(RunError) as err:
        run(config)
    message = str(err.value)
    assert "\n" not in message and "2 rollouts in a row skipped their optimizer step" in message, message
    assert "rank 0: sample 0: rollout log-prob of response token 0 is nan" in message, message
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1, 2], "the run went on after one skip, stopped at two"
    assert records[0]["step_skipped"] is None and records[0]["stream_written_gb"] > 0
    for r in records[1:]:
        assert r["step_skipped"].startswith("rank 0: sample 0: rollout log-prob"), r["step_skipped"]
        assert r["stream_read_gb"] == 0 and r["stream_written_gb"] == 0, "nothing streamed"
    leftovers = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path / "offload") for f in fs]
    assert leftovers == [], leftovers
