"""Pure helpers for the Ray layout: per-rank directories, per-actor environments, bundle specs.

Nothing here imports Ray or torch, so all of it is unit-tested without a cluster.

Directory layout under the shared offload root (``--offload-train-disk-dir``); each mechanism takes
its own subdirectory (the names match ``miles.config.validate_args``'s derived attributes)::

    <root>/
      trainer/                         trainer offload (``args.offload_train_trainer_dir``)
        cell<i>_rank<j>/               one per train actor = its TMS_DISK_BACKUP_DIR; holds the trainer's
                                       offload file while asleep; wiped when the actor starts, removed
                                       when it exits
      optimizer_state/                 --stream-optimizer-state-to-disk (``args.stream_optimizer_state_dir``)
        rank<r:05d>/opt<k>_<uid>/bucket<b:05d>.bin    owned by the store (wiped at start, removed at exit)

``cell`` is the index of the train group (0 for the policy); ``rank`` the data-parallel rank. No two
processes ever share a directory, so cleanup is a plain ``rmtree`` with no coordination.
"""

from __future__ import annotations

import getpass
import glob
import os
import tempfile
from typing import Any, Optional

TRAINER_OFFLOAD_SUBDIR = "trainer"
OPTIMIZER_STATE_SUBDIR = "optimizer_state"
DEFAULT_CHUNK_MB = 256

# Train actor vs. rollout engine share of one bundle when they are colocated. They never run at the
# same time (one sleeps while the other works), so the split only has to let both fit.
COLOCATED_TRAIN_SHARE = 0.75
COLOCATED_ROLLOUT_SHARE = 0.25


def rank_dir_name(cell: int, rank: int) -> str:
    """``cell<i>_rank<j>``: the name of one train actor's private directory."""
    if cell < 0 or rank < 0:
        raise ValueError(f"cell and rank must be >= 0, got cell={cell} rank={rank}")
    return f"cell{cell}_rank{rank}"


def default_offload_root() -> str:
    """Fallback when ``--offload-train-disk-dir`` is unset: a per-user folder in the temp dir."""
    return os.path.join(tempfile.gettempdir(), f"miles-offload-{getpass.getuser()}")


def offload_root(args: Any) -> str:
    root = getattr(args, "offload_train_disk_dir", None) or default_offload_root()
    return os.path.abspath(os.path.expanduser(root))


def trainer_root(args: Any) -> str:
    """``<root>/trainer``: parent of the per-rank directories."""
    return getattr(args, "offload_train_trainer_dir", None) or os.path.join(offload_root(args), TRAINER_OFFLOAD_SUBDIR)


def optimizer_state_root(args: Any) -> str:
    """``<root>/optimizer_state``: the store's ``dir`` (it appends ``rank<r:05d>/opt<k>_<uid>``)."""
    return (getattr(args, "stream_optimizer_state_dir", None)
            or os.path.join(offload_root(args), OPTIMIZER_STATE_SUBDIR))


def rank_dir(args: Any, cell: int, rank: int) -> str:
    """``<root>/trainer/cell<i>_rank<j>``."""
    return os.path.join(trainer_root(args), rank_dir_name(cell, rank))


def offload_enabled(args: Any) -> bool:
    return bool(getattr(args, "offload_train", False))


def offload_target(args: Any) -> str:
    return getattr(args, "offload_train_target", None) or "cpu"


def uses_rank_dirs(args: Any) -> bool:
    """True when some disk mechanism is on, i.e. the actors need their ``cell<i>_rank<j>`` directory."""
    disk_offload = offload_enabled(args) and offload_target(args) == "disk"
    return disk_offload or bool(getattr(args, "stream_optimizer_state_to_disk", False))


def chunk_mb(args: Any) -> int:
    return int(getattr(args, "offload_train_disk_chunk_mb", None) or DEFAULT_CHUNK_MB)


def tms_preload_library() -> Optional[str]:
    """Path of torch_memory_saver's LD_PRELOAD hook, or None when the package (or a GPU torch) is missing."""
    try:
        import torch_memory_saver  # noqa: F401
    except Exception:  # not installed, or it failed to import (no CUDA runtime)
        return None
    try:
        from torch_memory_saver.utils import get_binary_path_from_package

        return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    except Exception:
        pass
    package_dir = os.path.dirname(os.path.abspath(torch_memory_saver.__file__))
    for base in (package_dir, os.path.dirname(package_dir)):
        found = sorted(glob.glob(os.path.join(base, "torch_memory_saver_hook_mode_preload*.so")))
        if found:
            return found[0]
    return None


