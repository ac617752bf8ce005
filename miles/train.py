"""The RL loop: ``miles.train.run(config)`` (what ``miles train`` runs; ``config`` is the validated
:class:`~miles.config.RunConfig`).

Per rollout (colocated sequence)::

    generate (engine awake) -> rewards -> GRPO advantages -> release the engine's weights and KV cache ->
    wake trainer -> train (forward/backward + one optimizer step; streams the optimizer state with
    --stream-optimizer-state-to-disk) -> save (every --save-interval rollouts and at the end) -> resume the
    engine's weights -> hand the weights over (by reference: :mod:`miles.ray.weight_sync`) -> sleep trainer
    -> resume the engine's KV cache

Without ``--colocate`` the engine keeps its memory; without ``--offload-train`` the trainer stays
awake. The engines are driven only through the rollout-engine contract (:mod:`miles.rollout.contract`). ``--load`` resumes the model, the optimizer state (the streamed state through
``store.load_from``), the rollout id and the data position.

Operator output goes through ``logging``: on a terminal, a line for each long wait and a progress bar over the
rollouts (no bar in a log file: whole lines, and a line every 30 s of a long wait; :mod:`miles.progress`), one
line per rollout
(reward, loss, step seconds, streamed GB and GB/s, sleep/wake seconds), metrics as JSONL
(``--metrics-file``, default ``<run dir>/metrics.jsonl``, created when the first record is written) and TensorBoard scalars when TensorBoard is
installed, and a summary at the end that says where the checkpoints are. A failing Ray actor stops
the run: its traceback is logged once, and :class:`RunError` carries one line naming the actor and the
exception it raised; temporary directories are removed either way.

The run's root lock, its answer to SIGTERM/SIGINT, its teardown and its state (:class:`RunState`, what
``run`` returns) live in :mod:`miles.run_lifecycle`; this module is the loop and its setup.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Optional

from miles import checkpoint
from miles.config import RunConfig
from miles.logging_setup import configure_logging, set_driver_env
from miles.metrics import MetricsSink, format_rollout_line, log_summary, rollout_record
from miles.parallel.layout import ParallelLayout, rank_slices
from miles.preflight.parallel_checks import EXPERIMENTAL_MODEL_PARALLEL_FLAG
from miles.progress import progress_bar, waiting
from miles.rollout.recorded import ReplayShape, RolloutDataError, write_rollout
from miles.run_lifecycle import Actors, RunState, StopOnSignal, hold_root_and_run, tear_down
from miles_plugins.optimizers.streaming.units import GB

logger = logging.getLogger("miles.train")


class RunError(RuntimeError):
    """The run stopped because an actor failed (the message carries the actor's traceback) or a node's disk
    cannot hold what its ranks write (one line naming the node; :mod:`miles.ray.node_disk`)."""


class SkippedStepsError(RuntimeError):
    """--max-consecutive-skipped-steps rollouts in a row could not be trained on (non-finite grads, or
    engine output that is not valid training input): the run stops instead of going on without learning.
    Also a run whose every rollout skipped its step: it ends with this error, not as a run that trained."""


class NonFiniteStepError(RuntimeError):
    """An applied optimizer step left a non-finite weight: the run stops before the weights reach a
    checkpoint or a rollout engine, and the last good checkpoint stays the latest."""


# ---- small helpers ----------------------------------------------------------------------------------
class _DataCursor:
    """The prompt stream as a position: prompt k of the (epoch-shuffled) stream is ``get_batch(k, 1)``,
    so resuming at a saved position continues exactly where the saved run stopped, whatever the batch
    size."""

    def __init__(self, source, position: int = 0):
        self.source = source
        self.position = position

    def next_batch(self, batch_size: int) -> list:
        if self.position % batch_size == 0:  # the usual case: one call of the source's own batching
            items = self.source.get_batch(self.position // batch_size, batch_size)
        else:  # resumed with a different batch size: prompt by prompt
            items = [self.source.get_batch(k, 1)[0] for k in range(self.position, self.position + batch_size)]
        self.position += batch_size
        return items

    def state(self) -> dict[str, Any]:
        return {"consumed_prompts": self.position, "num_prompts": len(self.source)}


def _should_save(config: RunConfig, completed: int) -> bool:
    """Every --save-interval rollouts, and after the last one (with --save)."""
    if not config.checkpoint.save:
        return False
    interval = config.checkpoint.save_interval
    return (interval is not None and completed % interval == 0) or completed == config.rollout.num_rollout


def _shards(samples: list, advantages: list[float], layout: ParallelLayout) -> list[tuple[list, list[float]]]:
    """Each train rank's samples: split over data parallelism, shared by the TP/PP ranks of a replica."""
    return [(samples[s], advantages[s]) for s in rank_slices(len(samples), layout)]


def _init_ray(config: RunConfig) -> bool:
    """Join the cluster at ``config.ray_address`` (``RAY_ADDRESS``) or start a private one for this run, never
    a cluster a ``ray start`` left on the machine (:mod:`miles.ray.cluster`); returns True when this call
    started Ray. Raises :class:`RunError` (one line) when the cluster RAY_ADDRESS names does not answer."""
    import ray

    from miles.ray.cluster import ClusterError, join, start_private

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    set_driver_env()
    address = config.ray_address
    try:
        if address:
            with waiting(f"joining the Ray cluster at {address}"):
                join(address)
        else:  # bound to loopback
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            with waiting("starting a private Ray cluster"):
                start_private()
    except ClusterError as e:
        raise RunError(f"run stopped: {e}") from None
    return True


# ---- the loop -----------------------------------------------------------------------------------------
def run(config: RunConfig) -> RunState:
    """Run the RL loop; returns what the run did (also logged). Raises :class:`RunError` when an actor fails.

    Exits the process (``SystemExit``) with one line on stderr when the run root cannot be held (exit code
    2, nothing started) or SIGTERM/SIGINT arrived (128 + the signal number, after teardown):
    :func:`miles.run_lifecycle.hold_root_and_run`."""
    configure_logging(config.logging.log_level)
    return hold_root_and_run(config, _run_holding_root)


def _prepare_before_ray(config: RunConfig) -> tuple[Optional[tuple[str, dict[str, Any]]], Any, Any,
                                                    Optional[ReplayShape]]:
    """What the run settles in the driver before Ray starts: the checkpoint to resume (``target``), the policy
    model's source, its tokenizer and the recorded rollouts to replay; each refusal stops the run at once."""
    from miles.models import load_tokenizer, prepare_policy

    if config.training.experimental_model_parallel:
        logger.warning("%s: tensor/pipeline parallel training (%s) is checked with its ranks sharing one GPU, not "
                       "yet across GPUs; scripts/validate_parallel.sh compares it with TP = PP = 1 on this host",
                       config.parallel_layout.describe(), EXPERIMENTAL_MODEL_PARALLEL_FLAG)
    try:  # a checkpoint this run cannot resume is refused before Ray and the actors start
        target = checkpoint.checked_resume_target(config)
    except checkpoint.CheckpointError as e:
        raise RunError(f"run stopped: {e}") from None
    with waiting("preparing the policy model"):
        source = prepare_policy(config)  # one-time model conversion happens here, not in every actor
    tokenizer = load_tokenizer(config)
    return target, source, tokenizer, checked_replay(config, source, tokenizer, target)


def _run_holding_root(config: RunConfig, stop: StopOnSignal, state: RunState) -> RunState:
    import ray

    from miles.ray.errors import ActorFailure
    from miles.ray.node_disk import NodeDiskError
    from miles.ray.placement_group import PlacementError

    t_run = time.perf_counter()
    target, source, tokenizer, replay = _prepare_before_ray(config)
    started_ray = _init_ray(config)
    stop.install()  # ray.init replaced the SIGTERM handler
    actors = Actors()
    sink = None
    loop: Optional[_Loop] = None
    failure: Optional[BaseException] = None
    try:
        _start_actors(config, actors, state, source)
        start_rollout, cursor = _resume(config, actors.train_group, state, target)
        # engines start from the trainer's weights (matters after --load or with a pretrained model)
        from miles.ray.weight_sync import WeightSync

        weight_sync = WeightSync(config, actors.train_group, actors.rollout, state.train_ranks, state.rollout_engines,
                                 actors.use_gpu)
        weight_sync.push(start_rollout)
        if config.offload.offload_train:
            actors.train_group.sleep()
        sink = MetricsSink(config.logging.metrics_file, config.logging.tensorboard_dir, config.run_id,
                           state.resumed_runs, start_rollout)
        state.tensorboard_dir = sink.tb_dir if sink.tb is not None else None
        loop = _Loop(config, cursor, tokenizer, actors.train_group, actors.rollout, weight_sync, sink, state, replay)
        loop.run(range(start_rollout, config.rollout.num_rollout))
    except ActorFailure as e:
        failure = e
        if _server_error(e) is None:
            logger.error("%s failed on %s. The actor's traceback:\n%s", e.what, e.actor, e.remote_traceback)
        elif loop is not None:  # a server's error names it and says what it said: its traceback adds nothing
            _publish_after_server_failure(loop)
    except (NodeDiskError, PlacementError, SkippedStepsError, NonFiniteStepError, checkpoint.CheckpointError,
            RolloutDataError) as e:
        failure = e
        logger.error("%s", e)
    except BaseException as e:
        failure = e
        raise
    finally:
        tear_down(config, actors, state, sink, failed=failure is not None)
        if started_ray:  # after the sweeps: they are Ray tasks
            ray.shutdown()
    state.seconds = time.perf_counter() - t_run
    if failure is not None:
        # the traceback was logged once above; the error itself is the one-line cause
        cause = _failure_line(failure, config, state) if isinstance(failure, ActorFailure) else str(failure)
        raise RunError(f"run stopped: {cause}") from None
    log_summary(config, state)
    return state


def _server_error(failure) -> Optional[BaseException]:
    """The error of an sglang server (--sglang-url) that an actor failure carries (Ray wraps it once per actor it
    crossed: the engine's, and a train rank's when it came from a weight push), or None."""
    from ray.exceptions import RayTaskError

    from miles.rollout.sglang.transport import SglangCallError

    error = failure.cause
    while isinstance(error, RayTaskError):
        error = error.cause
    return error if isinstance(error, SglangCallError) and error.from_server else None


def _publish_after_server_failure(loop: "_Loop") -> None:
    """The trainer is well when a server fails: the checkpoint it was finishing in the background is complete once
    its ranks finish it, so it is published rather than lost."""
    from miles.ray.errors import ActorFailure

    try:
        loop.publish_pending()
    except (ActorFailure, checkpoint.CheckpointError) as e:
        logger.error("the checkpoint being finished when the server failed was not published: %s",
                     e.summary if isinstance(e, ActorFailure) else e)


def _failure_line(failure, config: RunConfig, state: RunState) -> str:
    """An actor's failure in one line; a server's error with how far the run got and what is safe to resume
    from (the checkpoint being written when it failed is removed, never published)."""
    server_error = _server_error(failure)
    if server_error is None:
        return failure.summary
    done = state.start_rollout + len(state.records)
    latest = state.latest_checkpoint or state.loaded_checkpoint
    kept = f"checkpoint {latest} is the last complete one" if latest else "no checkpoint was saved"
    return f"{server_error} ({done}/{config.rollout.num_rollout} rollouts done; {kept})"


def _start_actors(config: RunConfig, actors: Actors, state: RunState, source) -> None:
    """Placement group, the per-node disk check, the train actors and the rollout engines, initialized;
    one line on what runs where."""
    from miles.ray.node_disk import check_node_disks
    from miles.ray.layout import engines_load_first
    from miles.ray.placement_group import bundle_nodes, create_placement_group
    from miles.ray.rollout_manager import RolloutManager
    from miles.ray.train_group import RayTrainGroup

    actors.pg, actors.use_gpu, _ = create_placement_group(config)
    actors.actor_nodes = list(dict.fromkeys(bundle_nodes(actors.pg)))  # every node an actor can run on, in bundle order
    # every node's disk against what its ranks will write, before any actor starts
    state.nodes = [vars(n) for n in check_node_disks(config, actors.pg)]
    actors.train_group = RayTrainGroup(config, actors.pg, actors.use_gpu)
    actors.rollout = RolloutManager(config, actors.pg, actors.use_gpu)
    logger.info("starting %d train actor(s) and %d rollout engine(s) (each imports torch and builds the "
                "model: this takes a while on a small machine)", len(actors.train_group.actors),
                len(actors.rollout.engines))
    with waiting(f"starting {len(actors.train_group.actors)} train actor(s) and {len(actors.rollout.engines)} rollout "
                 "engine(s)"):
        if engines_load_first(config):
            engine_infos = actors.rollout.init()
            infos = actors.train_group.init()
        else:
            infos = actors.train_group.init()
            engine_infos = actors.rollout.init()
    state.train_ranks, state.rollout_engines = infos, engine_infos
    info0 = infos[0]
    logger.info("policy: %s | %.2fM params, %s on %s | %d train ranks (%s), %d rollout engine(s)%s",
                source.description, info0["num_params"] / 1e6, info0["dtype"], info0["device"], len(infos),
                info0["backend"], len(engine_infos), " colocated" if config.cluster.colocate else "")
    if info0.get("store"):
        st = info0["store"]
        logger.info("streamed optimizer state: %d bucket(s), %.3f GB per rank under %s",
                    st["num_buckets"], st["state_bytes"] / GB, config.paths.optimizer_state)
    if config.offload.offload_train:
        logger.info("trainer offload: target %s%s", config.offload.offload_train_target,
                    f", per-rank directories under {config.paths.trainer}" if config.uses_rank_dirs else "")


def _first_rollout(config: RunConfig, target: Optional[tuple[str, dict[str, Any]]]) -> int:
    """The rollout the run starts at: the checkpoint's next one when it resumes (``target``:
    :func:`miles.checkpoint.resume_target`; not with --finetune), else 0."""
    return int(target[1]["next_rollout_id"]) if target is not None and not config.checkpoint.finetune else 0


def checked_replay(config: RunConfig, source, tokenizer,
                    target: Optional[tuple[str, dict[str, Any]]]) -> Optional[ReplayShape]:
    """With --load-debug-rollout-data: what the run assumes of the recorded rollouts (its flags, its model),
    every rollout it will replay read and checked against it now, before Ray and the actors start."""
    if config.rollout.load_debug_rollout_data is None:
        return None
    try:
        replay = ReplayShape.of_policy(config, source, tokenizer)
        replay.check(range(_first_rollout(config, target), config.rollout.num_rollout))
    except RolloutDataError as e:
        raise RunError(f"run stopped: {e}") from None
    return replay


def _resume(config: RunConfig, train_group, state: RunState,
            target: Optional[tuple[str, dict[str, Any]]]) -> tuple[int, "_DataCursor"]:
    """With --load (``target``: :func:`miles.checkpoint.checked_resume_target`, checked before anything
    started): the checkpoint's model (and optimizer state) into every rank; the rollout to start at and the
    prompt stream's position (both 0 on a fresh start or with --finetune)."""
    from miles.rl import make_prompt_source

    start_rollout, data_position = 0, 0
    resumed_runs: list[str] = []  # the runs whose history this one continues (none when fresh or --finetune)
    ckpt = config.checkpoint
    if target is not None:
        base, meta = target
        load_optim = ckpt.loads_optimizer_state
        with waiting(f"loading {base}"):
            loaded = train_group.load(base, load_optim)
        if not ckpt.finetune:
            start_rollout = _first_rollout(config, target)
            data_position = int(meta.get("data_state", {}).get("consumed_prompts", 0))
            resumed_runs = checkpoint.runs_of(meta)
        logger.info("loaded %s: model%s; resuming at rollout %d, prompt %d", base,
                    f", optimizer ({loaded[0]['optimizer']})" if load_optim else " only (optimizer skipped)",
                    start_rollout, data_position)
        state.loaded_checkpoint = base
        state.load_info = loaded
    state.start_rollout, state.resumed_runs = start_rollout, resumed_runs
    return start_rollout, _DataCursor(make_prompt_source(config), data_position)


class _Loop:
    """The rollouts of a run: each one generates, scores, trains, saves when due, hands the weights over
    and puts the trainer to sleep (the module docstring has the order), then writes its record."""

    def __init__(self, config: RunConfig, cursor, tokenizer, train_group, rollout, weight_sync, sink,
                 state: RunState, replay: Optional[ReplayShape]):
        self.config, self.cursor, self.tokenizer = config, cursor, tokenizer
        self.replay = replay  # --load-debug-rollout-data: the recorded rollouts, read in place of generating
        self.train_group, self.rollout, self.weight_sync = train_group, rollout, weight_sync
        self.sink, self.state = sink, state
        self.pending = None  # a checkpoint whose streamed optimizer state is still being copied
        self.skipped_in_a_row = 0  # rollouts since the last applied optimizer step
        # the most KV cache and weights an engine reported freeing at a release (the sleep plan leaves the
        # device room for them); None: not measured (not colocated, or an engine that does not say: sglang)
        self.engine_kv_bytes: Optional[int] = None
        self.engine_weight_bytes = 0
        self.engine_copy_pending = False  # the last sleep released weights to rebuild from the engine's copy

    def note_engine_release(self, released: list) -> None:
        """Keep the largest KV cache and weights the engines freed; an engine that reports 0 (sglang does not
        say) leaves them unmeasured, so the sleep plan assumes the engine may take the whole device."""
        from miles.rollout.contract import KV_CACHE, WEIGHTS

        if self.config.rollout.rollout_engine != "embedded":
            return
        reports = [r for r in released if isinstance(r, dict)]
        if any(KV_CACHE in r for r in reports):
            self.engine_kv_bytes = max([int(r.get(KV_CACHE, 0)) for r in reports] + [self.engine_kv_bytes or 0])
        self.engine_weight_bytes = max([int(r.get(WEIGHTS, 0)) for r in reports] + [self.engine_weight_bytes])

    def engine_needs(self):
        """What the next sleep is told of the engine, and whether the next wake will hand each rank the
        engine's weights (the engines on the ranks' GPUs, embedded: :attr:`WeightSync.readback_engines`)."""
        from miles.offload.plan import EngineNeeds

        return EngineNeeds(kv_bytes=self.engine_kv_bytes, weight_bytes=self.engine_weight_bytes,
                           copy_at_wake=self.weight_sync.readback_engines is not None)

    def run(self, rollout_ids) -> None:
        num_rollout = self.config.rollout.num_rollout
        with progress_bar(rollout_ids, total=num_rollout, initial=rollout_ids.start) as bar:
            for rollout_id in bar:
                with waiting(f"rollout {rollout_id + 1}/{num_rollout}"):
                    record = self.rollout_step(rollout_id)
                self.sink.write(record)
                self.state.records.append(record)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:+.3g}")
                logger.info(format_rollout_line(record, num_rollout))
                self.count_skipped_step(record)
        self.publish_pending()
        self.stop_if_nothing_trained()

    def publish_pending(self) -> None:
        if self.pending is not None:
            _publish(self.config, self.train_group, self.pending, self.state)
            self.pending = None

    def stop_if_nothing_trained(self) -> None:
        """A run whose every rollout skipped its optimizer step ends with an error, not as a run that trained."""
        records = self.state.records
        if not records or any(r["step_skipped"] is None for r in records):
            return
        last = records[-1]
        raise SkippedStepsError(
            f"none of this run's {len(records)} rollout(s) applied an optimizer step (the last, rollout "
            f"{last['rollout_id']}: {last['step_skipped']}); the weights are the ones the run started from. Check the "
            "rollout engine's log-probs and the rewards, or lower --lr")

    def stop_if_weights_not_finite(self, rollout_id: int, ranks: list[dict[str, Any]]) -> None:
        """Right after the train step, before any save or weight handoff: a step that left a non-finite weight
        on any rank stops the run. The checkpoint still copying from before that step is published first, so
        the latest checkpoint is the last good one."""
        if all(r["weights_finite"] for r in ranks):
            return
        self.publish_pending()
        lr = self.config.optimizer.lr
        state, ckpt = self.state, self.config.checkpoint
        if state.latest_checkpoint or state.loaded_checkpoint:
            resume_dir = ckpt.save if state.latest_checkpoint else ckpt.load
            good = (f"the latest checkpoint, {state.latest_checkpoint or state.loaded_checkpoint}, holds the weights "
                    f"before it: resume with --load {resume_dir} and a lower --lr (now {lr:g})")
        else:
            good = f"no checkpoint holds earlier weights of this run: start again with a lower --lr (now {lr:g})"
        raise NonFiniteStepError(
            f"rollout {rollout_id}: the optimizer step left non-finite weights (NaN or inf; grad norm "
            f"{ranks[0]['grad_norm']:g}); they were not saved or handed to the rollout engines. {good}, or check "
            "the rewards and --clip-grad")

    def count_skipped_step(self, record: dict[str, Any]) -> None:
        """A skipped optimizer step is logged in full; --max-consecutive-skipped-steps of them in a row stop
        the run (the policy has not learned for that long: the cause is not a one-off)."""
        reason = record["step_skipped"]
        if reason is None:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        limit = self.config.training.max_consecutive_skipped_steps
        logger.warning("rollout %d: the optimizer step was skipped (%d in a row, the run stops at %d): %s",
                       record["rollout_id"], self.skipped_in_a_row, limit, reason)
        if self.skipped_in_a_row >= limit:
            raise SkippedStepsError(
                f"{self.skipped_in_a_row} rollouts in a row skipped their optimizer step (the last, rollout "
                f"{record['rollout_id']}: {reason}); weights and optimizer state are unchanged since rollout "
                f"{record['rollout_id'] - self.skipped_in_a_row + 1} began. Check the rollout engine's log-probs and the "
                "rewards, or lower --lr; --max-consecutive-skipped-steps sets the limit")

    def generate(self, rollout_id: int) -> tuple[list, list[float], list[float]]:
        """Samples of the rollout's prompts, their rewards and GRPO advantages (set on the samples too); with
        --load-debug-rollout-data the recorded samples and rewards instead of generating (the prompt cursor
        moves on as the recording run's did)."""
        from miles.rl import compute_rewards, encode_prompts, grpo_advantages
        from miles.rollout.types import SamplingParams

        r = self.config.rollout
        items = self.cursor.next_batch(r.rollout_batch_size)
        if self.replay is not None:
            samples = self.replay.read(rollout_id)
            rewards = [s.reward for s in samples]
        else:
            prompt_ids = encode_prompts(self.tokenizer, [it.prompt for it in items])
            samples = self.rollout.generate(prompt_ids, SamplingParams.from_config(self.config, rollout_id))
            rewards = compute_rewards([s.response_text for s in samples],
                                      [items[s.prompt_index].answer for s in samples])
        advantages = [float(a) for a in grpo_advantages(rewards, r.n_samples_per_prompt)]
        for s, reward, a in zip(samples, rewards, advantages):
            s.reward, s.advantage = reward, a
        if r.save_debug_rollout_data is not None:
            logger.info("rollout %d recorded to %s", rollout_id,
                        write_rollout(r.save_debug_rollout_data, rollout_id, samples))
        return samples, rewards, advantages

    def save_if_due(self, completed: int) -> Optional[str]:
        """Every --save-interval rollouts and at the end: the streamed state is copied in the background
        while the next rollout runs and published after its step; the run's last checkpoint (nothing to
        overlap with) is waited for at once."""
        config = self.config
        self.publish_pending()  # the previous checkpoint's streamed state copied during this step
        if not _should_save(config, completed):
            return None
        background = config.optimizer.stream_optimizer_state_to_disk and completed < config.rollout.num_rollout
        pending = _save(config, self.train_group, completed, self.cursor, wait=not background)
        if background:
            self.pending = pending
        else:
            _publish(config, self.train_group, pending, self.state, waited=True)
        return pending["base"]

    def rollout_step(self, rollout_id: int) -> dict[str, Any]:
        from miles.rollout.contract import KV_CACHE, WEIGHTS

        colocate = self.config.cluster.colocate
        offload = self.config.offload.offload_train
        timings: dict[str, float] = {}

        @contextlib.contextmanager
        def timed(key: str):
            t = time.perf_counter()
            yield
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - t

        t0 = time.perf_counter()
        with timed("generate_seconds"):
            samples, rewards, advantages = self.generate(rollout_id)
        # the last sleep dropped weights the engine's copy rebuilds: the engine keeps them until the wake read them
        readback = self.weight_sync.readback_engines if colocate and offload and self.engine_copy_pending else None
        with timed("engine_release_seconds"):
            if colocate:
                self.note_engine_release(self.rollout.release_memory([KV_CACHE] if readback else [WEIGHTS, KV_CACHE]))
        with timed("wake_seconds"):
            wake = self.train_group.wake(self.rollout.share_weights(readback) if readback else None) if offload else []
        with timed("engine_release_seconds"):
            if readback:
                self.note_engine_release(self.rollout.release_memory([WEIGHTS]))
        with timed("train_seconds"):
            ranks = self.train_group.train(rollout_id, _shards(samples, advantages, self.config.parallel_layout))
        self.stop_if_weights_not_finite(rollout_id, ranks)
        with timed("save_seconds"):
            saved = self.save_if_due(rollout_id + 1)
        with timed("engine_resume_seconds"):
            if colocate:
                self.rollout.resume_memory([WEIGHTS])
        with timed("weight_sync_seconds"):
            handoff = self.weight_sync.push(rollout_id + 1)
        with timed("sleep_seconds"):
            sleep = self.train_group.sleep(self.engine_needs()) if offload else []
            self.engine_copy_pending = any(s.get("released_for_engine_bytes", 0) for s in sleep)
        with timed("engine_resume_seconds"):
            if colocate:
                self.rollout.resume_memory([KV_CACHE])
        timings["step_seconds"] = time.perf_counter() - t0
        return rollout_record(rollout_id, rewards, samples, ranks, wake, sleep, timings, saved, handoff)


