"""The training-backend template: what one train actor (one data-parallel rank) drives.

:class:`TrainBackend` runs what every backend does the same way, in the manner of torch.optim's
``Optimizer`` or verl's ``BaseEngine``: the setup sequence of ``init``, the loop of a train call (token
counts all-reduced, grads zeroed, the store's read-ahead, the policy gradient over micro-batches, the
optimizer step, the step's metrics), sleep/wake around the offloader, the checkpoint calls and shutdown.
A backend fills in only its own part, the hooks below ``# ---- hooks``: how it joins the process group,
builds the model and optimizer, computes log-probs, steps the optimizer, what it offloads, how it hands
its weights over. :data:`miles.config.backends.BACKENDS` names the backends by ``--train-backend`` value
as ``"module:Class"`` strings, so choosing a backend imports nothing until an actor builds it
(megatron-core, for one, imports only on GPU machines that have it).

Lifecycle, as :class:`miles.ray.train_actor.TrainActor` calls it::

    trainer = Backend(config, rank=r, world_size=n, cell=c, rank_dir=d)   # cheap: nothing loaded yet
    info = trainer.init("127.0.0.1:29500")      # process group at host:port, model, optimizer, store, offloader
    metrics = trainer.train(rollout_id, samples, advantages)              # one optimizer step
    trainer.join_weight_group(spec)             # the source of the weight-update group (engines elsewhere)
    trainer.join_payload_groups(groups)         # the ranks feeding one sglang engine's TP ranks, each a group
    stats = trainer.push_weights(ipc_engines, group_engines, payload, tp_size, peers)   # as the engines consume them
    trainer.save(base, wait); trainer.finish_save(); trainer.load(base, load_optimizer)
    trainer.sleep(); trainer.wake()             # idempotent; dicts of offload stats
    trainer.shutdown()                          # closes files, removes rank_dir; idempotent

The rank directory is held under a :class:`~miles_plugins.host.ownership.DirectoryLock`
from init to shutdown (:meth:`TrainBackend.claim_rank_dir` / :meth:`TrainBackend.release_rank_dir`),
so two actors, or two runs, never write into one; shutdown removes it only if this run made it.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
import logging
import math
import os
import random
import time
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from miles import checkpoint
from miles.config import RunConfig, store_config
from miles.models import torch_dtype
from miles.offload import make_offloader
from miles.offload.plan import OTHER, EngineNeeds, Group, allocator_cache_may_stay
from miles.offload.planned import PlannedOffloader
from miles.process_memory import peak_rss_bytes
from miles.rl.batching import padded_tokens, plan_micro_batches, sample_lengths
from miles.sizing.flops import mfu, model_flops, peak_bf16_flops, train_flops
from miles.sizing.model_params import ModelConfigError
from miles.rl.loss import accumulate_policy_gradient, training_input_problem
from miles_plugins.optimizers.nvme_stream import StepStats, StoreGroup, stream_optimizer_state
from miles_plugins.host.ownership import DirectoryLock, claim_directory, remove_created

logger = logging.getLogger(__name__)

_FINITE_CHECK_ELEMENTS = 1 << 27  # elements per isfinite call: its bool temporary stays at 128 MiB


class NonFiniteWeightsError(RuntimeError):
    """An applied optimizer step left a non-finite weight on some rank: what this rank holds must reach
    neither a checkpoint nor a rollout engine (the run stops; the last good checkpoint stays the latest)."""


def tensors_finite(tensors, device: torch.device) -> bool:
    """Whether every element of ``tensors`` is finite, checked in slices (isfinite of a whole buffer is a
    bool tensor of one byte per element: 9 GB at 9.2B params), with one device-to-host sync at the end."""
    finite = torch.ones((), dtype=torch.bool, device=device)
    for tensor in tensors:
        for part in tensor.detach().reshape(-1).split(_FINITE_CHECK_ELEMENTS):
            finite &= torch.isfinite(part).all()
    return bool(finite)


def resolve_backend(spec: str) -> type["TrainBackend"]:
    """The class named by a ``"module:Class"`` spec (a value of :data:`miles.config.backends.BACKENDS`),
    imported now."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"backend spec {spec!r} is not of the form 'module:Class'")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, TrainBackend)):
        raise TypeError(f"backend spec {spec!r} names {cls!r}, which does not implement miles.backends.base.TrainBackend")
    return cls


