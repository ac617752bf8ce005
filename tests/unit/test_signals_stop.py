"""SIGTERM / SIGINT on the driver (miles/run_lifecycle.py: StopOnSignal): the first says at once what is being
stopped and raises RunInterrupted; a second one during teardown, or teardown running past its limit,
exits at once (one line, 128 + signum) instead of being ignored."""

import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A driver: a long actor call (the first sleep), then a teardown that hangs (the second). argv[1:]: the
# teardown limit in seconds (none: the default).
_DRIVER = """
import logging, sys, time
from miles.run_lifecycle import RunInterrupted, StopOnSignal

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
stop = StopOnSignal(*map(float, sys.argv[1:]))
stop.install()
try:
    print("ready", flush=True)
    time.sleep(600)
except RunInterrupted:
    print("interrupted", flush=True)
    time.sleep(600)
"""


class _Driver:
    def __init__(self, *teardown_limit_s):
        self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER, *map(str, teardown_limit_s)], cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def signal_then_wait_interrupted(self, signum):
        self.proc.send_signal(signum)
        assert self.proc.stdout.readline().strip() == "interrupted"

    def exit_within(self, seconds):
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running {seconds} s later: the signal was ignored")
        return code, time.monotonic() - start, self.proc.stderr.read().strip().splitlines()


def test_a_second_signal_during_teardown_exits_at_once_with_one_line():
    driver = _Driver()
    driver.signal_then_wait_interrupted(signal.SIGTERM)
    driver.proc.send_signal(signal.SIGINT)
    code, seconds, lines = driver.exit_within(5)
    assert code == 128 + signal.SIGINT
    assert lines[0] == ("WARNING miles.train: SIGTERM received: stopping the run; teardown gets at most 25 s "
                        "(a second signal stops at once)")
    assert len(lines) == 2 and lines[1].startswith(
        "ERROR miles.train: second signal (SIGINT) during teardown: stopping at once (exit 130);"), lines


def test_teardown_past_its_limit_exits_with_one_line():
    driver = _Driver(1)
    start = time.monotonic()
    driver.signal_then_wait_interrupted(signal.SIGTERM)
    code, _, lines = driver.exit_within(10)
    assert code == 128 + signal.SIGTERM and time.monotonic() - start >= 1
    assert len(lines) == 2 and lines[1].startswith(
        "ERROR miles.train: teardown still running 1 s after SIGTERM: stopping at once (exit 143);"), lines


def test_the_first_signal_names_what_the_driver_was_waiting_for(monkeypatch, caplog):
    from miles.ray import errors
    from miles.run_lifecycle import RunInterrupted, StopOnSignal

    labels = [f"train actor cell0 rank {r}" for r in range(8)]
    monkeypatch.setattr(errors, "_waiting_for", ("train (rollout 3)", labels))
    stop = StopOnSignal()
    try:
        with caplog.at_level("WARNING", logger="miles.train"), pytest.raises(RunInterrupted):
            stop._handle(signal.SIGTERM, None)
    finally:
        stop.restore()  # the teardown limit's timer too
    assert [r.getMessage() for r in caplog.records] == [
        "SIGTERM received: stopping the run, which was waiting for train (rollout 3) on train actor cell0 rank 0, "
        "train actor cell0 rank 1 and 6 more; teardown gets at most 25 s (a second signal stops at once)"]
    stop._deadline.join(5)
    assert stop.received == signal.SIGTERM and not stop._deadline.is_alive(), "restore() cancels the limit"


def test_waiting_for_names_few_actors_in_full():
    from miles.ray import errors

    assert errors.waiting_for() is None
    errors._waiting_for = ("generate", ["rollout engine 0", "rollout engine 1", "rollout engine 2"])
    try:
        assert errors.waiting_for() == "generate on rollout engine 0, rollout engine 1, rollout engine 2"
    finally:
        errors._waiting_for = None
