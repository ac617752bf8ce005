"""What a run shows while it waits, in one place: the rollout bar (:func:`progress_bar`) and the long waits
before and inside the loop (:func:`waiting`: model conversion, Ray's start, placement, the actors' start, each
rollout, checkpoint saves and loads).

On a terminal: one line at the bottom, redrawn every :data:`TICK_S` seconds, with every other line (logs, and
the actor lines Ray prints through ``sys.stdout``/``sys.stderr``) written above it. Inside the rollout loop it is
the rollout bar, whose label names the wait in progress; before the loop each wait draws a line of its own
(what it waits for and the time so far) and erases it when done. A terminal that reports no size (a pty
without a window size, where tqdm alone would draw nothing) is taken as :data:`FALLBACK_COLUMNS` wide.

Elsewhere (a log file, a pipe): no bar, so the log holds only whole lines; a wait that lasts
:data:`LOG_EVERY_S` seconds logs one line saying what it still waits for, and again every
:data:`LOG_EVERY_S` seconds, so that a log shows the run is alive.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

LOG_EVERY_S = 30.0
TICK_S = 1.0
FALLBACK_COLUMNS, FALLBACK_ROWS = 80, 24
ROLLOUTS_LABEL = "rollouts"

logger = logging.getLogger("miles.progress")

_bar: Optional[Any] = None  # the tqdm line on the terminal now; None when there is none
_waits: list[list[Any]] = []  # the waits in progress ([what, start]), innermost last


def _has_size(stream: TextIO) -> bool:
    """The terminal reports its width and height (tqdm draws nothing on one of 0 rows)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no fileno (a StringIO), or not a terminal
        return False
    return size.columns > 0 and size.lines > 0


@contextmanager
def _every(seconds: float, action: Callable[[], None]) -> Iterator[None]:
    """``action()`` every ``seconds`` from a daemon thread while the block runs."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(seconds):
            action()

    thread = threading.Thread(target=loop, name="miles-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def _terminal_line(stream: TextIO, **tqdm_args: Any) -> Iterator[Any]:
    """A tqdm line on ``stream``, redrawn every :data:`TICK_S` (its clock moves while nothing else does), with
    every other line written above it."""
    from tqdm import tqdm
    from tqdm.contrib import DummyTqdmFile
    from tqdm.contrib.logging import logging_redirect_tqdm

    global _bar
    size = {"dynamic_ncols": True} if _has_size(stream) else {"ncols": FALLBACK_COLUMNS, "nrows": FALLBACK_ROWS}
    saved = sys.stdout, sys.stderr
    # logging first: it recognises handlers by the real sys.stderr, which the swap below hides
    with logging_redirect_tqdm():
        sys.stdout, sys.stderr = DummyTqdmFile(saved[0]), DummyTqdmFile(saved[1])
        try:
            with tqdm(file=stream, **size, **tqdm_args) as bar:
                _bar = bar
                with _every(TICK_S, bar.refresh):
                    yield bar
        finally:
            _bar = None
            sys.stdout, sys.stderr = saved


@contextmanager
def progress_bar(iterable: Iterable, total: int, initial: int, stream: Optional[TextIO] = None) -> Iterator:
    """The rollout bar on a terminal (``stream``, default ``sys.stderr``); on anything else a bar that draws
    nothing (its ``set_postfix`` still works), so a log file holds only whole lines."""
    from tqdm import tqdm

    stream = stream or sys.stderr
    if not stream.isatty():
        with tqdm(iterable, disable=True) as bar:
            yield bar
        return
    with _terminal_line(stream, iterable=iterable, total=total, initial=initial, desc=ROLLOUTS_LABEL,
                        unit="rollout") as bar:
        yield bar


def _label() -> str:
    return _waits[-1][0] if _waits else ROLLOUTS_LABEL


def _log_if_innermost(wait: list[Any]) -> None:
    if _waits and _waits[-1] is wait:  # an inner wait speaks for the run meanwhile
        logger.info("%s: still waiting after %.0f s", wait[0], time.monotonic() - wait[1])


@contextmanager
def waiting(what: str, stream: Optional[TextIO] = None) -> Iterator[None]:
    """Shows that the run waits for ``what`` ("starting the actors") while the block runs: on the terminal line
    (the rollout bar's label, or a line of its own outside the loop), else a log line every
    :data:`LOG_EVERY_S` seconds once it has lasted that long."""
    stream = stream or sys.stderr
    wait = [what, time.monotonic()]
    _waits.append(wait)
    try:
        if _bar is not None:
            _bar.set_description_str(what)
            yield
        elif stream.isatty():
            with _terminal_line(stream, desc=what, bar_format="{desc}: {elapsed}", leave=False):
                yield
        else:
            with _every(LOG_EVERY_S, lambda: _log_if_innermost(wait)):
                yield
    finally:
        _waits.remove(wait)
        if _bar is not None:
            _bar.set_description_str(_label())