def use_deterministic_algorithms() -> None:
    """``--deterministic-mode``: torch's deterministic algorithms in this process, warning (not failing) on an
    op that has none; cuBLAS needs its fixed workspace before the first matmul creates its handle."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    logger.info("deterministic mode: torch's deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG=%s)",
                os.environ["CUBLAS_WORKSPACE_CONFIG"])


def offload_stats(stats) -> dict[str, Any]:
    """An :class:`~miles.offload.OffloadStats` as the plain dict sleep/wake return."""
    return {"action": stats.action, "target": stats.target, "skipped": stats.skipped, "storages": stats.storages,
            "bytes": stats.bytes, "seconds": stats.seconds, "path": stats.path}


def loss_arguments(config: RunConfig) -> dict[str, float]:
    """The policy-gradient loss's knobs from the config, exactly as given (``--eps-clip 0`` is 0)."""
    return {"eps_clip": config.training.eps_clip, "temperature": config.rollout.rollout_temperature}


def store_info(stores: list) -> dict[str, Any]:
    """What ``info()["store"]`` reports of a rank's stores (one for torch, one per chained member for megatron)."""
    return {"num_buckets": sum(s.stats.num_buckets for s in stores),
            "state_bytes": sum(s.stats.state_bytes for s in stores),
            "paths": [s.path for s in stores], "relative_dirs": [s.relative_dir for s in stores]}


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


def settle_store_for_sleep(store, flush: bool) -> dict[str, Any]:
    """Before the trainer sleeps: the streamed state's store gives back every device buffer it holds.
    ``flush`` (--stream-optimizer-state-flush-at-sleep) also waits until every write-back is on disk;
    otherwise the disk writes land while the rollout engine generates (the store's files live apart from
    the offload's, so sleep does not need them settled) and the next step waits for what is left.
    Returns the seconds the sleep waited, for the per-rollout exposed I/O."""
    if store is None:
        return {}
    start = time.perf_counter()
    if flush:
        store.flush()
    else:
        store.release_device()
    return {"store_wait_seconds": time.perf_counter() - start}


