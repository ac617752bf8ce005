"""Fail fast on actor errors: wait for a batch of actor calls and raise on the first failure.

Data-parallel ranks block in collectives, so when one rank raises the others hang until their
collective times out. Waiting with ``ray.get(all_refs)`` would then wait for the hung ranks first;
:func:`wait_all` surfaces the first failure as soon as it happens instead, with the actor's traceback.
"""

from __future__ import annotations

import re
import time
from typing import Any, Optional, Sequence

import ray
from ray.exceptions import RayError

from .actor_logs import unwrap_replies


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A wait inside Ray's C code holds off the driver's signal handlers until it returns: each wait returns at least
# this often, so that SIGTERM / Ctrl-C is acted on at once, not when a long actor call ends.
WAKE_S = 0.2
_waiting_for: Optional[tuple[str, list[str]]] = None  # wait_all's call and the actors it still waits for


class ActorFailure(RuntimeError):
    """A Ray actor call failed. ``str()`` carries the actor's own traceback (what Ray sent back)."""

    def __init__(self, what: str, actor: str, cause: BaseException):
        self.what = what
        self.actor = actor
        self.cause = cause
        self.remote_traceback = _ANSI.sub("", str(cause))
        super().__init__(f"{what} failed on {actor}:\n{self.remote_traceback}")

    @property
    def summary(self) -> str:
        """One line: what failed where, and the exception the actor raised (its traceback's last line)."""
        lines = [line.strip() for line in self.remote_traceback.splitlines() if line.strip()]
        return f"{self.what} failed on {self.actor}: {lines[-1] if lines else type(self.cause).__name__}"


def wait_all(refs: Sequence[Any], what: str, labels: Optional[Sequence[str]] = None,
             timeout: Optional[float] = None) -> list[Any]:
    """``ray.get`` of every ref, raising :class:`ActorFailure` on the first one that fails. The actors'
    log lines that came with the replies are logged here, before the caller logs its own line (on a
    failure: those of the replies that came before it)."""
    refs = list(refs)
    labels = list(labels) if labels is not None else [f"actor {i}" for i in range(len(refs))]
    label_of = {ref: label for ref, label in zip(refs, labels)}
    global _waiting_for
    results: dict[Any, Any] = {}
    pending = list(refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while pending:
            _waiting_for = (what, [label_of[r] for r in pending])
            ready, pending = wait_until(pending, 1, deadline)
            if not ready:
                raise TimeoutError(f"{what}: no answer from {[label_of[r] for r in pending]} within {timeout} s")
            for ref in ready:
                try:
                    results[ref] = ray.get(ref)
                except RayError as e:
                    unwrap_replies(list(results.values()))
                    raise ActorFailure(what, label_of[ref], e) from e
    finally:
        _waiting_for = None
    return unwrap_replies([results[r] for r in refs])


def wait_until(refs: list, num_returns: int, deadline: Optional[float]) -> tuple[list, list]:
    """``ray.wait`` until ``num_returns`` of ``refs`` are ready or ``time.monotonic()`` passes ``deadline``
    (None: no limit), back in Python every :data:`WAKE_S` so that a signal handler runs in time."""
    while True:
        left = WAKE_S if deadline is None else min(WAKE_S, max(0.0, deadline - time.monotonic()))
        ready, pending = ray.wait(refs, num_returns=num_returns, timeout=left)
        if len(ready) >= num_returns or (deadline is not None and time.monotonic() >= deadline):
            return ready, pending


def waiting_for() -> Optional[str]:
    """What the driver's :func:`wait_all` is waiting for now ("train (rollout 3) on train actor cell0 rank 0
    and 3 more"), for the line a signal handler logs; None outside one."""
    if _waiting_for is None:
        return None
    what, labels = _waiting_for
    more = f" and {len(labels) - 2} more" if len(labels) > 3 else ""
    return f"{what} on {', '.join(labels[:2] if more else labels)}{more}"


def close_then_kill(actors: Sequence[Any], method: str, timeout_s: float) -> None:
    """Ask every live actor to run `method` (close its files, remove its directories), wait up to
    `timeout_s`, then kill them all. A dead or failing actor is skipped: the driver's own cleanup of
    the run directories is the backstop."""
    refs = []
    for actor in actors:
        try:
            refs.append(getattr(actor, method).remote())
        except Exception:
            pass
    if refs:
        ready, _ = wait_until(refs, len(refs), time.monotonic() + timeout_s)
        replies = []
        for ref in ready:
            try:
                replies.append(ray.get(ref))
            except Exception:
                pass
        unwrap_replies(replies)
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
