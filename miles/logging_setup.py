"""Logging, configured in one place: the CLI, the train driver and every Ray actor call
:func:`configure_logging`, so all processes print the same format with the same timestamps."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def configure_logging(level: str) -> None:
    """One stderr handler on the root logger (added once per process) and ``level`` for miles' loggers.

    Only the ``miles`` logger gets ``level``: third-party libraries keep their own (DEBUG on the root
    would flood the log with Ray's and torch's internals).
    """
    root = logging.getLogger()
    if not any(getattr(h, "_miles", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        handler._miles = True  # marks the handler this function installed (idempotence)
        root.addHandler(handler)
    logging.getLogger("miles").setLevel(level.upper())
