"""A run's life around the loop of :mod:`miles.train`: its root, its state, its signals and its teardown.

Ownership of the disk: the driver locks the run root before Ray starts and holds it to the end (a
second run on the same root stops at once with exit code 2, naming the first); every directory the
run makes is marked as made by its run id, and teardown removes only those, on the driver's node and on
every other node that hosted the run's actors (:mod:`miles.ray.node_sweep`; one warning lists what else
it found under the root, and on which node). SIGTERM and SIGINT stop the loop at once (one line says so),
run the same teardown (at most 25 s), print one line and exit with 128 + the signal number; a second
signal, or teardown running past its limit, exits at once (:class:`StopOnSignal`).

What the run did so far is one :class:`RunState`: the loop writes it, teardown and the interrupted line
read it, and :func:`miles.train.run` returns it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from miles import checkpoint
from miles.config import RunConfig
from miles.ray.node_sweep import (NodeSweep, checkpoint_reason, left_entries, removed_line, sweep_nodes,
                                  sweep_run_root, wait_for_exit)
from miles_plugins.host.ownership import (
    DirectoryInUseError,
    DirectoryLock,
    LockUnsupportedError,
    claim_directory,
    listing,
    make_directory,
)

# the run's operator lines come from one logger, whichever module writes them
logger = logging.getLogger("miles.train")


@dataclass
class RunState:
    """What a run did so far: where it writes, what it started, what it loaded, saved and recorded."""

    run_dir: str
    metrics_file: str
    tensorboard_dir: Optional[str] = None  # None: TensorBoard is not installed
    # the cluster: every node's disk check (dicts of miles.ray.node_disk.NodeDisk), the actors' infos
    nodes: list[dict[str, Any]] = field(default_factory=list)
    train_ranks: list[dict[str, Any]] = field(default_factory=list)
    rollout_engines: list[dict[str, Any]] = field(default_factory=list)
    # --load: the checkpoint loaded, what each rank loaded of it, and where the loop starts
    loaded_checkpoint: Optional[str] = None
    load_info: list[dict[str, Any]] = field(default_factory=list)
    start_rollout: int = 0
    resumed_runs: list[str] = field(default_factory=list)  # the runs whose history this one continues
    # the loop: one record per rollout, the checkpoints it published (those retention kept)
    records: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    latest_checkpoint: Optional[str] = None
    # teardown: the sweeps of the other nodes that hosted actors; the run's seconds, once it finished
    node_sweeps: list[NodeSweep] = field(default_factory=list)
    seconds: Optional[float] = None


class RunInterrupted(BaseException):
    """SIGTERM or SIGINT arrived: the loop stops, teardown runs, the process exits 128 + signum.

    A BaseException (like KeyboardInterrupt) so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopOnSignal:
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


RunBody = Callable[[RunConfig, StopOnSignal, RunState], RunState]


def hold_root_and_run(config: RunConfig, body: RunBody) -> RunState:
    """Lock the run root, answer SIGTERM/SIGINT, and run ``body(config, stop, state)``; then remove what
    the run made under the root (its interrupted and unpublished saves too) and release the root.

    Exits the process (``SystemExit``) in three cases, each with one line on stderr: the run root is held by
    another run, its filesystem has no file locks, or its parent does not exist (exit code 2, nothing
    started); --save's marker names no checkpoint (exit code 2, after teardown); or SIGTERM/SIGINT arrived
    (128 + the signal number, after teardown)."""
    try:
        root_lock = claim_run_root(config)
    except (DirectoryInUseError, LockUnsupportedError, FileNotFoundError) as e:
        print(f"miles train: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for directory in config.creates:
        logger.info("%s does not exist: this run creates it", directory)
    stop = StopOnSignal()
    stop.install()
    state = RunState(run_dir=config.paths.run_dir, metrics_file=config.logging.metrics_file)
    try:
        try:
            checkpoint.remove_interrupted_saves(config.checkpoint.save)
        except checkpoint.CheckpointError as e:  # --save's marker names no checkpoint this code can follow
            print(f"miles train: --save: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return body(config, stop, state)
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
            removed = remove_run_directories(config, state.node_sweeps)
            removed += len(checkpoint.remove_unpublished_saves(config.checkpoint.save))  # the ranks are gone
            root_lock.release()
        finally:
            stop.restore()  # only now: a second signal during this cleanup still stops at once
    print(interrupted_line(signum, state, removed), file=sys.stderr)
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


def interrupted_line(signum: int, state: RunState, removed: int) -> str:
    """The one line an interrupted run prints: which signal, how far it got, what is safe to resume from."""
    records = state.records
    # rollouts are counted from 1 here, as in the per-rollout log line ("rollout 3/10")
    progress = f"after rollout {records[-1]['rollout_id'] + 1}" if records else "before the first rollout completed"
    latest = state.latest_checkpoint or state.loaded_checkpoint
    resume = f"checkpoint {latest} is the last complete one" if latest else "no checkpoint was saved"
    return (f"miles train: interrupted by {signal.Signals(signum).name} {progress}; removed {removed} "
            f"director{'y' if removed == 1 else 'ies'}, {resume}")


class Actors:
    """What a run started on the cluster (None until started), for its teardown."""

    def __init__(self):
        self.pg = self.train_group = self.rollout = None
        self.use_gpu = False
        self.actor_nodes: list[str] = []


def tear_down(config: RunConfig, actors: Actors, state: RunState, sink, failed: bool) -> None:
    """Stop the run's actors and remove its placement group, close the metrics ``sink`` (None when not
    opened yet), sweep the run root on every other node that hosted actors (into ``state.node_sweeps``)
    and the host-memory buckets of actors that died mid-handoff. Ray stays up: the caller shuts it down."""
    from miles.ray.placement_group import remove
    from miles.weights.transport import default_shm_dir, sweep_dead_files

    grace = 5.0 if failed else 60.0  # a failed run may have ranks stuck in a collective: do not wait long
    if actors.train_group is not None:
        actors.train_group.shutdown(timeout_s=grace)
    if actors.rollout is not None:
        actors.rollout.shutdown(timeout_s=grace)
    if actors.pg is not None:
        remove(actors.pg)
    if sink is not None:
        sink.close()
    state.node_sweeps = sweep_actor_nodes(config, actors.actor_nodes, actor_pids_by_node(state))
    # an actor killed in the middle of a weight handoff ran no cleanup: its host-memory bucket is a file
    sweep_dead_files(default_shm_dir())


def actor_pids_by_node(state: RunState) -> dict[str, list[int]]:
    """``{node: [pids of the run's actors there]}``, from the actors' infos (none when init did not finish)."""
    out: dict[str, list[int]] = {}
    for info in state.train_ranks + state.rollout_engines:
        out.setdefault(info["node_id"], []).append(info["pid"])
    return out


def sweep_actor_nodes(config: RunConfig, actor_nodes: list[str],
                      pids_by_node: dict[str, list[int]]) -> list[NodeSweep]:
    """Wait for the actors of the driver's node to exit (that node is swept later, by
    :func:`hold_root_and_run`), and sweep the run root on every other node that hosted actors, while Ray is
    still up (none on one node)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    wait_for_exit(pids_by_node.get(here, []))  # a pid means something only on its own host
    others = [node for node in actor_nodes if node != here]
    return sweep_nodes(others, config.paths.root, config.run_id, pids_by_node)