def _save(config: RunConfig, train_group, completed: int, cursor: _DataCursor, wait: bool) -> dict[str, Any]:
    base = checkpoint.prepare(config.checkpoint.save, completed, config.run_id)
    with waiting(f"saving {base}" if wait else f"starting the save of {base}"):
        train_group.save(base, wait)
    return {"base": base, "completed": completed, "data_state": cursor.state()}


def _publish(config: RunConfig, train_group, pending: dict[str, Any], state: RunState,
             waited: bool = False) -> None:
    """Every rank's part is on disk: write the meta, then point ``latest`` at the checkpoint."""
    if not waited:
        with waiting(f"finishing the save of {pending['base']}"):
            train_group.finish_save()
    base = pending["base"]
    checkpoint.write_meta(base, next_rollout_id=pending["completed"], data_state=pending["data_state"],
                          world_size=train_group.world_size, runs=[*state.resumed_runs, config.run_id],
                          extra={"streamed_optimizer_state": config.optimizer.stream_optimizer_state_to_disk,
                                 checkpoint.LAYOUT_META: checkpoint.layout_meta(config.parallel_layout)})
    checkpoint.publish(config.checkpoint.save, base)
    state.checkpoints.append(base)
    state.latest_checkpoint = base
    keep_latest = config.checkpoint.save_keep_latest
    if keep_latest is not None:
        loaded = state.loaded_checkpoint  # set only when this run resumed from a checkpoint
        removed = checkpoint.remove_beyond_latest(config.checkpoint.save, keep_latest, [loaded] if loaded else [])
        state.checkpoints = [c for c in state.checkpoints if c not in removed]
    logger.info("checkpoint complete: %s%s", base,
                "" if waited else " (optimizer state copied in the background during the next rollout)")
