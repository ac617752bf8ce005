"""Where a ``miles train`` run writes, and what this machine must hold: the checks of validation that look
at disks and host resources (through the :class:`~miles.preflight.environment.Environment`, never directly).

- every directory the run writes is a writable directory, or can be created as one below an existing
  parent (one rule for --offload-train-disk-dir, --save, the metrics file's folder, --tensorboard-dir: the run
  creates the directory a flag names, never its missing parents, and logs each it creates: RunConfig.creates);
- each filesystem has the free space the run will write there (:mod:`miles.preflight.disk_budget`; joining a
  cluster, the driver node's share only: :mod:`miles.ray.node_disk` checks every node once Ray placed the ranks);
- the root is the run's own (not ``/``, a system directory or the home directory), and no output lies in
  a directory the run removes when it ends;
- the placement group fits this machine's CPUs when the run starts its own Ray, colocated engines fit
  the train ranks, and the train ranks' host tiers fit the memory available here.

:func:`miles.preflight.validation.validate_args` calls them once the arguments are resolved (absolute
paths, ``offload_train`` set): the resolved :class:`~miles.config.run_config.RunConfig`; each raises one :class:`~miles.config.errors.ArgumentError`.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from miles.config.arguments import ClusterConfig
from miles.config.errors import ArgumentError
from miles.config.run_config import RunConfig, field_value
from miles.preflight.disk_budget import GIB, disk_budget, model_tensors_of_run, ranks_on_driver_node
from miles.preflight.environment import Environment
from miles_plugins.optimizers.streaming.config import HOST_CACHE_AUTO
from miles_plugins.host.ownership import path_within, system_directory_reason
from miles_plugins.optimizers.streaming.units import MiB

logger = logging.getLogger(__name__)

_ROOT_FLAG = "--offload-train-disk-dir"
_HOST_CACHE_FLAG = "--stream-optimizer-state-host-cache-mb"

__all__ = ["check_disk", "check_fits_this_machine", "check_outputs_outside_scratch", "check_root_is_the_runs_own",
           "driver_node_slots"]


# ---- disk -------------------------------------------------------------------------------------------
def _nearest_existing(path: str, env: Environment) -> str:
    while not env.path_exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _label(flag: str, path: str, is_default: bool) -> str:
    return f"{path} (the default of {flag})" if is_default else f"{flag} {path}"


def _check_directory(flag: str, path: str, env: Environment, is_default: bool = False,
                     where: Optional[str] = None) -> tuple[str, bool]:
    """The one rule of every directory the run writes: ``path`` is a writable directory, or its parent is one
    and the run creates ``path`` itself, never the parents of what a flag names (a mistyped parent would
    otherwise become a tree of its own). A default the run picks (``is_default``) may lack parents too.
    Returns the nearest existing part of ``path`` and whether the run creates ``path``."""
    where = where or _label(flag, path, is_default)
    if env.path_exists(path) and not env.is_dir(path):
        raise ArgumentError(f"{where} is a file, not a directory.", (flag,),
                            f"pass a directory for {flag} (it is created when missing, below an existing parent).")
    existing = _nearest_existing(path, env)
    parent = os.path.dirname(path)
    if not is_default and existing not in (path, parent) and env.is_dir(existing):
        raise ArgumentError(f"{where} cannot be created: its parent {parent} does not exist, and the run creates "
                            f"only the directory {flag} names.", (flag,),
                            f"create the parent first (mkdir -p {parent}), or pass a {flag} whose parent exists.")
    if not env.is_dir(existing):
        raise ArgumentError(f"{where} cannot be created: {existing} is a file.", (flag,),
                            f"pass a directory for {flag} whose parents are directories.")
    if not env.dir_writable(existing):
        raise ArgumentError(f"{where} is not writable: files cannot be created in {existing}.", (flag,),
                            f"pass a directory on a writable local disk for {flag} (e.g. under $SCRATCH or /tmp).")
    return existing, existing != path


def _check_free(flag: str, where: str, existing: str, need: int, what: str, params: int, env: Environment,
                scope: str = "") -> None:
    """``scope``: which ranks the need counts, when not all of them (a cluster's driver node)."""
    free = env.disk_free_bytes(existing)
    if need > free:
        raise ArgumentError(f"{where}: the run needs about {need / GIB:.2f} GiB there ({what}, for {params / 1e6:.1f}M "
                            f"params{scope}) and its filesystem has {free / GIB:.2f} GiB free.", (flag,),
                            f"free space, pass {flag} on a larger disk, or shrink the run (e.g. "
                            "--stream-optimizer-state-moment-dtype fp8e4m3); `miles plan` sizes a run.")


def driver_node_slots(cluster: ClusterConfig, env: Environment) -> int:
    """Bundles the driver's machine can hold: one per GPU, or per --num-cpus-per-rank CPUs without CUDA."""
    return env.gpu_count() if env.cuda_available() else env.cpu_count() // cluster.num_cpus_per_rank


def _ranks_checked_here(cfg: RunConfig, env: Environment) -> tuple[Optional[int], str]:
    """The train ranks whose scratch the root's filesystem must hold (None: all, the run's own single-node
    Ray) and how the error message says so. Joining a cluster, only the driver's node's share lands on this
    disk; the other nodes' disks are checked by the per-node probe once Ray has placed the ranks."""
    if env.ray_address is None:
        return None, ""
    ranks = ranks_on_driver_node(cfg.cluster.num_train_ranks, driver_node_slots(cfg.cluster, env))
    return ranks, (f"; at most {ranks} of the {cfg.cluster.num_train_ranks} train ranks can run on this node of the "
                   f"cluster at {env.ray_address}, each other node's disk is checked when Ray places the ranks")


def _model_tensors(cfg: RunConfig, env: Environment):
    """The policy's tensors as `miles plan` counts them; None when they cannot be known here."""
    hf_config = None
    if cfg.model_source == "hf_checkpoint":
        try:
            hf_config = env.read_json(os.path.join(cfg.model.hf_checkpoint, "config.json"))
        except (OSError, ValueError):
            return None  # the model loader reports an unreadable config.json with its own words
    return model_tensors_of_run(cfg.model_source, hf_config, tp=cfg.training.tensor_model_parallel_size,
                                backend=cfg.training.train_backend)


def _check_output_directories(cfg: RunConfig, env: Environment,
                              metrics_is_default: bool) -> tuple[Optional[str], Optional[str], tuple[str, ...]]:
    """Every directory the run writes by :func:`_check_directory`'s one rule: the nearest existing parts of the
    root (None when nothing writes there) and of --save, and the directories the run creates, named once each
    as the flag gives them."""
    writes_root = cfg.optimizer.stream_optimizer_state_to_disk or cfg.cluster.colocate or cfg.trainer_offload_to_disk
    metrics_file = cfg.logging.metrics_file
    metrics_dir = os.path.dirname(metrics_file)
    checks = [(_ROOT_FLAG, cfg.paths.root, cfg.paths.root_is_default, None)] if writes_root else []
    if cfg.checkpoint.save:
        checks.append(("--save", os.path.abspath(cfg.checkpoint.save), False, None))
    metrics_where = ("the folder of " if metrics_is_default else "the folder of --metrics-file ") + metrics_file
    checks.append(("--metrics-file", metrics_dir, metrics_is_default, f"{metrics_where} ({metrics_dir})"))
    if cfg.logging.tensorboard_dir:
        checks.append(("--tensorboard-dir", os.path.abspath(cfg.logging.tensorboard_dir), False, None))
    existing, creates = {}, {}
    for flag, path, is_default, where in checks:
        existing[flag], created = _check_directory(flag, path, env, is_default, where)
        if created:
            creates.setdefault(path, where or _label(flag, path, is_default))
    return existing.get(_ROOT_FLAG), existing.get("--save"), tuple(creates.values())


def check_disk(cfg: RunConfig, env: Environment, metrics_is_default: bool) -> tuple[str, ...]:
    """Every directory the run writes is usable, and its filesystem holds what the run will write there
    (:mod:`miles.preflight.disk_budget`); ``a`` is resolved (absolute paths, offload_train set). Returns the
    directories the run will create (:attr:`~miles.config.run_config.RunConfig.creates`)."""
    root, save, creates = _check_output_directories(cfg, env, metrics_is_default)

    model = _model_tensors(cfg, env)
    if model is None:
        return creates
    from miles.sizing.estimate import SizingError
    from miles.sizing.sharding import LayoutError

    ranks_here, scope = _ranks_checked_here(cfg, env) if root else (None, "")
    auto_tier = cfg.optimizer.stream_optimizer_state_host_cache_mb == HOST_CACHE_AUTO
    memory = env.host_memory_available() if auto_tier else None
    try:
        budget = disk_budget(cfg, model, ranks_here=ranks_here, memory_available=memory)
    except (SizingError, LayoutError) as exc:  # the layout's own checks (here and in the backend) name it
        logger.warning("free-space check skipped: `miles plan` cannot size this run (%s)", exc)
        return creates
    params = model.total()
    save_with_root = bool(root and save) and env.filesystem_id(save) == env.filesystem_id(root)
    if root:
        need = budget.scratch + (budget.checkpoint if save_with_root else 0)
        _check_free(_ROOT_FLAG, _label(_ROOT_FLAG, cfg.paths.root, cfg.paths.root_is_default), root, need,
                    budget.describe(save_with_root), params, env, scope)
    if save and not save_with_root:
        _check_free("--save", f"--save {cfg.checkpoint.save}", save, budget.checkpoint, "one checkpoint", params, env)
    return creates


# what each output flag would lose if the run's teardown removed the directory it lies in
_OUTPUTS = (("save", "--save", "its checkpoints and metrics"), ("load", "--load", "the checkpoint to resume from"),
            ("metrics_file", "--metrics-file", "the metrics"), ("tensorboard_dir", "--tensorboard-dir",
                                                                  "the TensorBoard logs"))


def check_root_is_the_runs_own(cfg: RunConfig, env: Environment) -> None:
    """The root is not ``/``, a system directory or the home directory itself (as given and resolved)."""
    root = cfg.paths.root
    for candidate in dict.fromkeys((root, env.real_path(root))):
        why = system_directory_reason(candidate, env.home)
        if why is not None:
            raise ArgumentError(
                f"{_label(_ROOT_FLAG, root, cfg.paths.root_is_default)} cannot be the run's root: {why}, and the run "
                "creates its folders there and removes them when it ends.",
                (_ROOT_FLAG,),
                f"pass a directory of its own for {_ROOT_FLAG}, on a node-local disk (e.g. under $SCRATCH "
                "or /tmp).")


def check_outputs_outside_scratch(cfg: RunConfig, env: Environment, metrics_is_default: bool) -> None:
    """No output of the run lies inside (or is) a directory its teardown removes."""
    root = cfg.paths.root
    removed = cfg.paths.removed_at_exit(root_exists=env.path_exists(root))
    for attr, flag, loses in _OUTPUTS:
        given = field_value(cfg, attr)
        if not given:
            continue
        path = os.path.abspath(given)
        for directory in removed:
            if path_within(path, directory) or path_within(env.real_path(path), env.real_path(directory)):
                created = " (it does not exist yet, so the run creates it)" if directory == root else ""
                where = _label(flag, given, attr == "metrics_file" and metrics_is_default)
                raise ArgumentError(
                    f"{where} lies inside {directory}{created}, which this run makes under {_ROOT_FLAG} "
                    f"and removes, with everything in it, when it ends: {loses} would be deleted.",
                    (flag, _ROOT_FLAG),
                    f"pass a {flag} outside {root} (e.g. next to it), or a {_ROOT_FLAG} "
                    f"that does not contain {given}.")


# ---- this machine ------------------------------------------------------------------------------------



def _bundles(cfg: RunConfig) -> int:
    """The placement group's bundles (miles.ray.layout.bundle_specs): one per train rank, and one per
    rollout engine unless the engines share the train ranks' bundles (--colocate)."""
    return cfg.cluster.num_train_ranks + (0 if cfg.cluster.colocate else cfg.cluster.num_rollout_engines)


def _starts_own_ray(env: Environment) -> bool:
    """The run starts a single-node Ray cluster on this machine (miles.train), rather than joining one."""
    return env.ray_address is None and not env.ray_running()


def check_fits_this_machine(cfg: RunConfig, env: Environment) -> None:
    """What Ray would only find out after its placement group timed out, or the store once the actors are
    up: checked here against this machine's CPUs and available memory."""
    if cfg.cluster.colocate and cfg.cluster.num_rollout_engines > cfg.cluster.num_train_ranks:
        raise ArgumentError(
            f"--colocate places each rollout engine on a train rank's bundle, and --num-rollout-engines "
            f"{cfg.cluster.num_rollout_engines} is more than --num-train-ranks {cfg.cluster.num_train_ranks}.",
            ("--colocate", "--num-rollout-engines", "--num-train-ranks"),
            f"pass --num-rollout-engines {cfg.cluster.num_train_ranks} or fewer, or drop --colocate.")
    if _starts_own_ray(env):
        _check_fits_own_ray(cfg, env)
    _check_host_tier_fits(cfg, env)


def _check_fits_own_ray(cfg: RunConfig, env: Environment) -> None:
    """The placement group fits the CPUs of the single-node Ray cluster the run starts (Ray gives it the
    machine's CPUs); otherwise Ray would wait for it until its timeout."""
    bundles, cluster = _bundles(cfg), cfg.cluster
    spelled = (f"--num-train-ranks {cluster.num_train_ranks}" if cluster.colocate else
               f"--num-train-ranks {cluster.num_train_ranks} + --num-rollout-engines {cluster.num_rollout_engines} "
               "(not colocated)")
    fix = ("lower --num-train-ranks, --num-rollout-engines or --num-cpus-per-rank"
           + ("" if cluster.colocate else ", add --colocate (the engines then share the train ranks' bundles)")
           + ", or run on a larger machine (RAY_ADDRESS joins an existing cluster).")
    cpus, need = env.cpu_count(), bundles * cluster.num_cpus_per_rank
    if need > cpus:
        raise ArgumentError(
            f"{spelled} = {bundles} bundles x --num-cpus-per-rank {cfg.cluster.num_cpus_per_rank} = {need} CPUs, and "
            f"this machine has {cpus} for the Ray cluster the run starts.",
            ("--num-train-ranks", "--num-rollout-engines", "--num-cpus-per-rank"),
            fix)


def _check_host_tier_fits(cfg: RunConfig, env: Environment) -> None:
    """Every train rank on this machine takes a host tier of its own, and together they must fit the memory
    the host has available (the store refuses one rank's tier larger than that, once the actors are up)."""
    per_rank = cfg.optimizer.stream_optimizer_state_host_cache_mb
    if not cfg.optimizer.stream_optimizer_state_to_disk or per_rank == HOST_CACHE_AUTO or not per_rank:
        return
    ranks = cfg.cluster.num_train_ranks if _starts_own_ray(env) else ranks_on_driver_node(
        cfg.cluster.num_train_ranks, driver_node_slots(cfg.cluster, env))
    available = env.host_memory_available()
    if available is None or not ranks or ranks * per_rank * MiB <= available:
        return
    raise ArgumentError(
        f"{_HOST_CACHE_FLAG} {per_rank} asks {per_rank * MiB / GIB:.2f} GiB of host RAM for the host tier of "
        f"each of the {ranks} train ranks on this machine ({ranks * per_rank * MiB / GIB:.2f} GiB in all), "
        f"and it has {available / GIB:.2f} GiB available.",
        (_HOST_CACHE_FLAG,),
        f"pass at most {available // ranks // MiB} MiB ({available / GIB:.2f} GiB over {ranks} ranks), or "
        f"{HOST_CACHE_AUTO} (fit to the free memory when the store is built).")
