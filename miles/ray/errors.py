"""Fail fast on actor errors: wait for a batch of actor calls and raise on the first failure.

Data-parallel ranks block in collectives, so when one rank raises the others hang until their
collective times out. Waiting with ``ray.get(all_refs)`` would then wait for the hung ranks first;
:func:`wait_all` surfaces the first failure as soon as it happens instead, with the actor's traceback.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import ray
from ray.exceptions import RayError

from .actor_logs import unwrap_replies


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


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
    results: dict[Any, Any] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError(f"{what}: no answer from {[label_of[r] for r in pending]} within {timeout} s")
        for ref in ready:
            try:
                results[ref] = ray.get(ref)
            except RayError as e:
                unwrap_replies(list(results.values()))
                raise ActorFailure(what, label_of[ref], e) from e
    return unwrap_replies([results[r] for r in refs])


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
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
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
