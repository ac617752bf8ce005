"""Test-only training backends: the torch trainer with one injected failure each, selected in
tests/e2e/test_skipped_steps_e2e.py like the ``failing_backend`` fixture selects its backend.

``PoisonedLogprobTrainer``: rank 0's samples of rollouts 1 and 2 carry a NaN log-prob, as a rollout engine or
server can return one. ``AlwaysPoisonedLogprobTrainer``: the same in every rollout (no step is ever applied).
``InfiniteLrTrainer``: from rollout 2 on, rank 0 steps with lr = inf (what ``--lr inf`` did before validation
refused it): its shard of the weights turns into NaN, and the step's all-gather hands that to every rank."""

from miles.backends.torch_backend.trainer import TorchTrainer

POISONED_ROLLOUTS = (1, 2)
INFINITE_LR_FROM = 2


class PoisonedLogprobTrainer(TorchTrainer):
    def poisoned(self, rollout_id: int) -> bool:
        return rollout_id in POISONED_ROLLOUTS

    def train(self, rollout_id, samples, advantages):
        if self.rank == 0 and self.poisoned(rollout_id):
            samples[0].response_logprobs[0] = float("nan")
        return super().train(rollout_id, samples, advantages)


class AlwaysPoisonedLogprobTrainer(PoisonedLogprobTrainer):
    def poisoned(self, rollout_id: int) -> bool:
        return True


class InfiniteLrTrainer(TorchTrainer):
    def train(self, rollout_id, samples, advantages):
        if self.rank == 0 and rollout_id >= INFINITE_LR_FROM:
            for group in self.engine.optimizer.param_groups:
                group["lr"] = float("inf")
        return super().train(rollout_id, samples, advantages)
