"""--deterministic-mode: a train rank turns on torch's deterministic algorithms (with cuBLAS's fixed workspace)
before it builds anything, and the step it trains is the step it trains without them (on CPU, where the
kernels are deterministic either way)."""

from __future__ import annotations

import os

import pytest
import torch

from miles.backends.torch_backend.trainer import TorchTrainer
from miles.config import parse_args
from miles.preflight import validate_args
from test_trainer_checkpoint import _params, _rendezvous, _samples, trainers  # noqa: F401  (trainers: a fixture)


@pytest.fixture
def restore_determinism(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(False)


def _trainer(tmp_path, trainers, *flags):
    config = validate_args(parse_args(["--tiny-model", "--offload-train-disk-dir", str(tmp_path / "offload"),
                                       *flags]))
    trainer = TorchTrainer(config, rank=0, world_size=1)
    trainers.append(trainer)
    trainer.init(_rendezvous())
    return trainer


def test_the_flag_defaults_off():
    assert validate_args(parse_args(["--tiny-model"])).training.deterministic_mode is False


def test_a_rank_in_deterministic_mode_trains_the_same_step(tmp_path, trainers, restore_determinism):
    samples, advantages = _samples()
    plain = _trainer(tmp_path / "plain", trainers)
    assert not torch.are_deterministic_algorithms_enabled()
    plain_metrics = plain.train(0, samples, advantages)
    strict = _trainer(tmp_path / "strict", trainers, "--deterministic-mode")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    strict_metrics = strict.train(0, samples, advantages)
    assert strict_metrics["loss"] == plain_metrics["loss"]
    assert all(torch.equal(a, b) for a, b in zip(_params(plain).values(), _params(strict).values(), strict=True))
