"""Recorded rollouts in the RL loop (CPU, local Ray, tiny model): a run records its rollouts; replaying them
with the same flags trains to the same losses and grad norms bit for bit, and with token-budget
micro-batches to the same grad norms up to summation order, rollout after rollout (a generating run samples
other tokens once its weights differ in the last bits, so only replay compares two setups past the first
rollout)."""

import json

import pytest

pytestmark = pytest.mark.e2e


def _run(tmp, name, *flags):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    metrics = tmp / f"{name}.jsonl"
    run(validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "1", "--num-rollout-engines", "1", "--seed", "7",
        "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--offload-train-disk-dir", str(tmp / f"disk-{name}"),
        "--metrics-file", str(metrics), *flags])))
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_replayed_rollouts_train_as_recorded(ray_cluster, tmp_path):
    template = str(tmp_path / "rollouts" / "rollout_{rollout_id}.json")
    recorded = _run(tmp_path, "recorded", "--micro-batch-size", "2", "--save-debug-rollout-data", template)
    same = _run(tmp_path, "same", "--micro-batch-size", "2", "--load-debug-rollout-data", template)
    packed = _run(tmp_path, "packed", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64",
                  "--load-debug-rollout-data", template)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [f"rollout_{i}.json" for i in range(3)]
    for key in ("loss", "reward_mean", "grad_norm"):
        assert [r[key] for r in same] == [r[key] for r in recorded], key
    assert [r["reward_mean"] for r in packed] == [r["reward_mean"] for r in recorded]
    # the loss of a fresh GRPO step is ~0 (ratio 1, advantages summing to 0): the grad norm carries the step
    worst = max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(recorded, packed))
    print(f"\ngrad norms recorded {[r['grad_norm'] for r in recorded]}, token-budget replay "
          f"{[r['grad_norm'] for r in packed]}; max relative difference {worst:.2e}")
    assert worst < 1e-5  # fp32 on CPU: only the summation order differs
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(recorded, packed)) < 1e-6
    assert recorded[0]["train_micro_batches"] != packed[0]["train_micro_batches"]  # the setups batched differently
