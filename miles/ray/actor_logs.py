"""Actor log lines, delivered with the call that logged them.

Ray forwards an actor's stderr to the driver by tailing its log files, which on a loaded machine lags by
minutes, so an actor's lines used to print long after, and out of order with, the driver's own lines
about the same call. Instead, every actor method the driver calls is wrapped with :func:`reports_logs`:
the records the ``miles`` / ``miles_plugins`` loggers emit below WARNING during the call are kept (not
printed by the actor) and returned with the result (:class:`ActorReply`); the driver's :func:`unwrap_replies` logs them through
its own logging, labelled with the actor ("rank 0", "engine 0") and with their own timestamps, right
after the call returns and before the driver logs its own line about it.

Warnings and errors still go out through the actor's stderr at once (an actor that dies before
returning still shows them), and when a call raises, the lines it kept are written to the actor's
stderr, so nothing it logged is lost.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from miles.logging_setup import MILES_LOGGERS, stderr_handler

# What the actor's stderr keeps printing during a call (and the reply carries too)
PRINTED_AT_ONCE = logging.WARNING
_KEPT = "miles_kept_for_reply"  # a record attribute: kept for the reply, so not printed to stderr now


@dataclass(frozen=True)
class ActorLine:
    """One log record of an actor, as plain data (it crosses processes)."""

    created: float
    levelno: int
    name: str
    message: str


@dataclass(frozen=True)
class ActorReply:
    """An actor method's result and the lines below WARNING it logged, in the order logged."""

    result: Any
    label: str
    lines: tuple[ActorLine, ...] = field(default_factory=tuple)


def _line(record: logging.LogRecord) -> ActorLine:
    message = record.getMessage()
    if record.exc_info:
        message += "\n" + logging.Formatter().formatException(record.exc_info)
    return ActorLine(record.created, record.levelno, record.name, message)


class _NotKept(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, _KEPT, False)


class ActorLogs(logging.Handler):
    """Keeps the records of the miles loggers while a call runs (one per actor process, installed by
    the actor's constructor after :func:`miles.logging_setup.configure_logging`)."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label
        self._records: list[logging.LogRecord] = []
        self._capturing = False
        self._lock = threading.Lock()  # the store's I/O threads log too
        self._stderr = stderr_handler()
        self._not_kept = _NotKept()
        self._stderr.addFilter(self._not_kept)
        for name in MILES_LOGGERS:
            logging.getLogger(name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= PRINTED_AT_ONCE:
            return
        with self._lock:
            if not self._capturing:
                return
            self._records.append(record)
        setattr(record, _KEPT, True)

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> ActorReply:
        """``fn(*args, **kwargs)`` with its lines kept for the reply (or printed, if it raises)."""
        with self._lock:
            self._capturing, self._records = True, []
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            for record in self._stop():
                delattr(record, _KEPT)
                self._stderr.handle(record)
            raise
        return ActorReply(result, self.label, tuple(_line(r) for r in self._stop()))

    def _stop(self) -> list[logging.LogRecord]:
        with self._lock:
            self._capturing = False
            records, self._records = self._records, []
        return records

    def close(self) -> None:
        """Detach from the loggers and the stderr handler (the actor prints everything itself again)."""
        for name in MILES_LOGGERS:
            logging.getLogger(name).removeHandler(self)
        self._stderr.removeFilter(self._not_kept)
        super().close()


def reports_logs(method: Callable[..., Any]) -> Callable[..., Any]:
    """An actor method whose reply carries its log lines; the actor has an :class:`ActorLogs` at
    ``self.logs``. Only for methods whose caller unwraps the reply (the driver, via
    :func:`miles.ray.errors.wait_all`): methods other actors call return plain results."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return self.logs.call(method, self, *args, **kwargs)

    return wrapper


def emit_lines(replies: Iterable[ActorReply]) -> None:
    """Log the replies' lines through this process's logging, oldest first, each with its own time
    and its actor's label."""
    labelled = sorted(((line, reply.label) for reply in replies for line in reply.lines),
                      key=lambda pair: pair[0].created)
    for line, label in labelled:
        logger = logging.getLogger(line.name)
        if not logger.isEnabledFor(line.levelno):
            continue
        record = logger.makeRecord(line.name, line.levelno, "(actor)", 0, "[%s] %s", (label, line.message), None)
        record.created = line.created
        record.msecs = (line.created - int(line.created)) * 1000
        logger.handle(record)


def unwrap_replies(results: Sequence[Any]) -> list[Any]:
    """The results without their replies' wrapping, after logging the replies' lines (results that are
    not replies pass through)."""
    emit_lines(r for r in results if isinstance(r, ActorReply))
    return [r.result if isinstance(r, ActorReply) else r for r in results]
