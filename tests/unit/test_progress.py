"""What a run shows while it waits (issue 51: no bar appeared, not even in a terminal, and waits were silent for up
to 2 minutes): on a terminal a line that ticks, the rollout bar included, even on a terminal that reports no size;
in a log file no bar and a line every LOG_EVERY_S seconds of a long wait."""

from __future__ import annotations

import io
import logging
import os
import select
import sys
import time

import pytest

from miles import progress
from miles.progress import progress_bar, waiting


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture()
def fast(monkeypatch):
    monkeypatch.setattr(progress, "TICK_S", 0.05)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.1)


def _drain(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out


def test_the_rollout_bar_shows_on_a_terminal_that_reports_no_size(fast):
    """A pty without a window size (0 x 0, as under `script` or an ssh without a terminal size): tqdm alone draws
    nothing there."""
    master, slave = os.openpty()
    try:
        assert os.get_terminal_size(slave) == (0, 0)
        with open(slave, "w", closefd=False) as term:
            with progress_bar(range(2), total=2, initial=0, stream=term) as bar:
                for _ in bar:
                    time.sleep(0.1)
        shown = _drain(master).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "rollouts:" in shown and "2/2" in shown, repr(shown)


def test_a_wait_on_a_terminal_shows_what_it_waits_for_and_the_time_and_then_erases_it(fast, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with waiting("starting 2 train actor(s)", stream=term):
        time.sleep(0.5)
        print("(TrainActor pid=1) an actor line", file=sys.stderr)  # how Ray prints an actor's line
    out = term.getvalue()
    assert out.count("\rstarting 2 train actor(s): 00:00") >= 3, repr(out)  # redrawn while nothing else happens
    assert "\r(TrainActor pid=1) an actor line\n" in out  # above the line, whole
    assert out.endswith("\r" + " " * len("starting 2 train actor(s): 00:00") + "\r"), repr(out[-80:])  # erased
    assert sys.stderr is term


def test_inside_the_rollout_bar_a_wait_names_itself_on_the_bar(fast):
    term = _Terminal()
    with progress_bar(range(1), total=1, initial=0, stream=term) as bar:
        for _ in bar:
            with waiting("saving /ckpt/iter_0000001", stream=term):
                time.sleep(0.2)
            time.sleep(0.2)
    out = term.getvalue()
    saving = out.index("\rsaving /ckpt/iter_0000001:")
    assert "\rrollouts:" in out[saving:], repr(out)  # the bar's own label again once the save is done


def test_a_long_wait_in_a_log_file_logs_a_line_every_interval_and_draws_nothing(fast, caplog):
    log = io.StringIO()
    with caplog.at_level(logging.INFO, logger="miles"):
        with waiting("placing 2 bundles", stream=log):
            time.sleep(0.35)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) >= 2 and all(line.startswith("placing 2 bundles: still waiting after") for line in lines)
        caplog.clear()
        with waiting("a short one", stream=log):
            pass
        assert caplog.records == []  # a wait shorter than the interval says nothing
    assert log.getvalue() == ""


def test_an_inner_wait_speaks_for_the_run_while_it_lasts(fast, caplog):
    log = io.StringIO()
    with caplog.at_level(logging.INFO, logger="miles"):
        with waiting("rollout 3/8", stream=log):
            with waiting("saving /ckpt/iter_0000003", stream=log):
                time.sleep(0.35)
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(line.startswith("saving /ckpt/iter_0000003: still waiting") for line in lines), lines
