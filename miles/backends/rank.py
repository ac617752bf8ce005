"""The train rank: what one train actor (one data-parallel rank) drives, over a compute engine.

:class:`TrainRank` owns what every backend does the same way, in the manner of torch.optim's thin
``Optimizer`` over a functional core or verl's ``TrainingWorker`` over its engine: the setup sequence of
``init``, the train step (:mod:`miles.backends.step`: token counts all-reduced, grads zeroed, the store's
read-ahead, the loss handed to the engine's forward/backward, the optimizer step, the step's metrics),
sleep/wake (:mod:`miles.backends.sleep`), the checkpoint calls, the weight handoff and shutdown. The
engine (:class:`miles.backends.engine.TrainEngine`) only computes: each backend's rank class names its
engine (``engine_type``). :data:`miles.config.backends.BACKENDS` names the rank classes by
``--train-backend`` value as ``"module:Class"`` strings, so choosing a backend imports nothing until an
actor builds it (megatron-core, for one, imports only on GPU machines that have it).

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
from init to shutdown (:meth:`TrainRank.claim_rank_dir` / :meth:`TrainRank.release_rank_dir`),
so two actors, or two runs, never write into one; shutdown removes it only if this run made it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from miles import checkpoint
from miles.config import RunConfig, store_config
from miles.offload.plan import EngineNeeds
from miles.sizing.flops import peak_bf16_flops, train_flops
from miles.sizing.tensors import ModelConfigError
from miles_plugins.host.ownership import DirectoryLock, claim_directory, remove_created
from miles_plugins.optimizers.nvme_stream import stream_optimizer_state

from .engine import TrainEngine, tensors_finite
from .sleep import make_sleep, settle_store_for_sleep
from .step import (NON_FINITE_GRADS, PolicyLoss, StepInput, StepResult, device_peak, input_skip_reason, plan_step,
                   reduce_over_ranks, reset_device_peak, step_metrics, stream_step_metrics)

logger = logging.getLogger(__name__)


class NonFiniteWeightsError(RuntimeError):
    """An applied optimizer step left a non-finite weight on some rank: what this rank holds must reach
    neither a checkpoint nor a rollout engine (the run stops; the last good checkpoint stays the latest)."""


def resolve_backend(spec: str) -> type["TrainRank"]:
    """The class named by a ``"module:Class"`` spec (a value of :data:`miles.config.backends.BACKENDS`),
    imported now."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"backend spec {spec!r} is not of the form 'module:Class'")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, TrainRank)):
        raise TypeError(f"backend spec {spec!r} names {cls!r}, which does not implement miles.backends.rank.TrainRank")
    return cls


def use_deterministic_algorithms() -> None:
    """``--deterministic-mode``: torch's deterministic algorithms in this process, warning (not failing) on an
    op that has none; cuBLAS needs its fixed workspace before the first matmul creates its handle."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    logger.info("deterministic mode: torch's deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG=%s)",
                os.environ["CUBLAS_WORKSPACE_CONFIG"])


def store_info(stores: list) -> dict[str, Any]:
    """What ``info()["store"]`` reports of a rank's stores (one for torch, one per chained member for megatron)."""
    return {"num_buckets": sum(s.stats.num_buckets for s in stores),
            "state_bytes": sum(s.stats.state_bytes for s in stores),
            "paths": [s.path for s in stores], "relative_dirs": [s.relative_dir for s in stores]}


