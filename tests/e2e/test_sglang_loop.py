"""The RL loop end to end with --rollout-engine sglang on a local Ray cluster (CPU), against the fake sglang of
tests/fakes (the stand-in ``sglang`` package on the actors' PYTHONPATH): colocated, streamed optimizer state
+ disk trainer offload, a random tiny Llama folder, 3 rollouts. The engine actor builds the sglang client,
which starts the fake ``sglang.Engine`` in-process; every rollout's weights go to it by reference and are
read with the fake's own bucket class."""

import json
import os

import pytest
import torch

pytestmark = pytest.mark.e2e

FAKES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fakes")


# On a CUDA host the trainer's weights are CUDA tensors. The fake sglang.Engine opens its payloads in the engine
# actor's own process, and CUDA IPC handles cannot be opened by the process that made them (real sglang opens
# them in its scheduler process). There the loop runs against the real engine (docs/dev/validation/sglang.md).
@pytest.mark.skipif(torch.cuda.is_available(), reason="the fake sglang engine takes CPU weights only: on a CUDA "
                    "host the loop is run against real sglang")
def test_rl_loop_against_the_fake_sglang_engine(ray_cluster, tmp_path, monkeypatch):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.models import write_random_model
    from miles.train import run

    monkeypatch.syspath_prepend(FAKES)  # the driver's validation finds "sglang"
    monkeypatch.setenv("PYTHONPATH", FAKES + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                              else ""))  # and the engine actor imports it
    model = write_random_model(str(tmp_path / "model"), "llama-tiny", dtype="fp32")
    metrics = tmp_path / "metrics.jsonl"
    config = validate_args(parse_args([
        "--rollout-engine", "sglang", "--hf-checkpoint", model, "--num-train-ranks", "1", "--colocate",
        "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", str(tmp_path / "offload"), "--num-rollout", "3", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--micro-batch-size", "2",
        "--metrics-file", str(metrics)]))
    summary = run(config)
    (engine,) = summary.rollout_engines
    assert engine["description"].startswith("sglang 0.5.17 (sglang engine (in-process), tp 1")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    assert all(r["weight_handoff_bytes"] > 0 for r in records), records[-1]
