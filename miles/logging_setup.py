"""Logging, configured in one place: the CLI, the train driver and every Ray actor call
:func:`configure_logging`, so all processes print the same format with the same timestamps. The driver
also sets :data:`DRIVER_ENV` before Ray starts; what a run shows while it waits (its progress bar) is
:mod:`miles.progress`."""

from __future__ import annotations

import logging
import os
import sys
from typing import MutableMapping

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is at that moment. Whoever replaces ``sys.stderr``
    after set-up (a progress bar, a test's output capture) gets the lines, and a replaced stream that
    was closed since never breaks logging ("I/O operation on closed file")."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the property above decides
        pass


# The packages whose loggers take the run's level: the framework and the optimizer-state store (its
# per-step line, the host tier's and O_DIRECT's lines come from ``miles_plugins``).
MILES_LOGGERS = ("miles", "miles_plugins")


def configure_logging(level: str) -> None:
    """One stderr handler on the root logger (added once per process) and ``level`` for miles' loggers.

    Only the loggers of :data:`MILES_LOGGERS` get ``level``: third-party libraries keep their own (DEBUG
    on the root would flood the log with Ray's and torch's internals).
    """
    stderr_handler()
    for name in MILES_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())


def stderr_handler() -> logging.Handler:
    """The root logger's stderr handler that :func:`configure_logging` installs (installed now if absent)."""
    root = logging.getLogger()
    for handler in root.handlers:
        if getattr(handler, "_miles", False):
            return handler
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler._miles = True  # marks the handler this function installed (idempotence)
    root.addHandler(handler)
    return handler


# Read by the Ray driver when it prints actor lines (RAY_COLOR_PREFIX: no ANSI colour codes in a log file)
# and inherited by the actors of a cluster this process starts (no "Loading weights" bar per actor; the run
# has one progress bar). Set them on `ray start` for a cluster started elsewhere.
DRIVER_ENV = {"RAY_COLOR_PREFIX": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def set_driver_env(environ: MutableMapping[str, str] = os.environ) -> None:
    """Apply :data:`DRIVER_ENV` where the user has not chosen otherwise (call before ``ray.init``)."""
    for key, value in DRIVER_ENV.items():
        environ.setdefault(key, value)
