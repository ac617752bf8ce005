"""The compute engine of a train rank: what a backend (torch, megatron) implements, and nothing else.

A :class:`TrainEngine` builds its model and optimizer, computes log-probs, runs forward/backward with a
loss the rank hands it, steps the optimizer, and names its tensors for checkpoints, the weight handoff
and sleep. It never decides what a step, a save or a sleep is: :class:`miles.backends.rank.TrainRank`
owns those and calls the engine, the way verl's ``TrainingWorker`` hands ``loss_function`` to a
compute-only engine. An engine is built cheaply (nothing loaded) and filled in by :meth:`build_model`.

The rank sets :attr:`store` when the optimizer state streams to disk (after :meth:`build_model`): the
engine reads it to tell what lives on disk already and to rebuild weights from the store's masters.
"""

from __future__ import annotations

import abc
import contextlib
import random
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist

from miles.backends.step import route_counts
from miles.config import RunConfig
from miles.models import torch_dtype
from miles.offload.plan import OTHER, Group
from miles.rl.loss import micro_batch_inputs
from miles.routing import Routes
from miles_plugins.optimizers.nvme_stream import StoreGroup

_FINITE_CHECK_ELEMENTS = 1 << 27  # elements per isfinite call: its bool temporary stays at 128 MiB

# The loss the rank hands to forward_backward: (log-probs, collated micro-batch) -> (the loss to
# backpropagate, its float64 statistics); ``temperature`` and ``routing_replay`` (R3 on) are attributes of it,
# ``no_stats(device)`` and ``combine(total, part)`` fold the statistics over micro-batches; under R3 it takes the
# micro-batch's route counts as a third argument (miles.backends.step.PolicyLoss, route_counts).
LossFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def rows_routes(samples: Sequence[Any], indices: Sequence[int]) -> list[Routes]:
    """The routes of the micro-batch rows ``samples[indices]`` (R3), every row's: a sample without routes would
    train on the trainer's own routing unnoticed."""
    missing = [i for i in indices if samples[i].routes is None]
    if missing:
        raise ValueError(f"--use-rollout-routing-replay: samples {missing[:5]} carry no routes; the rollout engine "
                         "records them under the flag (a --load-debug-rollout-data recording made without it has "
                         "none: record again with the flag, or drop it)")
    return [samples[i].routes for i in indices]


def tensors_finite(tensors, device: torch.device) -> bool:
    """Whether every element of ``tensors`` is finite, checked in slices (isfinite of a whole buffer is a
    bool tensor of one byte per element: 9 GB at 9.2B params), with one device-to-host sync at the end."""
    finite = torch.ones((), dtype=torch.bool, device=device)
    for tensor in tensors:
        for part in tensor.detach().reshape(-1).split(_FINITE_CHECK_ELEMENTS):
            finite &= torch.isfinite(part).all()
    return bool(finite)