def rank_env(args: Any, cell: int, rank: int, *, use_gpu: bool,
             tms_library: Optional[str] = None) -> dict[str, str]:
    """Environment variables of one train actor (passed through Ray's ``runtime_env.env_vars``).

    Always: ``MILES_CELL``, ``MILES_RANK``, gloo/NCCL kept on loopback. With a disk mechanism on:
    ``MILES_RANK_DIR`` and ``TMS_DISK_BACKUP_DIR`` (the same per-rank directory). On GPU with trainer
    offload and torch_memory_saver available: ``LD_PRELOAD`` of its hook, ``TMS_INIT_ENABLE=1`` and
    either ``TMS_INIT_ENABLE_DISK_BACKUP=1`` + ``TMS_DISK_BACKUP_CHUNK_MB`` (target disk) or
    ``TMS_INIT_ENABLE_CPU_BACKUP=1`` (target cpu).
    """
    env = {
        "MILES_CELL": str(cell),
        "MILES_RANK": str(rank),
        # torch.distributed rendezvous and data stay on loopback (one node).
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "TOKENIZERS_PARALLELISM": "false",
    }
    threads = max(1, int(float(getattr(args, "num_cpus_per_rank", 1) or 1)))
    env["OMP_NUM_THREADS"] = str(threads)
    if uses_rank_dirs(args):
        directory = rank_dir(args, cell, rank)
        env["MILES_RANK_DIR"] = directory
        env["TMS_DISK_BACKUP_DIR"] = directory
    if use_gpu and offload_enabled(args) and tms_library:
        env["LD_PRELOAD"] = tms_library
        env["TMS_INIT_ENABLE"] = "1"
        if offload_target(args) == "disk":
            env["TMS_INIT_ENABLE_DISK_BACKUP"] = "1"
            env["TMS_DISK_BACKUP_CHUNK_MB"] = str(chunk_mb(args))
        else:
            env["TMS_INIT_ENABLE_CPU_BACKUP"] = "1"
    return env


def num_train_ranks(args: Any) -> int:
    return int(getattr(args, "num_train_ranks", 1) or 1)


def num_rollout_engines(args: Any) -> int:
    return int(getattr(args, "num_rollout_engines", 1) or 1)


def cpus_per_rank(args: Any) -> float:
    return float(getattr(args, "num_cpus_per_rank", 1) or 1)


def bundle_specs(args: Any, use_gpu: bool) -> list[dict[str, float]]:
    """One bundle per train rank; with ``--colocate`` the engines share the train bundles, otherwise
    each engine gets a bundle of its own after the train bundles. GPU bundles hold one GPU each."""
    n_train, n_engines = num_train_ranks(args), num_rollout_engines(args)
    if getattr(args, "colocate", False) and n_engines > n_train:
        raise ValueError(f"--colocate places each rollout engine on a train rank's bundle: "
                         f"--num-rollout-engines ({n_engines}) must be <= --num-train-ranks ({n_train})")
    n_bundles = n_train if getattr(args, "colocate", False) else n_train + n_engines
    bundle: dict[str, float] = {"CPU": cpus_per_rank(args)}
    if use_gpu:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(n_bundles)]


def train_actor_resources(args: Any, use_gpu: bool) -> dict[str, float]:
    share = COLOCATED_TRAIN_SHARE if getattr(args, "colocate", False) else 1.0
    return {"num_cpus": cpus_per_rank(args) * share, "num_gpus": share if use_gpu else 0.0}


def rollout_engine_placement(args: Any, engine: int) -> int:
    """Bundle index of rollout engine ``engine``."""
    if getattr(args, "colocate", False):
        return engine % num_train_ranks(args)
    return num_train_ranks(args) + engine


def rollout_engine_resources(args: Any, use_gpu: bool) -> dict[str, float]:
    share = COLOCATED_ROLLOUT_SHARE if getattr(args, "colocate", False) else 1.0
    return {"num_cpus": cpus_per_rank(args) * share, "num_gpus": share if use_gpu else 0.0}
