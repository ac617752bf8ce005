"""Directory ownership: one holder at a time, stale locks taken over, teardown removes only its own."""

import json
import multiprocessing as mp
import os

import pytest

from miles_plugins.host.ownership import (CREATED_FILE, LOCK_FILE, DirectoryInUseError,
                                                             DirectoryLock, claim_directory, created_by,
                                                             make_directory, read_record, remove_created)


def _hold_lock(directory, ready, done):
    lock = DirectoryLock.acquire(directory, "run-child")
    ready.set()
    done.wait(30)
    lock.release()


def test_second_holder_in_another_process_is_refused_naming_the_first(tmp_path):
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, done))
    child.start()
    try:
        assert ready.wait(30)
        with pytest.raises(DirectoryInUseError, match=rf"pid {child.pid} .*run run-child"):
            DirectoryLock.acquire(str(tmp_path), "run-parent")
    finally:
        done.set()
        child.join(30)
    lock = DirectoryLock.acquire(str(tmp_path), "run-parent")  # free again once the holder let go
    assert lock.previous is None
    lock.release()
    assert not os.path.exists(tmp_path / LOCK_FILE)


def test_second_holder_in_the_same_process_is_refused(tmp_path):
    lock = DirectoryLock.acquire(str(tmp_path), "a")
    with pytest.raises(DirectoryInUseError, match="run a"):
        DirectoryLock.acquire(str(tmp_path), "b")
    lock.release()
    lock.release()  # twice is fine


def test_lock_of_a_dead_process_is_taken_over_and_logged(tmp_path, caplog):
    # What a killed holder leaves: the record, but no lock (the kernel dropped it with the process).
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 999999, "run_id": "dead",
                                                  "since": 0.0}))
    with caplog.at_level("WARNING"):
        lock = DirectoryLock.acquire(str(tmp_path), "new")
    assert lock.previous.run_id == "dead"
    assert "taking over the lock of pid 999999 on host elsewhere" in caplog.text
    assert read_record(str(tmp_path / LOCK_FILE)).run_id == "new"
    lock.release()


def test_garbage_lock_file_is_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_bytes(b"\x00" * 10_000)
    lock = DirectoryLock.acquire(str(tmp_path), "new")
    assert lock.previous is None and read_record(str(tmp_path / LOCK_FILE)).run_id == "new"
    lock.release()


def test_teardown_removes_only_what_this_run_made(tmp_path):
    mine, theirs, preexisting = tmp_path / "mine", tmp_path / "theirs", tmp_path / "pre"
    assert make_directory(str(mine), "me")
    assert make_directory(str(theirs), "other-job")
    preexisting.mkdir()
    (preexisting / "results.csv").write_text("keep me")
    assert not make_directory(str(preexisting), "me")  # existed: not marked, not ours
    assert created_by(str(mine), "me") and not created_by(str(theirs), "me")

    assert remove_created(str(mine), "me") is None and not mine.exists()
    assert "made by pid" in remove_created(str(theirs), "me") and theirs.exists()
    assert "not made by this run" in remove_created(str(preexisting), "me")
    assert (preexisting / "results.csv").read_text() == "keep me"
    assert remove_created(str(tmp_path / "absent"), "me") is None


def test_teardown_leaves_a_directory_another_run_holds(tmp_path):
    d = tmp_path / "d"
    make_directory(str(d), "me")
    (d / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": 1, "run_id": "other", "since": 0.0}))
    assert "in use by pid 1" in remove_created(str(d), "me")
    assert d.exists()


def test_symlink_is_never_treated_as_ours(tmp_path):
    target = tmp_path / "target"
    make_directory(str(target), "me")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert not created_by(str(link), "me")
    assert remove_created(str(link), "me") is not None
    assert (target / CREATED_FILE).exists()


def _made_by_dead_run(path, host=None):
    import socket

    path.mkdir()
    (path / CREATED_FILE).write_text(json.dumps({"host": host or socket.gethostname(), "pid": 999999,
                                                 "run_id": "dead-run", "since": 0.0}))
    (path / "offload.bin").write_bytes(b"x" * 100)


def test_claim_sweeps_a_directory_left_by_a_dead_run_on_this_host(tmp_path, caplog):
    d = tmp_path / "cell0_rank0"
    _made_by_dead_run(d)
    with caplog.at_level("WARNING"):
        lock = claim_directory(str(d), "new-run", "rank 0 directory")
    assert not (d / "offload.bin").exists(), "the dead run's scratch survived"
    assert created_by(str(d), "new-run")
    assert "left by pid 999999" in caplog.text and "no longer running" in caplog.text
    lock.release()


def test_claim_keeps_what_the_dead_run_did_not_make(tmp_path):
    d = tmp_path / "root"
    _made_by_dead_run(d)
    foreign = d / "other-job"
    assert make_directory(str(foreign), "other-job-run")
    (foreign / "results.csv").write_text("keep")
    lock = claim_directory(str(d), "new-run")
    assert (foreign / "results.csv").read_text() == "keep"
    assert not (d / "offload.bin").exists()
    lock.release()


@pytest.mark.parametrize("case", ["other host", "maker alive"])
def test_claim_leaves_directories_it_cannot_prove_dead(tmp_path, case):
    d = tmp_path / "d"
    if case == "other host":
        _made_by_dead_run(d, host="elsewhere")
    else:
        assert make_directory(str(d), "live-run")  # made by this (live) process
        (d / "offload.bin").write_bytes(b"x")
    lock = claim_directory(str(d), "new-run")
    assert (d / "offload.bin").exists()
    lock.release()