class TrainEngine(abc.ABC):
    """The compute of one data-parallel rank; the abstract methods are what a backend must provide, the
    others have the common behaviour a backend may replace.

    ``config``: the run's :class:`~miles.config.RunConfig`; ``rank``/``world_size``: this rank among the
    train ranks. :meth:`join_process_group` sets ``device``; :meth:`build_model` sets ``tokenizer`` and
    ``optimizer``."""

    def __init__(self, config: RunConfig, *, rank: int, world_size: int):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.dtype = torch_dtype(config.model.model_dtype)
        self.tokenizer = None
        self.optimizer = None
        self.store = None  # the optimizer-state store, when the rank streams the state (a store or a StoreGroup)

    # ---- setup --------------------------------------------------------------------------------
    def check_config(self) -> None:
        """Refuse, before anything is built, what this engine cannot run."""

    @abc.abstractmethod
    def join_process_group(self, rendezvous: str) -> str:
        """Set ``self.device``, join the process group(s) at ``tcp://<rendezvous>``; returns the collective
        backend's name."""

    def seed(self, seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)

    @abc.abstractmethod
    def build_model(self) -> str:
        """Build the model, ``self.tokenizer`` and ``self.optimizer`` in ``self.dtype`` on ``self.device``;
        returns the policy's description."""

    @abc.abstractmethod
    def policy_flops(self) -> Any:
        """The policy's FLOP coefficients (:class:`miles.sizing.flops.ModelFlops`), counted from the model as this
        engine builds it; ``ModelConfigError`` when they cannot be counted."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """This engine's part of the rank's ``info()`` (at least ``num_params``)."""

    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids the model embeds: ``0 .. vocab_size() - 1`` (a sample outside it is not trained on)."""

    def streamed_stores(self) -> list:
        """The stores this rank streams through (none when the state is resident)."""
        return StoreGroup.of(self.store).stores if self.store is not None else []

    # ---- training -----------------------------------------------------------------------------
    def zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @abc.abstractmethod
    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, L-1]``) of a collated micro-batch, with autograd."""

    def forward_backward(self, samples: list, advantages: list[float], micro_batches: list,
                         loss: LossFunction) -> list[float]:
        """Forward and backward of ``loss`` over the micro-batches of ``samples`` that ``micro_batches`` names
        (index lists, :mod:`miles.rl.batching`), one :meth:`logprobs` call each; the grads accumulate in the
        model. Returns the loss's statistics over the micro-batches. An engine whose forward is not one call per
        micro-batch (Megatron's pipeline schedule) replaces it."""
        stats = loss.no_stats(self.device)
        for indices, batch in micro_batch_inputs(samples, advantages, micro_batches,
                                                 pad_id=self.tokenizer.pad_token_id,  # load_policy guarantees one
                                                 device=self.device):
            replay = (self.route_replay(rows_routes(samples, indices), batch) if loss.routing_replay
                      else contextlib.nullcontext())
            # the backward inside the replay too: a layer recomputed in it must route as in the forward
            with replay as replaying:
                logp = self.logprobs(batch, loss.temperature)
                # read before the backward: a recomputed layer would count its tokens again
                counts = route_counts(*replaying.mismatch_counts()) if replaying is not None else None
                value, batch_stats = loss(logp, batch, counts)
                value.backward()
            stats = loss.combine(stats, batch_stats)
        return [float(v) for v in stats.cpu()]

    def route_replay(self, routes: list[Routes], batch: dict[str, torch.Tensor]) -> ContextManager:
        """R3: the context whose forwards (one per micro-batch) run ``batch``'s rows on ``routes`` (one per row);
        its value's ``mismatch_counts()`` are ``(differ, seen)`` per MoE layer, as
        :meth:`miles.routing.replay.RouteReplay.mismatch_counts`. An engine that replays routes implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not replay routes (--use-rollout-routing-replay)")

    def finish_backward(self) -> None:
        """After the micro-batches' backward passes: what the grads still need before the step."""

    @abc.abstractmethod
    def local_grads_finite(self) -> bool:
        """Whether every grad this rank holds after :meth:`finish_backward` is finite (the rank all-reduces
        the answer, so every rank skips a step that any rank's grads would poison)."""

    @abc.abstractmethod
    def trained_weights(self) -> list[torch.Tensor]:
        """The weights an optimizer step writes on this rank, as the model holds them (what a checkpoint and
        the rollout engines get): checked for non-finite values after every applied step."""

    @abc.abstractmethod
    def optimizer_step(self, rollout_id: int) -> float:
        """Reduce and clip the grads, step the optimizer (the streamed step when the store is bound);
        returns the global grad norm."""

    # ---- weights and checkpoints --------------------------------------------------------------
    @abc.abstractmethod
    def hf_weights(self) -> Iterator[tuple[str, Any]]:
        """The full weights as ``(HF-layout name, tensor on this rank's device)`` pairs (what the rollout
        engine's model expects), converted lazily; a collective when the engine shards weights over ranks
        (expert parallelism), so every rank iterates it. The engine must be awake."""

    def prepare_save(self) -> None:
        """Before a checkpoint is written (on every rank, awake): gather what the model's save needs."""

    @abc.abstractmethod
    def checkpoint_model(self):
        """What ``miles.checkpoint`` saves and loads as the model (``save_pretrained``, ``load_state_dict``)."""

    def checkpoint_optimizer(self):
        """What ``miles.checkpoint`` saves and loads as the optimizer (its state is the store's when bound)."""
        return self.optimizer

    # ---- sleep / wake -------------------------------------------------------------------------
    def before_offload(self) -> dict[str, Any]:
        """At sleep, before the offloader: what the engine drops itself; returns what to report."""
        return {}

    @abc.abstractmethod
    def offload_tensors(self) -> list[torch.Tensor]:
        """What offload-all's storage offloader backs up at sleep (torch_memory_saver pauses the whole process)."""

    def sleep_groups(self) -> list[tuple[Group, list[torch.Tensor]]]:
        """What the sleep plan decides over: groups of tensors with the sources that hold them too
        (:class:`miles.offload.plan.Group`), weights first. Default: :meth:`offload_tensors` as one group
        that nothing else holds."""
        from miles.backends.planned_sleep import make_groups

        return make_groups([("state", OTHER, self.offload_tensors(), {})])

    def weights_from_engine(self, engine_weights: list) -> int:
        """At wake: rewrite the groups :meth:`sleep_groups` marks ``engine_copy`` from ``engine_weights`` (the
        rollout engine's weights by reference, HF layout); returns the bytes copied. Only an engine that
        marks such a group implements it."""
        raise NotImplementedError(f"{type(self).__name__} marks no sleep group as held by the engine")

    def weights_from_masters(self) -> int:
        """At wake: rewrite the groups :meth:`sleep_groups` marks ``from_masters`` from the store's masters;
        returns the bytes read. Only an engine that marks such a group implements it."""
        raise NotImplementedError(f"{type(self).__name__} marks no sleep group as the store's masters")

    def asleep_report(self) -> dict[str, Any]:
        """At the end of sleep: what the engine reports of the device while asleep."""
        return {}

    def after_wake(self) -> dict[str, Any]:
        """At wake, after the offloader: what the engine restores itself; returns what to report."""
        return {}

    # ---- teardown -----------------------------------------------------------------------------
    def leave_process_group(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass

