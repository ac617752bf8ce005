"""tests/spawned.py: a run whose child fails while its peer hangs ends within the grace period, naming each
child's last stage and the hung child's stack; a run that only hangs ends at its limit the same way; a child that
dies without a result (a segfault) ends the run at once with the stack it died in."""

import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from spawned import collect, progress, start  # noqa: E402


def failing(results):
    progress(results, "rank 0", "train rollout 0")
    raise RuntimeError("gloo cannot do that")


def waiting_in_a_collective(results):
    progress(results, "rank 1", "train rollout 0")
    time.sleep(600)


def segfaulting_in_a_kernel(results):
    progress(results, "rank 0", "train rollout 0")
    os.kill(os.getpid(), signal.SIGSEGV)


def finishing(results):
    progress(results, "rank 0", "done")
    return {"rank": 0}


def test_a_failure_beside_a_hung_peer_names_both_stages_and_the_stack():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = start(ctx, results, (failing, (results,)), (waiting_in_a_collective, (results,)))
    begun = time.monotonic()
    with pytest.raises(AssertionError) as caught:
        collect(procs, results, timeout=300, grace=3)
    message = str(caught.value)
    assert time.monotonic() - begun < 60, "the grace after a failure, not the limit"
    assert "rank 0: train rollout 0" in message and "rank 1: train rollout 0" in message
    assert "gloo cannot do that" in message
    assert "waiting_in_a_collective" in message, message  # faulthandler's stack of the hung child
    assert not any(p.is_alive() for p in procs)


def test_a_run_past_its_limit_names_the_last_stages():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = start(ctx, results, (finishing, (results,)), (waiting_in_a_collective, (results,)))
    with pytest.raises(AssertionError) as caught:
        collect(procs, results, timeout=4)
    message = str(caught.value)
    assert "1 of 2 children did not finish" in message
    assert "rank 0: done" in message and "rank 1: train rollout 0" in message
    assert not any(p.is_alive() for p in procs)


def test_a_child_that_segfaults_ends_the_run_at_once_with_its_stack():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = start(ctx, results, (segfaulting_in_a_kernel, (results,)), (waiting_in_a_collective, (results,)))
    begun = time.monotonic()
    with pytest.raises(AssertionError) as caught:
        collect(procs, results, timeout=300)
    message = str(caught.value)
    assert time.monotonic() - begun < 60, "at once, not at the limit"
    assert f"died without a result (exit codes [{-signal.SIGSEGV}])" in message, message
    assert "Segmentation fault" in message and "segfaulting_in_a_kernel" in message, message
    assert "waiting_in_a_collective" in message, message
    assert not any(p.is_alive() for p in procs)
