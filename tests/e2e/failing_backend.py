"""A test-only training backend: the torch trainer, except that rank 1 raises in the train call of
rollout 1. Tests select it through the ``failing_backend`` fixture (tests/e2e/conftest.py)."""

from miles.backends.torch_backend.trainer import TorchTrainer


class FailingTrainer(TorchTrainer):
    def train(self, rollout_id, samples, advantages):
        if self.rank == 1 and rollout_id == 1:
            raise RuntimeError(f"injected fault in train on rank {self.rank} (rollout {rollout_id})")
        return super().train(rollout_id, samples, advantages)
