"""The pieces of one train step, as :meth:`miles.backends.rank.TrainRank.train` strings them together.

    step = plan_step(samples, advantages, ...)       # micro-batch plan, the input check, one all-reduce
    loss = PolicyLoss.of(config, num_tokens)         # what the rank hands the engine's forward_backward
    skipped = input_skip_reason(step, rank)          # None, or why no rank computes anything
    stats = reduce_over_ranks(engine_stats, all_reduce)   # the loss's statistics over the ranks
    metrics = step_metrics(...)                      # the step's metrics dict (every key, one place)

The skip rule: the step is skipped on every rank when any rank's samples are not valid training input
(:func:`~miles.rl.loss.training_input_problem`: nothing is computed) or when any rank's grads are not
finite (:data:`NON_FINITE_GRADS`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from miles.config import RunConfig
from miles.process_memory import peak_rss_bytes
from miles.rl.batching import padded_tokens, plan_micro_batches, sample_lengths
from miles.rl.loss import TruncatedImportanceSampling, mismatch_stats, policy_gradient_loss, training_input_problem
from miles.sizing.flops import mfu
from miles_plugins.optimizers.nvme_stream import StepStats

NON_FINITE_GRADS = "non-finite gradients"


# The float64 statistics the loss returns for each micro-batch, in this order: the LOSS_SUMS add up over the
# micro-batches and the ranks, the LOSS_MAXIMA take the largest (PolicyLoss.combine, reduce_over_ranks). The
# ROUTE_SUMS (under --use-rollout-routing-replay) are the engine's route replay counts (route_counts below).
ROUTE_SUMS = ("replayed_tokens", "route_differ_first", "route_differ_last")
LOSS_SUMS = ("loss", "clipped_tokens", "logprob_abs_diff", "kl", "tis_weight", "tis_clipped_tokens", *ROUTE_SUMS)
LOSS_MAXIMA = ("logprob_abs_diff_max",)


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """The step's policy-gradient loss (:func:`~miles.rl.loss.policy_gradient_loss`: GRPO or GSPO, TIS
    optional), handed by the rank to its engine: called on a micro-batch's log-probs and its collated
    batch, it returns the loss to backpropagate (the token mean over the whole rollout: every micro-batch
    divides by ``num_tokens``) and its float64 statistics (:data:`LOSS_SUMS` then :data:`LOSS_MAXIMA`),
    which the engine folds over its micro-batches with :meth:`combine`, starting from :meth:`no_stats`.
    Under R3 the engine hands in each micro-batch's route replay counts too (:func:`route_counts`)."""

    eps_clip: float
    temperature: float
    num_tokens: float
    advantage_estimator: str
    tis: Optional[TruncatedImportanceSampling]  # None: --use-tis is off
    routing_replay: bool = False  # --use-rollout-routing-replay

    @classmethod
    def of(cls, config: RunConfig, num_tokens: float) -> "PolicyLoss":
        """The loss's knobs from the config, exactly as given (``--eps-clip 0`` is 0)."""
        training = config.training
        tis = (TruncatedImportanceSampling(low=training.tis_clip_low, high=training.tis_clip) if training.use_tis
               else None)
        return cls(eps_clip=training.eps_clip, temperature=config.rollout.rollout_temperature,
                   num_tokens=num_tokens, advantage_estimator=training.advantage_estimator, tis=tis,
                   routing_replay=training.use_rollout_routing_replay)

    def __call__(self, logp: torch.Tensor, batch: dict[str, torch.Tensor],
                 routes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``routes``: the micro-batch's :func:`route_counts` under R3 (None: zeros)."""
        mask = batch["loss_mask"]
        loss, m = policy_gradient_loss(logp, batch["rollout_logprobs"], batch["advantages"], mask,
                                       eps_clip=self.eps_clip, num_tokens=self.num_tokens,
                                       advantage_estimator=self.advantage_estimator, tis=self.tis)
        with torch.no_grad():
            tokens = mask.sum().double()
            mismatch = mismatch_stats(logp, batch["rollout_logprobs"], mask)
            tis = ([m["tis_weight_mean"].double() * tokens, m["tis_clipfrac"].double() * tokens]
                   if self.tis is not None else [tokens.new_zeros(())] * 2)
            routes = tokens.new_zeros(len(ROUTE_SUMS)) if routes is None else routes.to(tokens)
            stats = torch.cat([torch.stack([loss.detach().double(), m["clipfrac"].double() * tokens,
                                            mismatch["abs_diff_sum"], mismatch["kl_sum"], *tis]),
                               routes, mismatch["abs_diff_max"].view(1)])
        return loss, stats

    @staticmethod
    def no_stats(device: Any) -> torch.Tensor:
        """The statistics of no micro-batch (every maximum is of values >= 0)."""
        return torch.zeros(len(LOSS_SUMS) + len(LOSS_MAXIMA), dtype=torch.float64, device=device)

    @staticmethod
    def route_stats(counts: torch.Tensor) -> torch.Tensor:
        """The statistics of a forward's :func:`route_counts` alone: what a pipeline stage adds for its MoE layers
        (the loss's own live on the last stage)."""
        stats = PolicyLoss.no_stats(counts.device)
        start = LOSS_SUMS.index(ROUTE_SUMS[0])
        stats[start:start + len(ROUTE_SUMS)] = counts.double()
        return stats

    @staticmethod
    def combine(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """The statistics of two sets of micro-batches together."""
        n = len(LOSS_SUMS)
        return torch.cat([total[:n] + part[:n], torch.maximum(total[n:], part[n:])])

    @staticmethod
    def skipped_stats() -> list[float]:
        """The statistics of a step no rank computed: NaN, nothing was measured."""
        return [math.nan] * (len(LOSS_SUMS) + len(LOSS_MAXIMA))

    def metrics(self, stats: list[float], tokens: float, world_size: int) -> dict[str, Any]:
        """The step's loss and mismatch metrics from the statistics reduced over the ranks
        (:func:`reduce_over_ranks`); ``tokens``: the rollout's response tokens, as the ranks counted them."""
        sums = dict(zip(LOSS_SUMS, stats))
        maxima = dict(zip(LOSS_MAXIMA, stats[len(LOSS_SUMS):]))
        metrics = {
            "loss": sums["loss"] / world_size,  # each rank's sum is its part of the global token mean x world
            "clipfrac": sums["clipped_tokens"] / tokens,
            # the trainer's log-probs against the rollout engine's on the response tokens (before the update)
            "train_rollout_logprob_abs_diff": sums["logprob_abs_diff"] / tokens,
            "train_rollout_logprob_abs_diff_max": maxima["logprob_abs_diff_max"],
            "train_rollout_kl": sums["kl"] / tokens,  # k3 estimate of KL(rollout || trainer) per token
        }
        if self.tis is not None:
            metrics["tis_weight_mean"] = sums["tis_weight"] / tokens
            metrics["tis_clipfrac"] = sums["tis_clipped_tokens"] / tokens
        if self.routing_replay:  # the share of replayed tokens whose natural route differed (route_counts)
            replayed = max(1.0, sums["replayed_tokens"])
            metrics["routing_replay_mismatch_first"] = sums["route_differ_first"] / replayed
            metrics["routing_replay_mismatch_last"] = sums["route_differ_last"] / replayed
        return metrics


def route_counts(differ: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """The :data:`ROUTE_SUMS` of a route replay's per-MoE-layer counts (model order): ``seen[l]`` replayed
    tokens of layer ``l``, ``differ[l]`` of them whose natural top-k set was another (every layer sees the same
    tokens, so the first layer's count is the tokens')."""
    return torch.stack([seen[0], differ[0], differ[-1]]).double()


def reduce_over_ranks(stats: list[float], all_reduce: Callable[..., list[float]]) -> list[float]:
    """A rank's loss statistics reduced over the ranks: the sums summed, the maxima maxed
    (``all_reduce(values, op)``: :meth:`miles.backends.rank.TrainRank.all_reduce`)."""
    n = len(LOSS_SUMS)
    return all_reduce(stats[:n]) + all_reduce(stats[n:], op=dist.ReduceOp.MAX)


@dataclasses.dataclass(frozen=True)
class StepInput:
    """What the ranks agreed on before computing: this rank's micro-batches (as many as the rank with the
    most), the rollout's response tokens, and whether any rank's samples are not valid input."""

    lengths: list[int]
    micro_batches: list
    local_tokens: float
    global_tokens: float
    problem: Optional[str]  # this rank's reason not to train on its samples
    bad_input_anywhere: bool

    @property
    def tokens(self) -> float:
        return max(1.0, self.global_tokens)


def plan_step(samples: list, advantages: list[float], config: RunConfig, vocab_size: int, rank: int,
              world_size: int, all_reduce: Callable[[list[float]], list[float]]) -> StepInput:
    """Plan this rank's micro-batches and check its input, then agree with the other ranks in one
    all-reduce: the rollout's token count, whether any rank's input is bad, and the micro-batch count
    (one slot per rank; ranks take the largest, since expert parallelism's forward is a collective)."""
    local_tokens = float(sum(len(s.response_ids) for s in samples))
    problem = training_input_problem(samples, advantages, vocab_size)
    lengths = sample_lengths(samples)
    micro_batches = plan_micro_batches(lengths, config.training)
    global_tokens, bad_input_ranks, *counts = all_reduce(
        [local_tokens, float(problem is not None),
         *(float(len(micro_batches)) if r == rank else 0.0 for r in range(world_size))])
    if max(counts) > len(micro_batches):
        micro_batches = plan_micro_batches(lengths, config.training, min_batches=int(max(counts)))
    return StepInput(lengths, micro_batches, local_tokens, global_tokens, problem, bool(bad_input_ranks))


def input_skip_reason(step: StepInput, rank: int) -> Optional[str]:
    """Why no rank computes this step (None: every rank's samples are valid input)."""
    if not step.bad_input_anywhere:
        return None
    return f"rank {rank}: {step.problem}" if step.problem else "another rank's samples are not valid input"


def reset_device_peak(device: torch.device) -> None:
    """Start measuring a phase's own device peak (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak(device: torch.device) -> Optional[int]:
    """The device peak since :func:`reset_device_peak` (None off CUDA)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one train call measured, for :func:`step_metrics`."""

    sums: list[float]  # the loss's statistics, reduced over the ranks (reduce_over_ranks)
    grad_norm: float
    skipped: Optional[str]
    weights_finite: bool
    forward_backward_seconds: float
    forward_backward_peak: Optional[int]
    optimizer_step_seconds: float
    optimizer_step_peak: Optional[int]
    flops: Optional[float]  # the model's arithmetic over the real tokens (None when nothing was computed)
    peak_flops: Optional[float]
    train_seconds: float


def step_metrics(rank: int, world_size: int, samples: list, step: StepInput, loss: PolicyLoss,
                 result: StepResult) -> dict[str, Any]:
    """The step's metrics (without the streamed store's, :func:`stream_step_metrics`)."""
    flops, seconds = result.flops, result.forward_backward_seconds
    metrics: dict[str, Any] = {
        "rank": rank,
        **loss.metrics(result.sums, step.tokens, world_size),
        "grad_norm": result.grad_norm,
        "step_skipped": result.skipped,
        "weights_finite": result.weights_finite,
        "samples": len(samples),
        "response_tokens": int(step.local_tokens),
        "micro_batches": len(step.micro_batches),
        # what the forward passes ran: rows x the longest row of each micro-batch, and the real tokens
        "padded_tokens": sum(padded_tokens(step.lengths, b) for b in step.micro_batches),
        "sequence_tokens": sum(step.lengths),
        "forward_backward_seconds": seconds,
        "model_flops": flops,
        "device_peak_flops": result.peak_flops,
        "train_mfu": mfu(flops, result.peak_flops, seconds) if flops is not None else None,
        "optimizer_step_seconds": result.optimizer_step_seconds,
        "train_seconds": result.train_seconds,
        "host_rss_peak_bytes": peak_rss_bytes(),  # this rank's process, since it started
    }
    if result.forward_backward_peak is not None:  # on CUDA: each phase's own device peak
        metrics["forward_backward_device_peak_bytes"] = result.forward_backward_peak
        metrics["optimizer_step_device_peak_bytes"] = result.optimizer_step_peak
    return metrics


def stream_step_metrics(stores: list, stepped: bool = True) -> dict[str, Any]:
    """The last optimizer step's streamed I/O over a rank's stores (one for the torch backend, one per
    chained optimizer for megatron): the ``stream_*`` metrics of a train step. ``stepped=False``: this
    train call skipped its step, so nothing streamed (the stores' last step is an earlier one's)."""
    steps = [s.stats.last_step if stepped else StepStats() for s in stores]
    return {"stream_bytes_read": sum(int(t.bytes_read) for t in steps),
            "stream_bytes_written": sum(int(t.bytes_written) for t in steps),
            # of those, what the disk moved (the rest: the host tier or still resident), and what was read
            # ahead into the host tier since the previous step (after a load)
            "stream_disk_bytes_read": sum(int(t.disk_bytes_read) for t in steps),
            "stream_disk_bytes_written": sum(int(t.disk_bytes_written) for t in steps),
            "stream_tier_fill_bytes": sum(int(t.tier_fill_bytes) for t in steps),
            "stream_seconds": sum(float(t.wall_seconds) for t in steps),
            "stream_io_seconds": sum(float(t.io_seconds) for t in steps),
            "stream_buckets": sum(int(t.buckets) for t in steps),
            "stream_prefetched_buckets": sum(int(t.prefetched_buckets) for t in steps),
            "stream_peak_resident_bytes": max(int(s.stats.peak_resident_bytes) for s in stores),
            # where the state lives: buckets in host RAM only, and the bucket files on disk
            "stream_ram_state_bytes": sum(int(s.stats.ram_state_bytes) for s in stores),
            "stream_disk_state_bytes": sum(int(s.stats.state_bytes - s.stats.ram_state_bytes) for s in stores)}
