"""The run's directory tree, owned by one object: :class:`RunPaths`.

Everything on node-local disk lives under one root (``--offload-train-disk-dir``); each mechanism
takes its own subdirectory, and no two processes ever share a directory, so cleanup is a plain
``rmtree`` with no coordination::

    <root>/
      trainer/cell<i>_rank<j>/    one per train actor: trainer offload file, TMS_DISK_BACKUP_DIR
      optimizer_state/            --stream-optimizer-state-to-disk (the store appends rank<r:05d>/...)
      rollout/engine<i>/          one per rollout engine: its release_memory backup

The run's own outputs (metrics, TensorBoard) go to ``run_dir``: ``--save`` if given, else
``./runs/<run id>``. Nothing here creates a directory; whoever writes a file creates its folder.
The run creates the root only when its parent exists, and removes what it created at its end
(:meth:`RunPaths.removed_at_exit`), so no output of the run may lie inside those directories.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

TRAINER_SUBDIR = "trainer"
OPTIMIZER_STATE_SUBDIR = "optimizer_state"
ROLLOUT_SUBDIR = "rollout"


ROLLOUT_ID_PLACEHOLDER = "{rollout_id}"  # in --save/--load-debug-rollout-data templates


def rollout_data_path(template: str, rollout_id: int) -> str:
    """The recorded-rollout file of rollout ``rollout_id``: ``template`` with ``{rollout_id}`` replaced (the only
    placeholder; validation refuses templates without it)."""
    return template.replace(ROLLOUT_ID_PLACEHOLDER, str(rollout_id))


def new_run_id() -> str:
    """``<YYYYmmdd-HHMMSS>-<pid>``: names this run's default folders."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def default_root(run_id: str, scratch_root: Optional[str] = None) -> str:
    """The one fallback root when ``--offload-train-disk-dir`` is unset: ``miles-run-<run id>`` under
    ``scratch_root``, else ``$SCRATCH``, else the system temp dir."""
    base = scratch_root or os.environ.get("SCRATCH") or tempfile.gettempdir()
    return os.path.abspath(os.path.join(base, f"miles-run-{run_id}"))


def rank_dir_name(cell: int, rank: int) -> str:
    """``cell<i>_rank<j>``: the name of one train actor's private directory."""
    if cell < 0 or rank < 0:
        raise ValueError(f"cell and rank must be >= 0, got cell={cell} rank={rank}")
    return f"cell{cell}_rank{rank}"


@dataclass(frozen=True)
class RunPaths:
    """Absolute paths of one run. ``root_is_default``: the run chose ``root`` itself and may remove it."""

    root: str
    run_dir: str
    root_is_default: bool = False

    @property
    def trainer(self) -> str:
        """``<root>/trainer``: parent of the per-rank directories."""
        return os.path.join(self.root, TRAINER_SUBDIR)

    @property
    def optimizer_state(self) -> str:
        """``<root>/optimizer_state``: the store's ``dir``."""
        return os.path.join(self.root, OPTIMIZER_STATE_SUBDIR)

    @property
    def rollout(self) -> str:
        """``<root>/rollout``: parent of the rollout engines' backup directories."""
        return os.path.join(self.root, ROLLOUT_SUBDIR)

    def removed_at_exit(self, root_exists: bool) -> tuple[str, ...]:
        """The directories this run creates and removes when it ends, with everything written in them:
        ``trainer/``, ``optimizer_state/``, ``rollout/``, and the root itself when it does not exist yet."""
        return ((self.root,) if not root_exists else ()) + (self.trainer, self.optimizer_state, self.rollout)

    def rank_dir(self, cell: int, rank: int) -> str:
        """``<root>/trainer/cell<i>_rank<j>``."""
        return os.path.join(self.trainer, rank_dir_name(cell, rank))

    def engine_dir(self, engine: int) -> str:
        """``<root>/rollout/engine<i>``."""
        if engine < 0:
            raise ValueError(f"engine index must be >= 0, got {engine}")
        return os.path.join(self.rollout, f"engine{engine}")
