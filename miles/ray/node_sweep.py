"""Teardown on every node that hosted the run's actors: remove what this run made under the run root there.

Each node writes its ranks' directories under the same root path on its own disk, and an actor there makes
the missing folders on the way (the root, ``trainer/``, ``optimizer_state/``, ``rollout/``), each marked as
this run's. An actor removes its own directory when it exits, not those parents, and an actor that crashed
removes nothing; the driver's backstop (:func:`miles.run_lifecycle.remove_run_directories`) sees only the driver's
filesystem. So once the actors are gone, one task pinned to each other node runs the same
:func:`~miles_plugins.host.ownership.sweep` there (only what this run's markers name is
removed) and reports what it removed and what it left; the driver logs that with its own result, in one
line of each kind (:func:`removed_line`, :func:`left_entries`).

Every sweep of a run root leaves a checkpoint whole (:func:`checkpoint_reason`), wherever it lies: a
``--save`` that ended up inside the run's scratch is never removed with it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from miles.checkpoint import LATEST_FILE, META_FILE
from miles_plugins.host.ownership import ProcessIdentity, Sweep, identity_alive, sweep

SWEEP_TIMEOUT_S = 60.0  # a node that does not answer in this time is reported, not waited for


@dataclass(frozen=True)
class NodeSweep:
    """What the sweep on one node did (``address`` is "unreachable" when it could not run there)."""

    node_id: str
    address: str
    removed: tuple[str, ...]
    left: tuple[str, ...]

    def where(self) -> str:
        return f"node {self.node_id[:12]} ({self.address})"


def wait_for_exit(pids: Sequence[int], timeout_s: float = 15.0) -> None:
    """Wait until these processes of this host are gone: a killed actor's directory locks end with its
    process, and a sweep must not mistake a dying actor for another run holding a directory. Each is
    known by its identity when the wait begins, so a pid reused meanwhile by a new process ends the wait."""
    deadline = time.monotonic() + timeout_s
    running = [ProcessIdentity.of(pid) or ProcessIdentity(pid) for pid in pids]  # pid only: no /proc here
    while any(identity_alive(identity) for identity in running) and time.monotonic() < deadline:
        time.sleep(0.05)


def checkpoint_reason(directory: str) -> str | None:
    """"holds a checkpoint" when ``directory`` is a checkpoint folder (``meta.json``) or a ``--save`` folder
    (``latest_checkpointed_rollout.txt``), as :mod:`miles.checkpoint` lays them out; else None."""
    for name in (LATEST_FILE, META_FILE):
        if os.path.lexists(os.path.join(directory, name)):
            return f"holds a checkpoint ({name})"
    return None


def sweep_run_root(root: str, run_id: str) -> Sweep:
    """Sweep a run root: what the run made goes, except a checkpoint, which stays whole and is reported."""
    return sweep(root, run_id, keep=checkpoint_reason)


def sweep_here(root: str, run_id: str, pids: Sequence[int]) -> tuple[str, list[str], list[str]]:
    """Runs on the swept node: wait for the run's actors there to exit, then sweep. Returns the node's
    address, what was removed and what was left."""
    import ray

    wait_for_exit(pids)
    result = sweep_run_root(root, run_id)
    return ray.util.get_node_ip_address(), result.removed, result.left


def sweep_nodes(node_ids: Sequence[str], root: str, run_id: str, pids_by_node: Mapping[str, Sequence[int]],
                timeout_s: float = SWEEP_TIMEOUT_S) -> list[NodeSweep]:
    """Sweep ``root`` on each node, one node after the other: a root on a filesystem that several nodes share
    (a misconfiguration, or a simulated cluster on one machine) is then never swept by two at once. A node
    that cannot be swept is reported in its result's ``left`` and the teardown goes on."""
    import ray

    from .node_disk import pinned_task  # sizing and torch: only where Ray runs the teardown

    out = []
    for node in node_ids:
        ref = pinned_task(sweep_here, node).remote(root, run_id, list(pids_by_node.get(node, ())))
        try:
            address, removed, left = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            out.append(_not_swept(node, root, f"no answer within {timeout_s:.0f} s"))
            continue
        except ray.exceptions.RayTaskError as exc:  # the sweep itself failed there
            out.append(_not_swept(node, root, f"{type(exc.cause).__name__}: {exc.cause}"))
            continue
        except ray.exceptions.RayError as exc:  # the node is gone, or the task could not be placed there
            out.append(_not_swept(node, root, type(exc).__name__))
            continue
        out.append(NodeSweep(node, address, tuple(removed), tuple(left)))
    return out


def _not_swept(node: str, root: str, why: str) -> NodeSweep:
    return NodeSweep(node, "unreachable", (), (f"{root} (not swept: {why})",))


def removed_line(root: str, here: Sweep, others: Sequence[NodeSweep]) -> str | None:
    """``removed 3 directories this run made under <root>``; with other nodes, how many on each. None when
    nothing was removed anywhere."""
    total = len(here.removed) + sum(len(n.removed) for n in others)
    if not total:
        return None
    line = f"removed {total} director{'y' if total == 1 else 'ies'} this run made under {root}"
    if not others:
        return line
    counts = [f"this node {len(here.removed)}"] + [f"{n.where()} {len(n.removed)}" for n in others]
    return f"{line} ({', '.join(counts)})"


def left_entries(here: Sweep, others: Sequence[NodeSweep]) -> list[str]:
    """Everything left, for one warning; with other nodes, each entry says on which node it is."""
    if not others:
        return list(here.left)
    return ([f"this node: {e}" for e in here.left]
            + [f"{n.where()}: {e}" for n in others for e in n.left])
