"""`miles train` on a local Ray cluster: the actors' lines reach the driver's log with the call that
logged them, before the driver's own line about that call (not minutes later through Ray's log files)."""

import logging

import pytest

pytestmark = pytest.mark.e2e


def test_actor_lines_come_before_the_drivers_line_about_the_same_call(ray_cluster, tmp_path, caplog):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    args = validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "1", "--num-rollout-engines", "1", "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--micro-batch-size", "2", "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", str(tmp_path / "offload"), "--save", str(tmp_path / "ckpt")]))
    with caplog.at_level(logging.INFO, logger="miles"):
        run(args)
    messages = [r.getMessage() for r in caplog.records]

    def first(predicate, what):
        found = [i for i, m in enumerate(messages) if predicate(m)]
        assert found, f"no {what} line in the driver's log:\n" + "\n".join(messages)
        return found[0]

    policy_model = first(lambda m: m.startswith("[rank 0] policy model:"), "train actor 'policy model'")
    policy = first(lambda m: m.startswith("policy:"), "driver 'policy:'")
    assert policy_model < policy
    complete = first(lambda m: m.startswith("checkpoint complete:"), "'checkpoint complete'")
    # the lines the train actor logged while saving (its store's save, its rank directory) come before
    saving = [i for i, m in enumerate(messages) if m.startswith("[rank 0]") and "sav" in m.lower()]
    assert saving and max(saving) < complete, "\n".join(messages)
