"""The RL loop on Ray (CPU, 2 train ranks): a rollout whose engine output carries a NaN log-prob is not
trained on by any rank; the run goes on, the record says why, and --max-consecutive-skipped-steps skips
in a row stop the run with one line (exit 1 from `miles train`), its records and teardown intact. A run none
of whose steps was applied fails too, and a step that leaves non-finite weights stops the run before they
reach a checkpoint or an engine, the last good checkpoint staying the latest."""

import json
import os

import pytest

pytestmark = pytest.mark.e2e


def _use_backend(monkeypatch, spec: str) -> None:
    """``--train-backend torch`` builds ``spec`` (a backend of tests/e2e/poisoned_backend.py) in every train actor,
    whose PYTHONPATH the actor factory extends with the driver's."""
    from miles.config import backends

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setitem(backends.BACKENDS, "torch", spec)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", here + (os.pathsep + path if path else ""))


def test_poisoned_rollouts_are_skipped_then_stop_the_run(ray_cluster, tmp_path, monkeypatch):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import RunError, run

    _use_backend(monkeypatch, "poisoned_backend:PoisonedLogprobTrainer")
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


def test_a_run_whose_every_step_was_skipped_fails(ray_cluster, tmp_path, monkeypatch):
    """Fewer rollouts than --max-consecutive-skipped-steps, none applied: the run ends with one line, not as
    a run that trained."""
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import RunError, run

    _use_backend(monkeypatch, "poisoned_backend:AlwaysPoisonedLogprobTrainer")
    metrics = tmp_path / "metrics.jsonl"
    config = validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "1", "--num-rollout-engines", "1", "--metrics-file", str(metrics),
        "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--micro-batch-size", "2", "--max-consecutive-skipped-steps", "3"]))
    with pytest.raises(RunError) as err:
        run(config)
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "run stopped: none of this run's 2 rollout(s) applied an optimizer step (the last, rollout 1: rank 0: "
        "sample 0: rollout log-prob of response token 0 is nan"), message
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1] and all(r["step_skipped"] for r in records)


def test_non_finite_weights_stop_the_run_and_the_last_good_checkpoint_stays_latest(ray_cluster, tmp_path,
                                                                                   monkeypatch):
    """Rank 0's step of rollout 2 turns the weights into NaN (2 ranks, streamed state, a checkpoint after every
    rollout, the one of rollout 1 still copying in the background): the run stops with one line naming the
    rollout, that checkpoint is published and stays the latest, nothing is saved after the bad step, and
    every checkpoint holds finite weights."""
    import glob

    import torch
    from safetensors.torch import load_file

    from miles import checkpoint
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import RunError, run

    _use_backend(monkeypatch, "poisoned_backend:InfiniteLrTrainer")
    metrics, save = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    config = validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "2", "--num-rollout-engines", "1", "--colocate",
        "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", str(tmp_path / "offload"), "--metrics-file", str(metrics),
        "--save", str(save), "--save-interval", "1",
        "--num-rollout", "4", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--micro-batch-size", "2"]))
    with pytest.raises(RunError) as err:
        run(config)
    message = str(err.value)
    latest = checkpoint.checkpoint_path(str(save), 2)
    assert "\n" not in message and message.startswith(
        "run stopped: rollout 2: the optimizer step left non-finite weights (NaN or inf; grad norm "), message
    assert (f"they were not saved or handed to the rollout engines. the latest checkpoint, {latest}, holds the "
            f"weights before it: resume with --load {save} and a lower --lr") in message, message
    assert checkpoint.resolve(str(save)) == latest
    assert sorted(os.listdir(save)) == sorted([checkpoint.LATEST_FILE, os.path.basename(latest),
                                               os.path.basename(checkpoint.checkpoint_path(str(save), 1))])
    weight_files = glob.glob(os.path.join(save, "*", "**", "*.safetensors"), recursive=True)
    assert len(weight_files) >= 2, weight_files
    for path in weight_files:
        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1]
    leftovers = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path / "offload") for f in fs]
    assert leftovers == [], leftovers