class TrainRank:
    """One data-parallel rank over the engine its backend names in ``engine_type``.

    ``config``: the run's :class:`~miles.config.RunConfig`. ``rank``/``world_size``: this rank among the
    train actors of cell ``cell``. ``rank_dir``: this rank's private directory (``cell<i>_rank<j>``;
    None when no disk mechanism is on); the rank claims it at init (:meth:`claim_rank_dir`) and
    releases it at shutdown (:meth:`release_rank_dir`).
    """

    engine_type: type[TrainEngine]

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
        self.engine = self.engine_type(config, rank=rank, world_size=world_size)
        # the optimizer-state store when streaming: what stream_optimizer_state returned (a store, or the
        # StoreGroup of a chained optimizer's stores)
        self.store = None
        self.sleeper = None  # how this rank sleeps when --offload-train is on (miles.backends.sleep)
        self.weight_group = None  # the weight-update group, when this rank is its source
        self.payload_groups: dict[tuple[int, ...], Any] = {}  # per engine fed by several ranks: their group
        self.engine_needs = EngineNeeds()  # what the last sleep was told of the colocated engine
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
        config, engine = self.config, self.engine
        engine.check_config()
        if config.training.deterministic_mode:
            use_deterministic_algorithms()
        torch.set_num_threads(config.cluster.num_cpus_per_rank)
        process_group_backend = engine.join_process_group(rendezvous)
        self.claim_rank_dir()
        engine.seed(config.training.seed)
        description = engine.build_model()
        self.flops, self.peak_flops = self.count_flops()
        if config.optimizer.stream_optimizer_state_to_disk:
            self.store = engine.store = stream_optimizer_state(
                engine.optimizer, config=store_config(config, self.rank, self.ranks_on_node))
        self.sleeper = make_sleep(config, engine.device, self.rank_dir, self.rank_dir_lock, self.ranks_on_node)
        self.init_info = {"rank": self.rank, "pid": os.getpid(), "device": str(engine.device),
                          "backend": process_group_backend,
                          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # set per actor by Ray
                          "dtype": str(engine.dtype).replace("torch.", ""), "description": description,
                          "rank_dir": self.rank_dir,
                          "offload": type(self.sleeper.offloader).__name__ if self.sleeper else None,
                          "store": store_info(engine.streamed_stores()) if self.store is not None else None,
                          **engine.describe()}
        return self.info()

    def info(self) -> dict[str, Any]:
        """What this rank runs: rank, pid, device, dtype, num_params, description, offloader, store info."""
        return dict(self.init_info)

    def count_flops(self) -> tuple[Any, Optional[float]]:
        """The policy's FLOP coefficients and the device's peak, for the step's ``train_mfu``."""
        device = self.engine.device
        peak = peak_bf16_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None)
        try:
            return self.engine.policy_flops(), peak
        except ModelConfigError as e:
            logger.warning("rank %d: model FLOPs not counted, so no train_mfu: %s", self.rank, e)
            return None, peak

    # ---- training -----------------------------------------------------------------------------
    def all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        """``values`` reduced over the data-parallel ranks by ``op`` (summed unless told; float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.engine.device)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(t, op=op)
        return [float(v) for v in t.cpu()]

    def train(self, rollout_id: int, samples: list, advantages: list[float]) -> dict[str, Any]:
        """One optimizer step over this rank's share of a rollout; returns the step's metrics.

        ``samples`` carry ``prompt_ids``, ``response_ids``, ``response_logprobs`` (the rollout engine's
        log-probs); ``advantages[i]`` belongs to ``samples[i]``. The loss is the token mean over the whole
        rollout (all ranks): each rank divides by the global token count / world size, and the DP grad
        average makes the sum.

        The step is skipped on every rank, leaving weights and optimizer state (the store's included)
        untouched bit for bit, by the skip rule of :mod:`miles.backends.step`; ``metrics["step_skipped"]``
        then says why (None when the step was applied).

        After an applied step every rank checks its trained weights (one all-reduce: all ranks agree);
        ``metrics["weights_finite"]`` is False when any rank holds a non-finite weight, and from then on this
        rank refuses to train, save or hand its weights over (:class:`NonFiniteWeightsError`).
        """
        self.refuse_non_finite_weights("train on them")
        start = time.perf_counter()
        engine = self.engine
        step = plan_step(samples, advantages, self.config, engine.vocab_size(), self.rank, self.world_size,
                         self.all_reduce)
        loss = PolicyLoss.of(self.config, num_tokens=step.tokens / self.world_size)
        engine.zero_grads()
        if self.store is not None:  # read-ahead: the disk is idle during forward/backward
            self.store.prefetch()
        reset_device_peak(engine.device)  # the forward/backward's own device peak: weights, grads, activations
        fwd_bwd = time.perf_counter()
        stats, skipped = self.forward_backward(samples, advantages, step, loss)
        fwd_bwd = time.perf_counter() - fwd_bwd
        fwd_bwd_peak = device_peak(engine.device)
        computed = self.flops is not None and not step.bad_input_anywhere  # the real tokens' arithmetic, if any
        flops = train_flops(self.flops, step.lengths) if computed else None
        reset_device_peak(engine.device)  # the step's own device peak: weights, grads and the optimizer's state
        step_start = time.perf_counter()
        grad_norm, weights_finite = self.apply_step(rollout_id, skipped)
        step_seconds, step_peak = time.perf_counter() - step_start, device_peak(engine.device)
        result = StepResult(sums=reduce_over_ranks(stats, self.all_reduce), grad_norm=grad_norm, skipped=skipped,
                            weights_finite=weights_finite, forward_backward_seconds=fwd_bwd,
                            forward_backward_peak=fwd_bwd_peak, optimizer_step_seconds=step_seconds,
                            optimizer_step_peak=step_peak, flops=flops, peak_flops=self.peak_flops,
                            train_seconds=time.perf_counter() - start)
        metrics = step_metrics(self.rank, self.world_size, samples, step, loss, result)
        if self.store is not None:
            metrics.update(stream_step_metrics(engine.streamed_stores(), stepped=skipped is None))
        self.make_room_for_engine_weights()
        return metrics

    def forward_backward(self, samples: list, advantages: list[float], step: StepInput,
                         loss: PolicyLoss) -> tuple[list[float], Optional[str]]:
        """The engine's forward/backward with this step's ``loss`` unless some rank's input is bad; returns the
        loss's statistics (:data:`~miles.backends.step.LOSS_SUMS`, ``LOSS_MAXIMA``) and why the step is skipped
        (None: it is applied)."""
        skipped = input_skip_reason(step, self.rank)
        if skipped is not None:
            return loss.skipped_stats(), skipped
        stats = self.engine.forward_backward(samples, advantages, step.micro_batches, loss)
        self.engine.finish_backward()
        grads_finite = self.all_reduce([0.0 if self.engine.local_grads_finite() else 1.0])[0] == 0.0
        return stats, None if grads_finite else NON_FINITE_GRADS

    def apply_step(self, rollout_id: int, skipped: Optional[str]) -> tuple[float, bool]:
        """Step the optimizer unless ``skipped``, then check the weights on every rank; returns the grad norm
        and whether every rank's weights are finite (a skipped step leaves them as the last check did)."""
        if skipped is not None:
            self.engine.zero_grads()  # nothing of this step may reach the weights, the state, or the sleep's backup
            logger.warning("rank %d: rollout %d: optimizer step skipped (%s): weights and optimizer state are "
                           "unchanged", self.rank, rollout_id, skipped)
            return math.nan, True
        grad_norm = self.engine.optimizer_step(rollout_id)
        weights_finite = self.weights_finite_on_every_rank()
        if not weights_finite:
            self.non_finite_weights_since = rollout_id
            logger.error("rank %d: rollout %d: the optimizer step left non-finite weights (grad norm %g); they "
                         "will not be saved or handed to the rollout engines", self.rank, rollout_id, grad_norm)
        return grad_norm, weights_finite

    def make_room_for_engine_weights(self) -> None:
        """After a step under --colocate on CUDA: the colocated engine's weights come back on this device next,
        while the trainer is awake; the free blocks the caching allocator keeps from the forward's activations
        would leave it short (llama-9.2b on one H200: 64 GB of them, and the engine's 18 GB did not fit)."""
        device = self.engine.device
        if device.type == "cuda" and self.config.cluster.colocate and not self.keeps_allocator_cache(False):
            torch.cuda.empty_cache()

    def keeps_allocator_cache(self, engine_weights_resident: bool) -> bool:
        """Whether the caching allocator may keep its free blocks through the engine's turn (the sleep's call)."""
        return self.sleeper is not None and self.sleeper.keeps_allocator_cache(
            self.engine.device, self.engine_needs, engine_weights_resident)

    def weights_finite_on_every_rank(self) -> bool:
        """Whether every rank's trained weights are finite (each rank checks its own; one all-reduce)."""
        return not self.ranks_with_non_finite_weights()

    def ranks_with_non_finite_weights(self) -> list[int]:
        """The ranks whose trained weights hold a NaN or inf (one all-reduce of a slot per rank: every rank
        gets the same list)."""
        bad = not tensors_finite(self.engine.trained_weights(), self.engine.device)
        slots = self.all_reduce([1.0 if bad and r == self.rank else 0.0 for r in range(self.world_size)])
        return [r for r, slot in enumerate(slots) if slot]

    def refuse_non_finite_weights(self, action: str) -> None:
        """Raise :class:`NonFiniteWeightsError` once a step has left non-finite weights (``action``: what the
        caller was about to do with them)."""
        if self.non_finite_weights_since is not None:
            raise NonFiniteWeightsError(
                f"rank {self.rank}: rollout {self.non_finite_weights_since}'s optimizer step left non-finite weights; "
                f"refusing to {action}. Resume from the last good checkpoint with a lower --lr")

    # ---- weights ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def awake(self):
        """Wake for the block if asleep (export, save and load need the weights), then sleep again."""
        was_asleep = self.sleeper is not None and self.sleeper.offloader.asleep
        if was_asleep:
            self.wake()
        try:
            yield
        finally:
            if was_asleep:  # no driver hands this rank the engine's copy at the wake after this sleep
                self.sleep(dataclasses.replace(self.engine_needs, copy_at_wake=False))

    def export_weights(self) -> dict[str, Any]:
        """A host copy of the engine's ``hf_weights`` (checks and tests; the RL loop hands weights over by
        reference)."""
        with self.awake():
            return {name: t.detach().to("cpu", copy=True) for name, t in self.engine.hf_weights()}

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
        payloads one sglang engine's ranks take. Every rank calls it (the engine's ``hf_weights`` may be a
        collective); an engine's session is opened and closed by the driver."""
        from miles.weights.push import push_weights

        mb = self.config.rollout.weight_sync_bucket_mb
        self.refuse_non_finite_weights("hand them to the rollout engines")
        if peers is not None:
            peers = dataclasses.replace(peers, group=self.payload_groups[peers.ranks])
        with self.awake():
            stats = push_weights(self.engine.hf_weights(), payload=payload, tp_size=tp_size, ipc_engines=ipc_engines,
                                 group=self.weight_group, group_engines=group_engines, peers=peers,
                                 max_bucket_bytes=mb * 2**20)
        return {"rank": self.rank, **stats}

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, base: str, wait: bool = True) -> dict[str, Any]:
        """Write this rank's part of the checkpoint under ``base``; with ``wait=False`` the streamed
        optimizer state may still be copying until :meth:`finish_save`."""
        self.refuse_non_finite_weights("save them")
        with self.awake():
            self.engine.prepare_save()
            return checkpoint.save_train_state(base, model=self.engine.checkpoint_model(),
                                               optimizer=self.engine.checkpoint_optimizer(), store=self.store,
                                               rank=self.rank, world_size=self.world_size,
                                               tokenizer=self.engine.tokenizer, wait=wait)

    def finish_save(self) -> Optional[dict[str, Any]]:
        """Wait for a background save started by ``save(base, wait=False)``."""
        return checkpoint.finish_train_state(self.store)

    def load(self, base: str, load_optimizer: bool) -> dict[str, Any]:
        """Load this rank's part of the checkpoint at ``base``: the weights, then the mains from them
        (through the store when streaming), then the optimizer state if asked."""
        with self.awake():
            info = checkpoint.load_train_state(base, model=self.engine.checkpoint_model(),
                                               optimizer=self.engine.checkpoint_optimizer(), store=self.store,
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
        store_wait = settle_store_for_sleep(self.store, self.config.optimizer.stream_optimizer_state_flush_at_sleep)
        if self.sleeper is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off", **store_wait}
        if engine is not None:
            self.engine_needs = engine
        cuda = self.engine.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        released = self.engine.before_offload()
        # the engine's weights are on the device by now; the cache stays only where its KV pool fits beside it
        keep_cache = self.keeps_allocator_cache(engine_weights_resident=True)
        moved = self.sleeper.put_away(self.engine, self.engine_needs, keep_cache)
        if cuda and not keep_cache:
            torch.cuda.empty_cache()
        return {"rank": self.rank, **moved, **released, **self.engine.asleep_report(), **store_wait}

    def wake(self, engine_weights: Optional[list] = None) -> dict[str, Any]:
        """Undo :meth:`sleep`, bit-exactly (idempotent). ``engine_weights``: the colocated engine's weights
        by reference (``share_weights()``), which a sleep told ``copy_at_wake`` may have planned to rebuild
        from."""
        if self.sleeper is None:
            return {"rank": self.rank, "skipped": True, "reason": "--offload-train is off"}
        moved = self.sleeper.bring_back(self.engine, engine_weights)
        return {"rank": self.rank, **moved, **self.engine.after_wake()}

    # ---- teardown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close files, leave the process group, remove ``rank_dir`` (idempotent)."""
        if not self.close_resources():
            return
        self.engine.leave_process_group()
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
        if self.sleeper is not None:
            self.sleeper.offloader.close()
        if self.weight_group is not None:
            self.weight_group.destroy()
        return True

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
