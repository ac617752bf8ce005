"""Broadcast to an sglang engine, wired end to end on CPU: the RL loop on a local Ray cluster with
--rollout-engine sglang and --weight-sync distributed against the fake sglang of tests/fakes (the stand-in
``sglang`` package on the actors' PYTHONPATH). The driver routes the engine to the broadcast path, train rank 0
joins the weight-update group with the engine's fake ``sglang.Engine`` (joined as sglang joins: gloo), and every
rollout's weights are broadcast as sglang's own bucket (miles.weights.push); by reference the same loop gives
the same rewards."""

import json
import os

import pytest
import torch

pytestmark = pytest.mark.e2e

FAKES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fakes")


def _run(tmp_path, name, model, *extra):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    metrics = tmp_path / f"{name}.jsonl"
    config = validate_args(parse_args([
        "--rollout-engine", "sglang", "--hf-checkpoint", model, "--num-train-ranks", "1",
        "--offload-train-disk-dir", str(tmp_path / name), "--num-rollout", "2", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--micro-batch-size", "2",
        "--metrics-file", str(metrics), *extra]))
    summary = run(config)
    return summary, [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fake sglang engine takes CPU weights only")
def test_sglang_engine_fed_by_broadcast_gets_the_weights_the_reference_path_gives(ray_cluster, tmp_path,
                                                                                 monkeypatch):
    from miles.models import write_random_model

    monkeypatch.syspath_prepend(FAKES)
    monkeypatch.setenv("PYTHONPATH", FAKES + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                              else ""))
    model = write_random_model(str(tmp_path / "model"), "llama-tiny", dtype="fp32")
    summary, by_broadcast = _run(tmp_path, "dist", model, "--weight-sync", "distributed")
    (engine,) = summary.rollout_engines
    assert engine["weight_payload"] == "sglang_flattened_bucket" and engine["tp_size"] == 1
    _, by_reference = _run(tmp_path, "ipc", model, "--weight-sync", "ipc")
    assert [r["rollout_id"] for r in by_broadcast] == [0, 1]
    for a, b in zip(by_broadcast, by_reference):
        assert a["weight_handoff_bytes"] == b["weight_handoff_bytes"] > 0
        assert a["reward_mean"] == b["reward_mean"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9)
