"""SIGTERM / Ctrl-C while the driver waits on a long actor call (CPU, tiny model): acted on at once, not
when the call returns (the issue measured 121 s for a 120 s engine call).

1. the driver's waits (miles/ray/errors.py: wait_all, close_then_kill) give a signal handler's exception
   back within about a second, with the actor still busy;
2. ``miles train`` whose train call takes 120 s: SIGTERM logs one line within a second naming that call,
   and the run ends with its teardown (143, its directories gone) in bounded time; a second signal during
   that teardown exits at once (130).
"""

import os
import signal
import sys
import time

import pytest

from miles.backends.torch_backend.trainer import TorchTrainer
from test_run_safety_e2e import REPO, _argv, _assert_interrupted, _Run

pytestmark = pytest.mark.e2e

HERE = os.path.dirname(os.path.abspath(__file__))
SLOW_TRAIN_S = 120
STARTED_FILE = "slow-train-started"


class SlowTrainer(TorchTrainer):
    """The torch trainer, except that the train call of rollout 1 takes SLOW_TRAIN_S first; it marks the
    start of that wait with a file next to the run root."""

    def train(self, rollout_id, samples, advantages):
        if rollout_id == 1:
            open(os.path.join(os.path.dirname(self.config.paths.root), STARTED_FILE), "w").close()
            time.sleep(SLOW_TRAIN_S)
        return super().train(rollout_id, samples, advantages)


class _Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise _Alarm()


def _seconds_until_alarm(call, after_s=0.5):
    """Run ``call`` with SIGALRM due in ``after_s`` (its handler raises): seconds until the exception came
    back out, which Ray's C code may hand over wrapped in a SystemError."""
    previous = signal.signal(signal.SIGALRM, _raise_alarm)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, after_s)
    try:
        call()
    except (_Alarm, SystemError) as e:
        assert isinstance(e, _Alarm) or isinstance(e.__cause__ or e.__context__, _Alarm), e
        return time.monotonic() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    pytest.fail(f"the call returned after {time.monotonic() - start:.1f} s without the handler's exception")


@pytest.fixture()
def busy_actor(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Busy:
        def sleep(self, seconds):
            time.sleep(seconds)

        def close(self):
            pass

    actor = Busy.remote()
    ray.get(actor.close.remote())  # started
    yield actor, actor.sleep.remote(30)
    ray.kill(actor, no_restart=True)


def test_wait_all_gives_a_signal_handlers_exception_back_at_once(busy_actor):
    from miles.ray import errors

    actor, ref = busy_actor
    seconds = _seconds_until_alarm(lambda: errors.wait_all([ref], "sleep", ["busy actor 0"]))
    assert seconds < 1.5, f"{seconds:.1f} s"
    assert errors.waiting_for() is None, "a wait that ended says so"


def test_close_then_kill_gives_a_signal_handlers_exception_back_at_once(busy_actor):
    from miles.ray.errors import close_then_kill

    actor, _ = busy_actor
    seconds = _seconds_until_alarm(lambda: close_then_kill([actor], "close", timeout_s=30))
    assert seconds < 1.5, f"{seconds:.1f} s"


def _slow_run(tmp_path):
    launch = ("-c", "import sys; from miles.config import backends; "
                    "backends.BACKENDS['torch'] = 'test_signals_e2e:SlowTrainer'; "
                    "from miles.cli import main; sys.exit(main(sys.argv[1:]))")
    run = _Run(_argv(tmp_path, 3), tmp_path, launch=launch, pythonpath=REPO + os.pathsep + HERE)
    deadline = time.monotonic() + 240
    while not (tmp_path / STARTED_FILE).exists():
        if run.proc.poll() is not None or time.monotonic() > deadline:
            run.proc.kill()
            pytest.fail("the slow train call never started:\n" + "\n".join(run.lines[-40:]))
        time.sleep(0.1)
    time.sleep(1.0)  # the driver is inside its wait for the train call
    return run


def _line_after(run, text, sent, within_s):
    run.wait_for(text, timeout=within_s + 5)
    seconds = time.monotonic() - sent
    assert seconds < within_s, f"{text!r} came {seconds:.1f} s after the signal"
    return next(line for line in run.lines if text in line)


def test_sigterm_during_a_long_train_call_is_acted_on_at_once(tmp_path):
    run = _slow_run(tmp_path)
    try:
        sent = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        line = _line_after(run, "SIGTERM received", sent, 1.5)
        assert "stopping the run, which was waiting for train (rollout 1) on train actor cell0 rank 0" in line
        code = run.finish(timeout=60)
        assert time.monotonic() - sent < 35, "teardown is bounded"
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    _assert_interrupted(run, signal.SIGTERM, tmp_path / "root", code)


def test_a_second_signal_during_teardown_stops_at_once(tmp_path):
    run = _slow_run(tmp_path)
    try:
        run.proc.send_signal(signal.SIGTERM)
        run.wait_for("SIGTERM received", timeout=5)
        time.sleep(0.5)  # teardown: the train actor, busy, gets its grace to close
        sent = time.monotonic()
        run.proc.send_signal(signal.SIGINT)
        code = run.finish(timeout=30)
        assert time.monotonic() - sent < 3, f"exit {time.monotonic() - sent:.1f} s after the second signal"
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert code == 128 + signal.SIGINT, "\n".join(run.lines)
    assert any("second signal (SIGINT) during teardown: stopping at once (exit 130)" in x for x in run.lines)
    assert not any("Traceback" in x for x in run.lines), "\n".join(run.lines)
