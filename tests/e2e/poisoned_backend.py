"""A test-only training backend: the torch trainer, except that rank 0's samples of rollouts 1 and 2
carry a NaN log-prob, as a rollout engine or server can return one. Selected in
tests/e2e/test_skipped_steps_e2e.py like the ``failing_backend`` fixture selects its backend."""

from miles.backends.torch_backend.trainer import TorchTrainer

POISONED_ROLLOUTS = (1, 2)


class PoisonedLogprobTrainer(TorchTrainer):
    def train(self, rollout_id, samples, advantages):
        if self.rank == 0 and rollout_id in POISONED_ROLLOUTS:
            samples[0].response_logprobs[0] = float("nan")
        return super().train(rollout_id, samples, advantages)
