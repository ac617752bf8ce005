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

Operator output goes through ``logging``: a progress bar over rollouts on a terminal (no bar in a log
file: whole lines only; :func:`miles.logging_setup.progress_bar`), one line per rollout
(reward, loss, step seconds, streamed GB and GB/s, sleep/wake seconds), metrics as JSONL
(``--metrics-file``, default ``<run dir>/metrics.jsonl``, created when the first record is written) and TensorBoard scalars when TensorBoard is
installed, and a summary at the end that says where the checkpoints are. A failing Ray actor stops
the run: its traceback is logged once, and :class:`RunError` carries one line naming the actor and the
exception it raised; temporary directories are removed either way.

Ownership of the disk: the driver locks the run root before Ray starts and holds it to the end (a
second run on the same root stops at once with exit code 2, naming the first); every directory the
run makes is marked as made by its run id, and teardown removes only those, on the driver's node and on
every other node that hosted the run's actors (:mod:`miles.ray.node_sweep`; one warning lists what else
it found under the root, and on which node). SIGTERM and SIGINT stop the loop at once (one line says so),
run the same teardown (at most 25 s), print one line and exit with 128 + the signal number; a second
signal, or teardown running past its limit, exits at once (:class:`_StopOnSignal`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence

from miles import checkpoint
from miles.config import RunConfig
from miles.logging_setup import configure_logging, progress_bar, set_driver_env
from miles.metrics import MetricsSink, format_rollout_line, log_summary, rollout_record
from miles.ray.node_sweep import (NodeSweep, checkpoint_reason, left_entries, removed_line, sweep_nodes,
                                  sweep_run_root, wait_for_exit)
from miles_plugins.optimizers.streaming.io.ownership import (
    DirectoryInUseError,
    DirectoryLock,
    LockUnsupportedError,
    claim_directory,
    listing,
    make_directory,
)
from miles_plugins.optimizers.streaming.units import GB

logger = logging.getLogger("miles.train")


class RunError(RuntimeError):
    """The run stopped because an actor failed (the message carries the actor's traceback) or a node's disk
    cannot hold what its ranks write (one line naming the node; :mod:`miles.ray.node_disk`)."""


class SkippedStepsError(RuntimeError):
    """--max-consecutive-skipped-steps rollouts in a row could not be trained on (non-finite grads, or
    engine output that is not valid training input): the run stops instead of going on without learning."""


class RunInterrupted(BaseException):
    """SIGTERM or SIGINT arrived: the loop stops, teardown runs, the process exits 128 + signum.

    A BaseException (like KeyboardInterrupt) so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopOnSignal:
    """While installed, the first SIGTERM/SIGINT logs one line at once (what the run was waiting for) and
    raises :class:`RunInterrupted` in the main thread; the driver's waits return to Python every
    :data:`miles.ray.errors.WAKE_S` for it, however long the actor call. Teardown then has
    ``teardown_limit_s``. A second signal, or the limit passing, stops the process at once: one line, then
    ``os._exit(128 + signum)``; Ray ends the actors of a driver that is gone, and the next run on the same
    root removes what they left. ``ray.init`` replaces the driver's SIGTERM handler: call :meth:`install`
    again after it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    TEARDOWN_LIMIT_S = 25.0  # schedulers send SIGKILL about 30 s after SIGTERM: stop first, with a line

    def __init__(self, teardown_limit_s: float = TEARDOWN_LIMIT_S):
        self.received: Optional[int] = None
        self.teardown_limit_s = teardown_limit_s
        self._previous = {}
        self._deadline: Optional[threading.Timer] = None

    def install(self) -> None:
        for signum in self.SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def restore(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self._stop_now(signum, f"second signal ({name}) during teardown")
        self.received = signum
        # the module is loaded by the first actor call; importing Ray here would hold the line back
        errors = sys.modules.get("miles.ray.errors")
        pending = errors.waiting_for() if errors is not None else None
        logger.warning("%s received: stopping the run%s; teardown gets at most %.0f s (a second signal stops at "
                       "once)", name, f", which was waiting for {pending}" if pending else "", self.teardown_limit_s)
        self._deadline = threading.Timer(self.teardown_limit_s, self._stop_now,
                                         (signum, f"teardown still running {self.teardown_limit_s:.0f} s after {name}"))
        self._deadline.daemon = True
        self._deadline.start()
        raise RunInterrupted(signum)

    @staticmethod
    def _stop_now(signum: int, why: str) -> None:
        logger.error("%s: stopping at once (exit %d); the actors end with this process, the next run removes what "
                     "they left", why, 128 + signum)
        os._exit(128 + signum)


def claim_run_root(config: RunConfig) -> DirectoryLock:
    """Lock the run root for this run (made if missing, when its parent exists) and make the mechanisms'
    folders under it.

    Raises :class:`DirectoryInUseError` naming the run that holds the root, FileNotFoundError when the
    root's parent does not exist (nothing is created). The folders are made here, marked with this run's
    id, so that teardown knows them as this run's and removes them. What a killed run left under the root
    is swept first, its checkpoints excepted (:func:`~miles.ray.node_sweep.checkpoint_reason`)."""
    paths = config.paths
    lock = claim_directory(paths.root, config.run_id, "run root (--offload-train-disk-dir)", parents=0,
                           keep=checkpoint_reason)
    for folder in (paths.trainer, paths.optimizer_state, paths.rollout):
        make_directory(folder, config.run_id)
    return lock


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


def _shards(samples: list, advantages: list[float], world: int) -> list[tuple[list, list[float]]]:
    n = len(samples)
    per, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        stop = start + per + (1 if r < extra else 0)
        out.append((samples[start:stop], advantages[start:stop]))
        start = stop
    return out


def _init_ray(config: RunConfig) -> bool:
    """Connect to the cluster at ``config.ray_address`` (``RAY_ADDRESS``) or start a local cluster (returns
    True when this call started Ray)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    set_driver_env()
    # Ray's own INFO lines ("Started a local Ray instance") carry a second timestamp format: warnings only
    address = config.ray_address
    if address:
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
    else:  # a private single-node cluster for this run, bound to loopback
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    return True


# ---- the loop -----------------------------------------------------------------------------------------
def run(config: RunConfig) -> dict[str, Any]:
    """Run the RL loop; returns a summary dict (also logged). Raises :class:`RunError` when an actor fails.

    Exits the process (``SystemExit``) in two cases, each with one line on stderr: the run root is held by
    another run, its filesystem has no file locks, or its parent does not exist (exit code 2, nothing started), or SIGTERM/SIGINT arrived (128 + the signal number, after
    teardown)."""
    configure_logging(config.logging.log_level)
    try:
        root_lock = claim_run_root(config)
    except (DirectoryInUseError, LockUnsupportedError, FileNotFoundError) as e:
        print(f"miles train: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for directory in config.creates:
        logger.info("%s does not exist: this run creates it", directory)
    stop = _StopOnSignal()
    stop.install()
    summary: dict[str, Any] = {"run_dir": config.paths.run_dir, "metrics_file": config.logging.metrics_file,
                               "checkpoints": [], "latest_checkpoint": None, "records": [], "node_sweeps": []}
    try:
        checkpoint.remove_interrupted_saves(config.checkpoint.save)
        return _run_holding_root(config, stop, summary)
    except RunInterrupted as e:
        signum = e.signum
    except SystemError:
        # The handler's RunInterrupted, raised while the main thread was inside a C extension (Ray's
        # CoreWorker.wait), comes back out of it as a SystemError: still the signal.
        if stop.received is None:
            raise
        signum = stop.received
    finally:
        try:
            removed = remove_run_directories(config, summary["node_sweeps"])
            removed += len(checkpoint.remove_unpublished_saves(config.checkpoint.save))  # the ranks are gone
            root_lock.release()
        finally:
            stop.restore()  # only now: a second signal during this cleanup still stops at once
    print(interrupted_line(signum, summary, removed), file=sys.stderr)
    raise SystemExit(128 + signum) from None


def remove_run_directories(config: RunConfig, others: Sequence[NodeSweep] = ()) -> int:
    """The driver's backstop, after the actors are gone: remove every directory under the run root that
    this run made (what an actor that crashed or was killed could not), the root included when the run
    made it; log it with ``others``, the sweeps of the other nodes that hosted actors, and warn once about
    everything else found there or on them. Returns how many directories were removed on all nodes."""
    root = config.paths.root
    here = sweep_run_root(root, config.run_id)
    removed = removed_line(root, here, others)
    if removed:
        logger.info("%s", removed)
    left = left_entries(here, others)
    if left:
        logger.warning("left under %s what this run did not make (or another run holds): %s", root, listing(left))
    return len(here.removed) + sum(len(n.removed) for n in others)


def interrupted_line(signum: int, summary: dict[str, Any], removed: int) -> str:
    """The one line an interrupted run prints: which signal, how far it got, what is safe to resume from."""
    records = summary["records"]
    # rollouts are counted from 1 here, as in the per-rollout log line ("rollout 3/10")
    progress = f"after rollout {records[-1]['rollout_id'] + 1}" if records else "before the first rollout completed"
    latest = summary["latest_checkpoint"] or summary.get("loaded_checkpoint")
    resume = f"checkpoint {latest} is the last complete one" if latest else "no checkpoint was saved"
    return (f"miles train: interrupted by {signal.Signals(signum).name} {progress}; removed {removed} "
            f"director{'y' if removed == 1 else 'ies'}, {resume}")


def _run_holding_root(config: RunConfig, stop: _StopOnSignal, summary: dict[str, Any]) -> dict[str, Any]:
    import ray

    from miles.models import load_tokenizer, prepare_policy
    from miles.ray.errors import ActorFailure
    from miles.ray.node_disk import NodeDiskError
    from miles.ray.placement_group import remove
    from miles.weights.transport import default_shm_dir, sweep_dead_files

    t_run = time.perf_counter()
    source = prepare_policy(config)  # one-time model conversion happens here, not in every actor
    tokenizer = load_tokenizer(config)
    started_ray = _init_ray(config)
    stop.install()  # ray.init replaced the SIGTERM handler
    run = _Actors()
    sink = None
    failure: Optional[BaseException] = None
    try:
        _start_actors(config, run, summary, source)
        start_rollout, cursor = _resume(config, run.train_group, summary)
        # engines start from the trainer's weights (matters after --load or with a pretrained model)
        from miles.ray.weight_sync import WeightSync

        weight_sync = WeightSync(config, run.train_group, run.rollout, summary["train_ranks"],
                                 summary["rollout_engines"], run.use_gpu)
        weight_sync.push(start_rollout)
        if config.offload.offload_train:
            run.train_group.sleep()
        sink = MetricsSink(config.logging.metrics_file, config.logging.tensorboard_dir, config.run_id,
                           summary["resumed_runs"], start_rollout)
        summary["tensorboard_dir"] = sink.tb_dir if sink.tb is not None else None
        loop = _Loop(config, cursor, tokenizer, run.train_group, run.rollout, weight_sync, sink, summary)
        summary["last_record"] = loop.run(range(start_rollout, config.rollout.num_rollout))
    except ActorFailure as e:
        failure = e
        logger.error("%s failed on %s. The actor's traceback:\n%s", e.what, e.actor, e.remote_traceback)
    except (NodeDiskError, SkippedStepsError, checkpoint.CheckpointError) as e:
        failure = e
        logger.error("%s", e)
    except BaseException as e:
        failure = e
        raise
    finally:
        _teardown(run.train_group, run.rollout, run.pg, sink, failed=failure is not None, remove_pg=remove)
        summary["node_sweeps"] = _sweep_actor_nodes(config, run.actor_nodes, _actor_pids_by_node(summary))
        # an actor killed in the middle of a weight handoff ran no cleanup: its host-memory bucket is a file
        sweep_dead_files(default_shm_dir())
        if started_ray:  # after the sweeps: they are Ray tasks
            ray.shutdown()
    summary["seconds"] = time.perf_counter() - t_run
    if failure is not None:
        # the traceback was logged once above; the error itself is the one-line cause
        cause = failure.summary if isinstance(failure, ActorFailure) else str(failure)
        raise RunError(f"run stopped: {cause}") from None
    log_summary(config, summary)
    return summary


class _Actors:
    """What a run started on the cluster (None until started), for its teardown."""

    def __init__(self):
        self.pg = self.train_group = self.rollout = None
        self.use_gpu = False
        self.actor_nodes: list[str] = []


def _start_actors(config: RunConfig, run: _Actors, summary: dict[str, Any], source) -> None:
    """Placement group, the per-node disk check, the train actors and the rollout engines, initialized;
    one line on what runs where."""
    from miles.ray.node_disk import check_node_disks
    from miles.ray.placement_group import bundle_nodes, create_placement_group
    from miles.ray.rollout_manager import RolloutManager
    from miles.ray.train_group import RayTrainGroup

    run.pg, run.use_gpu, _ = create_placement_group(config)
    run.actor_nodes = list(dict.fromkeys(bundle_nodes(run.pg)))  # every node an actor can run on, in bundle order
    # every node's disk against what its ranks will write, before any actor starts
    summary["nodes"] = [vars(n) for n in check_node_disks(config, run.pg)]
    run.train_group = RayTrainGroup(config, run.pg, run.use_gpu)
    run.rollout = RolloutManager(config, run.pg, run.use_gpu)
    logger.info("starting %d train actor(s) and %d rollout engine(s) (each imports torch and builds the "
                "model: this takes a while on a small machine)", len(run.train_group.actors), len(run.rollout.engines))
    infos = run.train_group.init()
    engine_infos = run.rollout.init()
    summary["train_ranks"], summary["rollout_engines"] = infos, engine_infos
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


def _resume(config: RunConfig, train_group, summary: dict[str, Any]) -> tuple[int, "_DataCursor"]:
    """With --load: the checkpoint's model (and optimizer state) into every rank; the rollout to start at
    and the prompt stream's position (both 0 on a fresh start or with --finetune)."""
    from miles.rl import make_prompt_source

    start_rollout, data_position = 0, 0
    resumed_runs: list[str] = []  # the runs whose history this one continues (none when fresh or --finetune)
    ckpt = config.checkpoint
    if ckpt.load:
        base = checkpoint.resolve(ckpt.load)
        if base is None:
            logger.warning("--load %s: no checkpoint there yet, starting fresh", ckpt.load)
        else:
            meta = checkpoint.read_meta(base)
            load_optim = not (ckpt.no_load_optim or ckpt.finetune)
            loaded = train_group.load(base, load_optim)
            if not ckpt.finetune:
                start_rollout = int(meta["next_rollout_id"])
                data_position = int(meta.get("data_state", {}).get("consumed_prompts", 0))
                resumed_runs = checkpoint.runs_of(meta)
            logger.info("loaded %s: model%s; resuming at rollout %d, prompt %d", base,
                        f", optimizer ({loaded[0]['optimizer']})" if load_optim else " only (optimizer skipped)",
                        start_rollout, data_position)
            summary["loaded_checkpoint"] = base
            summary["load_info"] = loaded
    summary["start_rollout"], summary["resumed_runs"] = start_rollout, resumed_runs
    return start_rollout, _DataCursor(make_prompt_source(config), data_position)


class _Loop:
    """The rollouts of a run: each one generates, scores, trains, saves when due, hands the weights over
    and puts the trainer to sleep (the module docstring has the order), then writes its record."""

    def __init__(self, config: RunConfig, cursor, tokenizer, train_group, rollout, weight_sync, sink, summary):
        self.config, self.cursor, self.tokenizer = config, cursor, tokenizer
        self.train_group, self.rollout, self.weight_sync = train_group, rollout, weight_sync
        self.sink, self.summary = sink, summary
        self.pending = None  # a checkpoint whose streamed optimizer state is still being copied
        self.skipped_in_a_row = 0  # rollouts since the last applied optimizer step

    def run(self, rollout_ids) -> Optional[dict]:
        record = None
        num_rollout = self.config.rollout.num_rollout
        with progress_bar(rollout_ids, total=num_rollout, initial=rollout_ids.start) as bar:
            for rollout_id in bar:
                record = self.rollout_step(rollout_id)
                self.sink.write(record)
                self.summary["records"].append(record)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:+.3g}")
                logger.info(format_rollout_line(record, num_rollout))
                self.count_skipped_step(record)
        if self.pending is not None:
            _publish(self.config, self.train_group, self.pending, self.summary)
        return record

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
        """Samples of the rollout's prompts, their rewards and GRPO advantages (set on the samples too)."""
        from miles.rl import compute_rewards, encode_prompts, grpo_advantages
        from miles.rollout.types import SamplingParams

        config = self.config
        items = self.cursor.next_batch(config.rollout.rollout_batch_size)
        prompt_ids = encode_prompts(self.tokenizer, [it.prompt for it in items])
        samples = self.rollout.generate(prompt_ids, SamplingParams.from_config(config, rollout_id))
        rewards = compute_rewards([s.response_text for s in samples], [items[s.prompt_index].answer for s in samples])
        advantages = [float(a) for a in grpo_advantages(rewards, config.rollout.n_samples_per_prompt)]
        for s, r, a in zip(samples, rewards, advantages):
            s.reward, s.advantage = r, a
        return samples, rewards, advantages

    def save_if_due(self, completed: int) -> Optional[str]:
        """Every --save-interval rollouts and at the end: the streamed state is copied in the background
        while the next rollout runs and published after its step; the run's last checkpoint (nothing to
        overlap with) is waited for at once."""
        config = self.config
        if self.pending is not None:  # the previous checkpoint's streamed state copied during this step
            _publish(config, self.train_group, self.pending, self.summary)
            self.pending = None
        if not _should_save(config, completed):
            return None
        background = config.optimizer.stream_optimizer_state_to_disk and completed < config.rollout.num_rollout
        pending = _save(config, self.train_group, completed, self.cursor, wait=not background)
        if background:
            self.pending = pending
        else:
            _publish(config, self.train_group, pending, self.summary, waited=True)
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
        with timed("engine_release_seconds"):
            if colocate:
                self.rollout.release_memory([WEIGHTS, KV_CACHE])
        with timed("wake_seconds"):
            wake = self.train_group.wake() if offload else []
        with timed("train_seconds"):
            ranks = self.train_group.train(rollout_id, _shards(samples, advantages, self.train_group.world_size))
        with timed("save_seconds"):
            saved = self.save_if_due(rollout_id + 1)
        with timed("engine_resume_seconds"):
            if colocate:
                self.rollout.resume_memory([WEIGHTS])
        with timed("weight_sync_seconds"):
            handoff = self.weight_sync.push(rollout_id + 1)
        with timed("sleep_seconds"):
            sleep = self.train_group.sleep() if offload else []
        with timed("engine_resume_seconds"):
            if colocate:
                self.rollout.resume_memory([KV_CACHE])
        timings["step_seconds"] = time.perf_counter() - t0
        return rollout_record(rollout_id, rewards, samples, ranks, wake, sleep, timings, saved, handoff)


def _save(config: RunConfig, train_group, completed: int, cursor: _DataCursor, wait: bool) -> dict[str, Any]:
    base = checkpoint.prepare(config.checkpoint.save, completed, config.run_id)
    train_group.save(base, wait)
    return {"base": base, "completed": completed, "data_state": cursor.state()}


def _publish(config: RunConfig, train_group, pending: dict[str, Any], summary: dict[str, Any],
             waited: bool = False) -> None:
    """Every rank's part is on disk: write the meta, then point ``latest`` at the checkpoint."""
    if not waited:
        train_group.finish_save()
    base = pending["base"]
    checkpoint.write_meta(base, next_rollout_id=pending["completed"], data_state=pending["data_state"],
                          world_size=train_group.world_size, runs=[*summary["resumed_runs"], config.run_id],
                          extra={"streamed_optimizer_state": config.optimizer.stream_optimizer_state_to_disk})
    checkpoint.publish(config.checkpoint.save, base)
    summary["checkpoints"].append(base)
    summary["latest_checkpoint"] = base
    keep_latest = config.checkpoint.save_keep_latest
    if keep_latest is not None:
        loaded = summary.get("loaded_checkpoint")  # set only when this run resumed from a checkpoint
        removed = checkpoint.remove_beyond_latest(config.checkpoint.save, keep_latest, [loaded] if loaded else [])
        summary["checkpoints"] = [c for c in summary["checkpoints"] if c not in removed]
    logger.info("checkpoint complete: %s%s", base,
                "" if waited else " (optimizer state copied in the background during the next rollout)")


def _actor_pids_by_node(summary: dict[str, Any]) -> dict[str, list[int]]:
    """``{node: [pids of the run's actors there]}``, from the actors' infos (none when init did not finish)."""
    out: dict[str, list[int]] = {}
    for info in summary.get("train_ranks", []) + summary.get("rollout_engines", []):
        out.setdefault(info["node_id"], []).append(info["pid"])
    return out


def _sweep_actor_nodes(config: RunConfig, actor_nodes: list[str],
                       pids_by_node: dict[str, list[int]]) -> list[NodeSweep]:
    """Wait for the actors of the driver's node to exit (that node is swept later, in :func:`run`), and sweep
    the run root on every other node that hosted actors, while Ray is still up (none on one node)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    wait_for_exit(pids_by_node.get(here, []))  # a pid means something only on its own host
    others = [node for node in actor_nodes if node != here]
    return sweep_nodes(others, config.paths.root, config.run_id, pids_by_node)


def _teardown(train_group, rollout, pg, sink, failed, remove_pg) -> None:
    grace = 5.0 if failed else 60.0  # a failed run may have ranks stuck in a collective: do not wait long
    if train_group is not None:
        train_group.shutdown(timeout_s=grace)
    if rollout is not None:
        rollout.shutdown(timeout_s=grace)
    if pg is not None:
        remove_pg(pg)
    if sink is not None:
        sink.close()
