"""The torch backend's train step under --use-dynamic-batch-size: the same step as fixed micro-batches
(loss, grad norm, weights, up to fp32 summation order), and the plan's shape in the metrics."""

from __future__ import annotations

import pytest
import torch

from miles.backends.torch_backend.trainer import TorchTrainer
from miles.config import parse_args
from miles.preflight import validate_args
from test_trainer_checkpoint import _params, _rendezvous, _samples, trainers  # noqa: F401  (trainers: a fixture)


def _trainer(tmp_path, trainers, *flags):
    config = validate_args(parse_args(["--tiny-model", "--offload-train-disk-dir", str(tmp_path / "offload"),
                                       "--metrics-file", str(tmp_path / "metrics.jsonl"), *flags]))
    trainer = TorchTrainer(config, rank=0, world_size=1)
    trainers.append(trainer)
    trainer.init(_rendezvous())
    return trainer


def test_dynamic_batches_train_the_same_step(tmp_path, trainers):
    samples, advantages = _samples()  # rows of 5, 7, 9, 8 tokens
    fixed = _trainer(tmp_path / "fixed", trainers, "--micro-batch-size", "1")
    dynamic = _trainer(tmp_path / "dynamic", trainers, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "18")
    m_fixed = fixed.train(0, samples, advantages)
    m_dynamic = dynamic.train(0, samples, advantages)
    assert (m_fixed["micro_batches"], m_dynamic["micro_batches"]) == (4, 2)  # [9, 8] and [7, 5]: 18 + 14 tokens
    assert (m_fixed["padded_tokens"], m_dynamic["padded_tokens"]) == (29, 32)
    assert m_dynamic["sequence_tokens"] == 29 and m_dynamic["step_skipped"] is None
    assert m_dynamic["loss"] == pytest.approx(m_fixed["loss"], rel=1e-5)
    assert m_dynamic["grad_norm"] == pytest.approx(m_fixed["grad_norm"], rel=1e-5)
    fixed_weights, dynamic_weights = _params(fixed), _params(dynamic)
    for name, value in fixed_weights.items():
        torch.testing.assert_close(dynamic_weights[name], value, rtol=1e-5, atol=1e-6)


def test_the_step_reports_its_model_flops_and_no_mfu_on_cpu(tmp_path, trainers):
    from miles.rl.batching import sample_lengths
    from miles.sizing.flops import model_flops, train_flops

    samples, advantages = _samples()
    trainer = _trainer(tmp_path, trainers)
    metrics = trainer.train(0, samples, advantages)
    expected = train_flops(model_flops(trainer.engine.model.config.to_dict()), sample_lengths(samples))
    assert metrics["model_flops"] == expected > 0
    assert metrics["device_peak_flops"] is None and metrics["train_mfu"] is None
