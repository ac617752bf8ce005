"""kill -9 inside a save, at random points: the newest complete checkpoint always loads and the resumed
run is bit-identical to an uninterrupted one; a half-written checkpoint never loads. With fp32 moments,
and with fp8e4m3 ones, whose checkpoint adds the stochastic-rounding record (codec_rng.pt).

Each trial: a forked child resumes from iter_1 (saved after 3 steps), takes step 4, saves iter_2 in the
background while step 5 runs, and SIGKILLs itself at the k-th fault point of that save (file chunks,
fsyncs, manifest, rename). A second child then does what a restarted job does: load iter_2, or, when
that is refused, iter_1, and train to step 6.
"""

import itertools
import os
import random
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_checkpoint import (  # noqa: E402,F401  (_restarted_process: autouse fixture)
    CheckpointError, _restarted_process, assert_same, build, in_child, inject_faults, load, save, state, train)

from miles_plugins.optimizers.streaming.io import fileops  # noqa: E402

KILL_POINTS = 24


def _reference_and_iter1(root, iter1, moment_dtype):
    params, opt, store = build("sharded", root, moment_dtype=moment_dtype)
    train(params, opt, range(3))
    save(params, store, iter1)
    train(params, opt, range(3, 6))
    return state(store, params)


def _save_iter2(root, iter1, iter2, kill_at, moment_dtype):
    fileops.COPY_CHUNK_BYTES = 4096  # many fault points inside the file copies
    params, opt, store = build("sharded", root, moment_dtype=moment_dtype)
    assert load(params, opt, store, iter1)
    train(params, opt, range(3, 4))
    calls = itertools.count(1)

    def fault():
        if next(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    inject_faults(fault)
    save(params, store, iter2, wait=False)
    train(params, opt, range(4, 5))  # overwrites buckets while the copy runs
    store.wait_for_save()
    return next(calls) - 1  # fault points of a whole save


def _resume_newest(root, iter1, iter2, moment_dtype):
    params, opt, store = build("sharded", root, moment_dtype=moment_dtype)
    try:
        found, newest, error = load(params, opt, store, iter2), 2, None
    except CheckpointError as e:  # the failed load left a fresh, usable store
        found, newest, error = load(params, opt, store, iter1), 1, str(e)
    assert found is True, "a checkpoint with streamed state must never load as 'no state'"
    train(params, opt, range(4 if newest == 2 else 3, 6))
    return newest, error, state(store, params)


def _killed_child(fn, *args) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            fn(*args)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child not killed: {status}"


@pytest.mark.parametrize("moment_dtype", ["fp32", "fp8e4m3"])  # fp8: + the stochastic-rounding record file
def test_kill_during_save_never_leaves_a_loadable_half_checkpoint(tmp_path, moment_dtype):
    root, iter1 = tmp_path / "live", str(tmp_path / "iter_1")
    ref = in_child(_reference_and_iter1, root, iter1, moment_dtype)
    points = in_child(_save_iter2, root, iter1, str(tmp_path / "complete"), 0, moment_dtype)
    assert points >= 40, points
    newest, _, resumed = in_child(_resume_newest, root, iter1, str(tmp_path / "complete"), moment_dtype)
    assert newest == 2
    assert_same(resumed, ref, "resumed from a complete iter_2")
    # random points, plus the last six (the small files, the manifest, the rename that publishes)
    kills = sorted(set(random.Random(0).sample(range(1, points + 1), KILL_POINTS - 6)) | set(range(points - 5, points + 1)))
    outcomes = {}
    for k in kills:
        iter2 = str(tmp_path / f"iter_2_kill{k:03d}")
        _killed_child(_save_iter2, root, iter1, iter2, k, moment_dtype)
        newest, error, resumed = in_child(_resume_newest, root, iter1, iter2, moment_dtype)
        assert_same(resumed, ref, f"killed at fault point {k}/{points}, resumed from iter_{newest}")
        if newest == 1:
            assert "interrupted save" in error, error
        outcomes[k] = newest
    assert len(kills) >= 20
    assert set(outcomes.values()) == {1, 2}, outcomes  # both sides of the publish were hit
    first_published = min(k for k, n in outcomes.items() if n == 2)
    assert all(n == (2 if k >= first_published else 1) for k, n in outcomes.items()), outcomes
