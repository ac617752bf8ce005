"""Run output: one progress bar on a terminal with every other line above it, whole lines in a log file,
and the driver environment that keeps colour codes and per-actor bars out of the log."""

from __future__ import annotations

import io
import sys

from miles.logging_setup import DRIVER_ENV, set_driver_env
from miles.progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_in_a_log_file():
    log = io.StringIO()
    with progress_bar(range(3), total=3, initial=0, stream=log) as bar:
        assert list(bar) == [0, 1, 2]
        bar.set_postfix(reward="0.5")
    assert log.getvalue() == ""


def test_on_a_terminal_printed_lines_go_above_the_bar(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with progress_bar(range(2), total=2, initial=0, stream=term) as bar:
        for i in bar:
            print(f"(TrainActor pid=1) actor line {i}", file=sys.stderr)  # how Ray prints an actor's line
    assert sys.stderr is term  # restored
    out = term.getvalue()
    for i in range(2):  # the bar is erased (\r), the line written whole, then the bar redrawn below it
        assert f"\r(TrainActor pid=1) actor line {i}\n" in out
    assert "rollouts" in out


def test_driver_env_keeps_the_users_choice():
    env = {"RAY_COLOR_PREFIX": "1"}
    set_driver_env(env)
    assert env == {**DRIVER_ENV, "RAY_COLOR_PREFIX": "1"}
    assert DRIVER_ENV["RAY_COLOR_PREFIX"] == "0"


def test_log_lines_follow_the_current_stderr_not_a_closed_one(monkeypatch):
    import logging

    from miles.logging_setup import configure_logging

    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        root.handlers = [h for h in root.handlers if not getattr(h, "_miles", False)]
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        configure_logging("INFO")  # installed while stderr is `first` (a capture, a bar's wrapper)
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        errors = []
        monkeypatch.setattr(logging, "raiseExceptions", True)
        monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: errors.append(record))
        logging.getLogger("miles.test").info("after the swap")
        assert errors == [], "logging wrote to the closed stream"
        assert "after the swap" in second.getvalue()
    finally:
        root.handlers = saved