class TrainBackend(abc.ABC):
    """One data-parallel rank of a training backend: the template; a backend implements the hooks.

    ``config``: the run's :class:`~miles.config.RunConfig`. ``rank``/``world_size``: this rank among the
    train actors of cell ``cell``. ``rank_dir``: this rank's private directory (``cell<i>_rank<j>``;
    None when no disk mechanism is on); the backend claims it at init (:meth:`claim_rank_dir`) and
    releases it at shutdown (:meth:`release_rank_dir`).
    """

    def __init__(self, config: RunConfig, *, rank: int, world_size: int, cell: int = 0,
                 rank_dir: Optional[str] = None, ranks_on_node: Optional[int] = None):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        # train ranks of this run on this rank's node (they share its host RAM); None: all of them
        self.ranks_on_node = ranks_on_node or world_size
        self.cell = cell
        self.rank_dir = rank_dir
        self.rank_dir_lock: Optional[DirectoryLock] = None
        self.device = torch.device("cpu")
        self.dtype = torch_dtype(config.model.model_dtype)
        self.tokenizer = None
        self.optimizer = None
        # the optimizer-state store when streaming: what stream_optimizer_state returned (a store, or the
        # StoreGroup of a chained optimizer's stores)
        self.store = None
        self.offloader = None  # the sleep/wake offloader when --offload-train (miles.offload)
        self.weight_group = None  # the weight-update group, when this rank is its source
        self.payload_groups: dict[tuple[int, ...], Any] = {}  # per engine fed by several ranks: their group
        self.engine_needs = EngineNeeds()  # what the last sleep was told of the colocated engine
        self.engine_weights = None  # at wake: the engine's weights by reference (miles.weights.readback)
        self.init_info: dict[str, Any] = {}
        # the rollout whose applied step left a non-finite weight (on any rank): nothing is saved or pushed after it
        self.non_finite_weights_since: Optional[int] = None
        self.flops = None  # the policy's ModelFlops (miles.sizing.flops), None when its config cannot be counted
        self.peak_flops: Optional[float] = None  # the device's bf16 peak FLOP/s, None on CPU or unknown GPUs
        self.closed = False

    # ---- setup --------------------------------------------------------------------------------
    def init(self, rendezvous: str) -> dict[str, Any]:
        """Join the process group at ``tcp://<rendezvous>`` (``host:port`` on rank 0's node), build model
        and optimizer, bind the store, make the offloader; returns :meth:`info`."""
        config = self.config
        self.check_config()
        if config.training.deterministic_mode:
            use_deterministic_algorithms()
        torch.set_num_threads(config.cluster.num_cpus_per_rank)
        process_group_backend = self.join_process_group(rendezvous)
        self.claim_rank_dir()
        self.seed(config.training.seed)
        description = self.build_model()
        self.flops, self.peak_flops = self.count_flops()
        if config.optimizer.stream_optimizer_state_to_disk:
            self.store = stream_optimizer_state(self.optimizer,
                                                config=store_config(config, self.rank, self.ranks_on_node))
        self.offloader = self.make_offloader()
        self.init_info = {"rank": self.rank, "pid": os.getpid(), "device": str(self.device),
                          "backend": process_group_backend,
                          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # set per actor by Ray
                          "dtype": str(self.dtype).replace("torch.", ""), "description": description,
                          "rank_dir": self.rank_dir, "offload": type(self.offloader).__name__ if self.offloader else None,
                          "store": store_info(self.streamed_stores()) if self.store is not None else None,
                          **self.describe()}
        return self.info()

    def info(self) -> dict[str, Any]:
        """What this rank runs: rank, pid, device, dtype, num_params, description, offloader, store info."""
        return dict(self.init_info)

    def seed(self, seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)

    def make_offloader(self):
        offload = self.config.offload
        if not offload.offload_train:
            return None
        if self.config.trainer_offload_to_disk and self.rank_dir is None:
            raise RuntimeError("--offload-train-target=disk needs the rank directory: build the trainer with "
                               "rank_dir=config.paths.rank_dir(cell, rank)")
        if not offload.offload_all:  # the sleep plan: what moves is decided at each sleep (miles.offload.plan)
            return PlannedOffloader(offload.target, self.rank_dir, offload.offload_train_disk_chunk_mb,
                                    run_id=self.config.run_id, lock=self.rank_dir_lock)
        return make_offloader(offload.offload_train_target, self.rank_dir, offload.offload_train_disk_chunk_mb,
                              self.device.type, run_id=self.config.run_id, lock=self.rank_dir_lock)

    def count_flops(self) -> tuple[Any, Optional[float]]:
        """The policy's FLOP coefficients and the device's peak, for the step's ``train_mfu``."""
        peak = peak_bf16_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        try:
            return model_flops(self.policy_config(), name="the policy"), peak
        except ModelConfigError as e:
            logger.warning("rank %d: model FLOPs not counted, so no train_mfu: %s", self.rank, e)
            return None, peak

    def streamed_stores(self) -> list:
        """The stores this rank streams through (none when the state is resident)."""
        return StoreGroup.of(self.store).stores if self.store is not None else []

    # ---- training -----------------------------------------------------------------------------
    def all_reduce(self, values: list[float]) -> list[float]:
        """``values`` summed over the data-parallel ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(t)
        return [float(v) for v in t.cpu()]

    def train(self, rollout_id: int, samples: list, advantages: list[float]) -> dict[str, Any]:
        """One optimizer step over this rank's share of a rollout; returns the step's metrics.

        ``samples`` carry ``prompt_ids``, ``response_ids``, ``response_logprobs`` (the rollout engine's
        log-probs); ``advantages[i]`` belongs to ``samples[i]``. The loss is the token mean over the whole
        rollout (all ranks): each rank divides by the global token count / world size, and the DP grad
        average makes the sum.

        The step is skipped on every rank, leaving weights and optimizer state (the store's included)
        untouched bit for bit, when any rank's samples are not valid training input
        (:func:`~miles.rl.loss.training_input_problem`: nothing is computed) or when any rank's grads are
        not finite; ``metrics["step_skipped"]`` then says why (None when the step was applied).

        After an applied step every rank checks its trained weights (one all-reduce: all ranks agree);
        ``metrics["weights_finite"]`` is False when any rank holds a non-finite weight, and from then on this
        trainer refuses to train, save or hand its weights over (:class:`NonFiniteWeightsError`).
        """
        self.refuse_non_finite_weights("train on them")
        start = time.perf_counter()
        loss_args = loss_arguments(self.config)
        local_tokens = float(sum(len(s.response_ids) for s in samples))
        problem = training_input_problem(samples, advantages, self.vocab_size())
        lengths = sample_lengths(samples)
        micro_batches = plan_micro_batches(lengths, self.config.training)
        # with the micro-batch count of every rank (one slot each): ranks agree on the largest, since expert
        # parallelism's forward is a collective
        global_tokens, _, bad_input_ranks, *counts = self.all_reduce(
            [local_tokens, float(len(samples)), float(problem is not None),
             *(float(len(micro_batches)) if r == self.rank else 0.0 for r in range(self.world_size))])
        if max(counts) > len(micro_batches):
            micro_batches = plan_micro_batches(lengths, self.config.training, min_batches=int(max(counts)))
        num_tokens = max(1.0, global_tokens) / self.world_size

        self.zero_grads()
        if self.store is not None:  # read-ahead: the disk is idle during forward/backward
            self.store.prefetch()
        cuda = self.device.type == "cuda"
        if cuda:  # the forward/backward's own device peak: weights, grads, activations, logits
            torch.cuda.reset_peak_memory_stats(self.device)
        fwd_bwd = time.perf_counter()
        if bad_input_ranks:
            sums = [math.nan, 0.0, math.nan]
            skipped = f"rank {self.rank}: {problem}" if problem else "another rank's samples are not valid input"
        else:
            sums = self.policy_gradient(samples, advantages,
                                        pad_id=self.tokenizer.pad_token_id,  # load_policy guarantees one
                                        micro_batches=micro_batches,
                                        device=self.device, eps_clip=loss_args["eps_clip"],
                                        temperature=loss_args["temperature"], num_tokens=num_tokens)
            self.finish_backward()
            grads_finite = self.all_reduce([0.0 if self.local_grads_finite() else 1.0])[0] == 0.0
            skipped = None if grads_finite else "non-finite gradients"
        fwd_bwd = time.perf_counter() - fwd_bwd
        fwd_bwd_peak = torch.cuda.max_memory_allocated(self.device) if cuda else None
        # the model's arithmetic over the real tokens (none when nothing was computed)
        flops = train_flops(self.flops, lengths) if self.flops is not None and not bad_input_ranks else None

        if cuda:  # the step's own device peak: weights, grads and what the optimizer (or store) holds
            torch.cuda.reset_peak_memory_stats(self.device)
        step_start = time.perf_counter()
        weights_finite = True  # a skipped step leaves the weights as the last checked step left them
        if skipped is None:
            grad_norm = self.optimizer_step(rollout_id)
            weights_finite = self.weights_finite_on_every_rank()
            if not weights_finite:
                self.non_finite_weights_since = rollout_id
                logger.error("rank %d: rollout %d: the optimizer step left non-finite weights (grad norm %g); they "
                             "will not be saved or handed to the rollout engines", self.rank, rollout_id, grad_norm)
        else:
            self.zero_grads()  # nothing of this step may reach the weights, the state, or the sleep's backup
            grad_norm = math.nan
            logger.warning("rank %d: rollout %d: optimizer step skipped (%s): weights and optimizer state are "
                           "unchanged", self.rank, rollout_id, skipped)
        step_seconds = time.perf_counter() - step_start

        loss_sum, clipped, absdiff = self.all_reduce(sums)
        tokens = max(1.0, global_tokens)
        metrics: dict[str, Any] = {
            "rank": self.rank,
            "loss": loss_sum / self.world_size,  # each rank's sum is its part of the global token mean x world
            "clipfrac": clipped / tokens,
            "train_rollout_logprob_abs_diff": absdiff / tokens,
            "grad_norm": grad_norm,
            "step_skipped": skipped,
            "weights_finite": weights_finite,
            "samples": len(samples),
            "response_tokens": int(local_tokens),
            "micro_batches": len(micro_batches),
            # what the forward passes ran: rows x the longest row of each micro-batch, and the real tokens
            "padded_tokens": sum(padded_tokens(lengths, b) for b in micro_batches),
            "sequence_tokens": sum(lengths),
            "forward_backward_seconds": fwd_bwd,
            "model_flops": flops,
            "device_peak_flops": self.peak_flops,
            "train_mfu": mfu(flops, self.peak_flops, fwd_bwd) if flops is not None else None,
            "optimizer_step_seconds": step_seconds,
            "train_seconds": time.perf_counter() - start,
            "host_rss_peak_bytes": peak_rss_bytes(),  # this rank's process, since it started
        }
        if cuda:
            metrics["forward_backward_device_peak_bytes"] = fwd_bwd_peak
            metrics["optimizer_step_device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if self.store is not None:
            metrics.update(stream_step_metrics(self.streamed_stores(), stepped=skipped is None))
        if cuda and self.config.cluster.colocate and not self.keeps_allocator_cache(engine_weights_resident=False):
            # The colocated engine's weights come back on this device next, while the trainer is awake: the
            # free blocks the caching allocator keeps from the forward's activations would leave it short
            # (llama-9.2b on one H200: 64 GB of them, and the engine's 18 GB did not fit).
            torch.cuda.empty_cache()
        return metrics

    def weights_finite_on_every_rank(self) -> bool:
        """Whether every rank's :meth:`trained_weights` are finite (each rank checks its own; one all-reduce)."""
        return not self.ranks_with_non_finite_weights()

    def ranks_with_non_finite_weights(self) -> list[int]:
        """The ranks whose :meth:`trained_weights` hold a NaN or inf (one all-reduce of a slot per rank: every
        rank gets the same list)."""
        bad = not tensors_finite(self.trained_weights(), self.device)
        slots = self.all_reduce([1.0 if bad and r == self.rank else 0.0 for r in range(self.world_size)])
        return [r for r, slot in enumerate(slots) if slot]

    def refuse_non_finite_weights(self, action: str) -> None:
        """Raise :class:`NonFiniteWeightsError` once a step has left non-finite weights (``action``: what the
        caller was about to do with them)."""
        if self.non_finite_weights_since is not None:
            raise NonFiniteWeightsError(
                f"rank {self.rank}: rollout {self.non_finite_weights_since}'s optimizer step left non-finite weights; "
                f"refusing to {action}. Resume from the last good checkpoint with a lower --lr")

    def keeps_allocator_cache(self, engine_weights_resident: bool) -> bool:
        """Whether the engine's last measured needs fit beside the caching allocator's free blocks
        (:func:`allocator_cache_may_stay`). Planned sleep only: offload-all empties the cache as before
        (torch_memory_saver's pause would back the free blocks up)."""
        if not isinstance(self.offloader, PlannedOffloader) or self.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return allocator_cache_may_stay(free, self.engine_needs, engine_weights_resident)

    def policy_gradient(self, samples: list, advantages: list[float], **loss: Any) -> list[float]:
        """Forward and backward over this rank's samples, grads accumulating in the model; the loss sums of the
        step's metrics (:func:`~miles.rl.loss.accumulate_policy_gradient`: one ``logprobs`` call per micro-batch).
        A backend whose forward is not one call per micro-batch (Megatron's pipeline schedule) replaces it."""
        return accumulate_policy_gradient(samples, advantages, self.logprobs, **loss)

    # ---- weights ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def awake(self):
        """Wake for the block if asleep (export, save and load need the weights), then sleep again."""
        was_asleep = self.offloader is not None and self.offloader.asleep
        if was_asleep:
            self.wake()
        try:
            yield
        finally:
            if was_asleep:  # no driver hands this rank the engine's copy at the wake after this sleep
                self.sleep(dataclasses.replace(self.engine_needs, copy_at_wake=False))

    def export_weights(self) -> dict[str, Any]:
        """A host copy of :meth:`hf_weights` (checks and tests; the RL loop hands weights over by reference)."""
        with self.awake():
            return {name: t.detach().to("cpu", copy=True) for name, t in self.hf_weights()}

    def join_weight_group(self, spec: dict[str, Any]) -> None:
        """Join the weight-update group as its source, rank 0 (``spec``: ``master_address``, ``master_port``,
        ``world_size``, ``backend``, ``group_name``), while the engines join it at ranks 1..n."""
        from miles.weights import WeightUpdateGroup

        self.weight_group = WeightUpdateGroup(rank=0, **spec)

    def join_payload_groups(self, groups: list[tuple[int, ...]]) -> None:
        """The process group of each sglang engine's feeding ranks (every rank makes each: a collective)."""
        self.payload_groups = {tuple(ranks): dist.new_group(list(ranks)) for ranks in groups}

    def push_weights(self, ipc_engines: list, group_engines: list, payload: str, tp_size: int,
                     peers=None) -> dict[str, Any]:
        """Hand the weights to the rollout engines as the ``payload`` they consume
        (:func:`miles.weights.push.push_weights`): by reference to ``ipc_engines``, by broadcast over the
        weight-update group to ``group_engines``; ``peers`` (:class:`miles.weights.push.PayloadPeers`, planned
        by the driver, one of :meth:`join_payload_groups`' groups): the train ranks, this one among them, whose
        payloads one sglang engine's ranks take. Every rank calls it (see :meth:`hf_weights`); an engine's
        session is opened and closed by the driver."""
        from miles.weights.push import push_weights

        mb = self.config.rollout.weight_sync_bucket_mb
        self.refuse_non_finite_weights("hand them to the rollout engines")
        if peers is not None:
            peers = dataclasses.replace(peers, group=self.payload_groups[peers.ranks])
        with self.awake():
            stats = push_weights(self.hf_weights(), payload=payload, tp_size=tp_size, ipc_engines=ipc_engines,
                                 group=self.weight_group, group_engines=group_engines, peers=peers,
                                 max_bucket_bytes=mb * 2**20)
        return {"rank": self.rank, **stats}

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, base: str, wait: bool = True) -> dict[str, Any]:
        """Write this rank's part of the checkpoint under ``base``; with ``wait=False`` the streamed
        optimizer state may still be copying until :meth:`finish_save`."""
        self.refuse_non_finite_weights("save them")
        with self.awake():
            self.prepare_save()
            return checkpoint.save_train_state(base, model=self.checkpoint_model(),
                                               optimizer=self.checkpoint_optimizer(), store=self.store,
                                               rank=self.rank, world_size=self.world_size,
                                               tokenizer=self.tokenizer, wait=wait)

    def finish_save(self) -> Optional[dict[str, Any]]:
        """Wait for a background save started by ``save(base, wait=False)``."""
        return checkpoint.finish_train_state(self.store)

    def load(self, base: str, load_optimizer: bool) -> dict[str, Any]:
        """Load this rank's part of the checkpoint at ``base``: the weights, then the mains from them
        (through the store when streaming), then the optimizer state if asked."""
        with self.awake():
            info = checkpoint.load_train_state(base, model=self.checkpoint_model(),
                                               optimizer=self.checkpoint_optimizer(), store=self.store,
                                               rank=self.rank, world_size=self.world_size,
                                               load_optimizer=load_optimizer)
            # a checkpoint saved before saves checked the weights may hold NaN/inf: every step from it would be
            # skipped or poison the engines, so the run stops here (every rank raises: the check is one all-reduce)
            bad_ranks = self.ranks_with_non_finite_weights()
            if bad_ranks:
                raise checkpoint.CheckpointError(
                    f"{base} holds non-finite model weights (NaN or inf, as loaded on train rank(s) "
                    f"{', '.join(map(str, bad_ranks))}): it was saved after a step that diverged. Resume from an "
                    "earlier checkpoint (--load <its folder>) with a lower --lr, or start without --load")
        return info

    # ---- sleep / wake -------------------------------------------------------------------------
    def sleep(self, engine: Optional[EngineNeeds] = None) -> dict[str, Any]:
        """Step aside for the rollout engine (idempotent). ``--offload-train-plan auto``: move only what the
        ``engine`` needs (:class:`~miles.offload.plan.EngineNeeds`; None: what the last sleep was told, at
        first nothing measured), each tensor by its cheapest exact way back
        (:mod:`miles.backends.planned_sleep`); ``offload-all``: offload weights, grads and resident
        optimizer state to the target."""
        from miles.backends.planned_sleep import offload_all_split, sleep_by_plan

        store_wait = settle_store_for_sleep(self.store, self.config.optimizer.stream_optimizer_state_flush_at_sleep)
        if self.offloader is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off", **store_wait}
        if engine is not None:
            self.engine_needs = engine
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        released = self.before_offload()
        # the engine's weights are on the device by now; the cache stays only where its KV pool fits beside it
        keep_cache = self.keeps_allocator_cache(engine_weights_resident=True)
        if isinstance(self.offloader, PlannedOffloader):
            if cuda and not keep_cache:
                torch.cuda.empty_cache()  # the plan measures free device memory: freed blocks count as free
            moved = sleep_by_plan(self, self.engine_needs)
        else:
            stats = self.offloader.sleep(self.offload_tensors())
            moved = {**offload_stats(stats), **offload_all_split("sleep", stats.target, stats.bytes, stats.skipped)}
        if cuda and not keep_cache:
            torch.cuda.empty_cache()
        return {"rank": self.rank, **moved, **released, **self.asleep_report(), **store_wait}

    def wake(self, engine_weights: Optional[list] = None) -> dict[str, Any]:
        """Undo :meth:`sleep`, bit-exactly (idempotent). ``engine_weights``: the colocated engine's weights
        by reference (``share_weights()``), which a sleep told ``copy_at_wake`` may have planned to rebuild
        from."""
        from miles.backends.planned_sleep import offload_all_split, wake_by_plan

        if self.offloader is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off"}
        if isinstance(self.offloader, PlannedOffloader):
            self.engine_weights = engine_weights
            try:
                moved = wake_by_plan(self)
            finally:
                self.engine_weights = None  # the references die with this wake: the engine releases them next
        else:
            stats = self.offloader.wake()
            moved = {**offload_stats(stats), **offload_all_split("wake", stats.target, stats.bytes, stats.skipped)}
        return {"rank": self.rank, **moved, **self.after_wake()}

    # ---- teardown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close files, leave the process group, remove ``rank_dir`` (idempotent)."""
        if not self.close_resources():
            return
        self.leave_process_group()
        self.release_rank_dir()

    def close_resources(self) -> bool:
        """Close the store and the offloader once; False when already closed (shutdown is idempotent).
        A store that fails to close is logged, so the rest of the teardown still runs."""
        if self.closed:
            return False
        self.closed = True
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                logger.exception("closing the optimizer-state store failed")
        if self.offloader is not None:
            self.offloader.close()
        if self.weight_group is not None:
            self.weight_group.destroy()
        return True

    def leave_process_group(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def claim_rank_dir(self) -> None:
        """Make the rank directory if missing (marked as this run's) and lock it for this process.

        A directory left by a run that died on this host is swept first (``claim_directory``); any other
        existing directory is used as it is, never emptied: it was not made by this run, so whatever is in
        it is someone else's (a second run on the same root is refused by the lock)."""
        if not self.rank_dir:
            return
        self.rank_dir_lock = claim_directory(self.rank_dir, self.config.run_id, f"rank {self.rank} directory")
        logger.info("rank %d: per-rank directory %s locked (removed at exit if this run made it)", self.rank,
                    self.rank_dir)

    def release_rank_dir(self) -> None:
        """Remove the rank directory if this run made it, then drop the lock (idempotent; also at exit)."""
        if self.rank_dir_lock is None or not self.rank_dir_lock.held:
            return
        left = remove_created(self.rank_dir, self.config.run_id)
        self.rank_dir_lock.release()
        if left:
            logger.info("rank %d: per-rank directory left in place: %s", self.rank, left)
        else:
            logger.info("rank %d: removed per-rank directory %s", self.rank, self.rank_dir)

    # ---- hooks: what each backend fills in ------------------------------------------------------
    def check_config(self) -> None:
        """Refuse, before anything is built, what this backend cannot run."""

    @abc.abstractmethod
    def join_process_group(self, rendezvous: str) -> str:
        """Set ``self.device``, join the process group(s); returns the collective backend's name."""

    @abc.abstractmethod
    def build_model(self) -> str:
        """Build the model, ``self.tokenizer`` and ``self.optimizer`` in ``self.dtype`` on ``self.device``;
        returns the policy's description."""

    @abc.abstractmethod
    def policy_config(self) -> dict[str, Any]:
        """The policy's transformers config as a dict (what :func:`miles.sizing.flops.model_flops` reads)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """This backend's part of :meth:`info` (at least ``num_params``)."""

    def zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @abc.abstractmethod
    def logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """Log-probs of ``input_ids[:, 1:]`` (``[B, L-1]``) of a collated micro-batch, with autograd."""

    def finish_backward(self) -> None:
        """After the micro-batches' backward passes: what the grads still need before the step."""

    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids the model embeds: ``0 .. vocab_size() - 1`` (a sample outside it is not trained on)."""

    @abc.abstractmethod
    def local_grads_finite(self) -> bool:
        """Whether every grad this rank holds after :meth:`finish_backward` is finite (the template
        all-reduces the answer, so every rank skips a step that any rank's grads would poison)."""

    @abc.abstractmethod
    def trained_weights(self) -> list[torch.Tensor]:
        """The weights an optimizer step writes on this rank, as the model holds them (what a checkpoint and
        the rollout engines get): checked for non-finite values after every applied step."""

    @abc.abstractmethod
    def optimizer_step(self, rollout_id: int) -> float:
        """Reduce and clip the grads, step the optimizer (the streamed step when the store is bound);
        returns the global grad norm."""

    @abc.abstractmethod
    def hf_weights(self) -> Iterator[tuple[str, Any]]:
        """The full weights as ``(HF-layout name, tensor on this rank's device)`` pairs (what the rollout
        engine's model expects), converted lazily; a collective when the backend shards weights over ranks
        (expert parallelism), so every rank iterates it. The trainer must be awake."""

    def prepare_save(self) -> None:
        """Before a checkpoint is written (on every rank, awake): gather what the model's save needs."""

    @abc.abstractmethod
    def checkpoint_model(self):
        """What ``miles.checkpoint`` saves and loads as the model (``save_pretrained``, ``load_state_dict``)."""

    def checkpoint_optimizer(self):
        """What ``miles.checkpoint`` saves and loads as the optimizer (its state is the store's when bound)."""
        return self.optimizer

    def before_offload(self) -> dict[str, Any]:
        """At sleep, before the offloader: what the backend drops itself; returns what to report."""
        return {}

    @abc.abstractmethod
    def offload_tensors(self) -> list[torch.Tensor]:
        """What the storage offloader backs up at sleep (torch_memory_saver pauses the whole process)."""

    def sleep_groups(self) -> list[tuple[Group, list[torch.Tensor]]]:
        """What the sleep plan decides over: groups of tensors with the sources that hold them too
        (:class:`miles.offload.plan.Group`), weights first. Default: :meth:`offload_tensors` as one group
        that nothing else holds."""
        from miles.backends.planned_sleep import make_groups

        return make_groups([("state", OTHER, self.offload_tensors(), {})])

    def sleep_rebuilders(self) -> dict[str, Any]:
        """``{way: callable}`` that rewrites at wake the groups the plan rebuilt: ``rebuild_from_engine`` by
        :meth:`weights_from_engine`, ``rebuild_from_masters`` by :meth:`weights_from_masters` (with a store)."""
        from miles.offload.plan import FROM_ENGINE, FROM_MASTERS

        rebuilders = {FROM_ENGINE: self.weights_from_engine}
        if self.store is not None:
            rebuilders[FROM_MASTERS] = self.weights_from_masters
        return rebuilders

    def weights_from_engine(self) -> int:
        """At wake: rewrite the groups :meth:`sleep_groups` marks ``engine_copy`` from ``self.engine_weights``
        (the engine's weights by reference, HF layout); returns the bytes copied. Only a backend that marks
        such a group implements it."""
        raise NotImplementedError(f"{type(self).__name__} marks no sleep group as held by the engine")

    def weights_from_masters(self) -> int:
        """At wake: rewrite the groups :meth:`sleep_groups` marks ``from_masters`` from the store's masters;
        returns the bytes read. Only a backend that marks such a group implements it."""
        raise NotImplementedError(f"{type(self).__name__} marks no sleep group as the store's masters")

    def asleep_report(self) -> dict[str, Any]:
        """At the end of sleep: what the backend reports of the device while asleep."""
        return {}

    def after_wake(self) -> dict[str, Any]:
        """At wake, after the offloader: what the backend restores itself; returns what to report."""
        return {}
