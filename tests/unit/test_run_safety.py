"""Run-level safety of the disk (issue 13): one owner per directory, teardown removes only what the run
made, stale temporaries of dead writers are cleaned up. Each test reproduces a finding of the issue."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from miles_plugins.host.ownership import (
    CREATED_FILE,
    DirectoryInUseError,
    DirectoryLock,
    make_directory,
    sweep,
)


def _config(make_config, tmp_path, run_id="test"):
    import dataclasses

    cfg = make_config("--tiny-model", "--offload-train-target", "disk", "--offload-train-disk-dir",
                      str(tmp_path / "root"))
    return dataclasses.replace(cfg, run_id=run_id)


def _lock_in_another_process(directory, run_id):
    """A child process that holds the lock on `directory` until its stdin closes."""
    code = ("import sys; from miles_plugins.host.ownership import DirectoryLock; "
            f"DirectoryLock.acquire({str(directory)!r}, {run_id!r}); print('held', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


# ---- finding 1: two runs on one root ------------------------------------------------------------------
def test_second_run_on_a_held_root_is_refused_naming_the_first(make_config, tmp_path):
    from miles.run_lifecycle import claim_run_root

    first = claim_run_root(_config(make_config, tmp_path, "first-run"))
    try:
        with pytest.raises(DirectoryInUseError, match=rf"run root.*pid {os.getpid()}.*run first-run"):
            claim_run_root(_config(make_config, tmp_path, "second-run"))
    finally:
        first.release()


def test_run_exits_2_with_one_line_before_starting_anything(make_config, tmp_path, capsys, monkeypatch):
    import miles.train as train

    cfg = _config(make_config, tmp_path, "second-run")
    os.makedirs(cfg.paths.root)
    holder = _lock_in_another_process(cfg.paths.root, "first-run")
    monkeypatch.setattr(train, "_run_holding_root", lambda *a: pytest.fail("the run started on a held root"))
    try:
        with pytest.raises(SystemExit) as exit_info:
            train.run(cfg)
    finally:
        holder.stdin.close()
        holder.wait()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("miles train: run root") and f"pid {holder.pid}" in err[0]
    assert "first-run" in err[0] and "Traceback" not in err[0]


def test_run_root_lock_is_released_and_its_folders_removed_after_the_run(make_config, tmp_path, monkeypatch):
    import miles.run_lifecycle as run_lifecycle
    import miles.train as train

    cfg = _config(make_config, tmp_path)
    monkeypatch.setattr(train, "_run_holding_root", lambda config, stop, state: state)
    train.run(cfg)
    assert not os.path.exists(cfg.paths.root), "the run made the root: it removes it when it ends"
    run_lifecycle.claim_run_root(cfg).release()  # the next run takes it


def test_signal_raised_inside_a_c_extension_still_ends_as_an_interrupt(make_config, tmp_path, monkeypatch, capsys):
    """Ray's CoreWorker.wait turns the handler's RunInterrupted into a SystemError (seen in CI): the run
    must still tear down, print its one line and exit 128 + signum, not crash with exit 1."""
    import miles.train as train
    from miles.run_lifecycle import RunInterrupted

    cfg = _config(make_config, tmp_path)

    def interrupted_inside_ray(config, stop, state):
        try:
            stop._handle(signal.SIGTERM, None)
        except RunInterrupted as e:
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from e

    monkeypatch.setattr(train, "_run_holding_root", interrupted_inside_ray)
    with pytest.raises(SystemExit) as exit_:
        train.run(cfg)
    assert exit_.value.code == 128 + signal.SIGTERM
    assert "miles train: interrupted by SIGTERM" in capsys.readouterr().err
    assert not os.path.exists(cfg.paths.root)


def test_system_error_without_a_signal_is_not_taken_for_one(make_config, tmp_path, monkeypatch):
    import miles.train as train

    cfg = _config(make_config, tmp_path)

    def broken(config, stop, state):
        raise SystemError("a real bug")

    monkeypatch.setattr(train, "_run_holding_root", broken)
    with pytest.raises(SystemError, match="a real bug"):
        train.run(cfg)


def test_two_offloaders_on_one_directory_are_refused(tmp_path):
    from miles.offload import StorageOffloader

    d = str(tmp_path / "cell0_rank0")
    first = StorageOffloader("disk", d, run_id="run-a")
    with pytest.raises(DirectoryInUseError, match="offload directory .*run run-a"):
        StorageOffloader("disk", d, run_id="run-b")
    first.close(remove_directory=True)
    assert not os.path.exists(d)
    StorageOffloader("disk", d, run_id="run-b").close()  # free again once the first closed


def test_offloader_given_its_callers_lock_writes_into_that_directory(tmp_path):
    from miles.offload import StorageOffloader

    d = str(tmp_path / "rank")
    make_directory(d, "run")
    lock = DirectoryLock.acquire(d, "run")
    off = StorageOffloader("disk", d, run_id="run", lock=lock)
    t = torch.arange(10, dtype=torch.float32)
    off.sleep([t])
    assert os.path.exists(off.path)
    off.wake()
    off.close()
    assert lock.held, "the caller's lock stays the caller's"
    lock.release()
    with pytest.raises(ValueError, match="released"):
        StorageOffloader("disk", d, lock=lock)


def test_train_backend_claims_its_rank_dir_and_keeps_what_it_did_not_make(make_config, tmp_path):
    from miles.backends.torch_backend.trainer import TorchTrainer

    cfg = _config(make_config, tmp_path)
    rank_dir = cfg.paths.rank_dir(0, 0)
    os.makedirs(rank_dir)
    (tmp_path / "root" / "trainer" / "cell0_rank0" / "notes.txt").write_text("someone else's")
    trainer = TorchTrainer(cfg, rank=0, world_size=1, rank_dir=rank_dir)
    trainer.claim_rank_dir()
    other = TorchTrainer(cfg, rank=0, world_size=1, rank_dir=rank_dir)
    with pytest.raises(DirectoryInUseError, match="rank 0 directory"):
        other.claim_rank_dir()
    trainer.release_rank_dir()
    assert os.listdir(rank_dir) == ["notes.txt"], "not made by this run: left, with its contents"

    fresh = TorchTrainer(cfg, rank=1, world_size=2, rank_dir=cfg.paths.rank_dir(0, 1))
    fresh.claim_rank_dir()
    fresh.release_rank_dir()
    fresh.release_rank_dir()  # idempotent (shutdown, then the actor's atexit)
    assert not os.path.exists(cfg.paths.rank_dir(0, 1))


# ---- finding 2: teardown deletes what it did not create -----------------------------------------------
def _foreign_files(root):
    """What the issue found deleted: a results.csv placed before the run and another job's store dir."""
    results = root / "rollout" / "engine0" / "results.csv"
    results.parent.mkdir(parents=True)
    results.write_text("keep")
    theirs = root / "optimizer_state" / "rank00000" / "opt3_0"
    theirs.parent.mkdir(parents=True)
    make_directory(str(theirs), "another-job")
    (theirs / "bucket00000.bin").write_bytes(b"\x01" * 64)
    return results, theirs


def _listed(left, path):
    """True when an entry of `left` is `path` or a directory above it (a foreign tree is listed once)."""
    return any(path == entry.split(" (")[0] or str(path).startswith(entry.split(" (")[0] + os.sep) for entry in left)


def test_sweep_removes_only_this_runs_directories_and_lists_the_rest(tmp_path):
    root = tmp_path / "root"
    results, theirs = _foreign_files(root)
    for d in ("trainer/cell0_rank0", "rollout/engine1"):
        make_directory(str(root / d), "me")
        (root / d / "offload.bin").write_bytes(b"x")
    os.makedirs(root / "trainer" / "cell0_rank0" / "store_made_this")  # unmarked, inside ours: ours

    result = sweep(str(root), "me")

    assert results.read_text() == "keep" and (theirs / "bucket00000.bin").exists()
    assert not (root / "trainer").exists()
    assert _listed(result.left, str(results)) and _listed(result.left, str(theirs))
    # a directory the run did not make is listed whole and never entered, even for what the run made in it
    assert f"{root / 'optimizer_state'} (not made by this run)" in result.left
    assert f"{root / 'rollout'} (not made by this run)" in result.left and (root / "rollout" / "engine1").exists()
    assert str(root / "trainer" / "cell0_rank0") in result.removed


def test_sweep_leaves_a_directory_of_this_run_that_another_run_put_something_in(tmp_path):
    mine = tmp_path / "mine"
    make_directory(str(mine), "me")
    make_directory(str(mine / "theirs"), "other")
    result = sweep(str(mine), "me")
    assert (mine / "theirs" / CREATED_FILE).exists() and result.removed == []
    assert len(result.left) == 1 and "other" in result.left[0]


def test_sweep_leaves_a_directory_another_live_run_holds(tmp_path):
    mine = tmp_path / "mine"
    make_directory(str(mine / "store"), "me")
    holder = _lock_in_another_process(mine / "store", "other-run")
    try:
        result = sweep(str(mine), "me")
    finally:
        holder.stdin.close()
        holder.wait()
    assert (mine / "store").is_dir() and any("in use by" in e for e in result.left)


def test_driver_backstop_warns_once_listing_what_it_left(make_config, tmp_path, caplog):
    from miles.run_lifecycle import claim_run_root, remove_run_directories

    cfg = _config(make_config, tmp_path)
    results, theirs = _foreign_files(tmp_path / "root")
    lock = claim_run_root(cfg)
    lock.release()
    with caplog.at_level("INFO", logger="miles.train"):
        removed = remove_run_directories(cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(theirs.parent.parent) in warnings[0]  # the foreign tree, listed whole
    assert str(results.parent.parent) in warnings[0]
    assert results.exists() and theirs.exists() and removed == 1  # trainer/ (made by this run)
    assert not os.path.exists(cfg.paths.trainer)


def test_rollout_engine_close_keeps_a_backup_directory_it_did_not_make(make_config, tmp_path):
    from miles.models import build_tiny_model, build_tiny_tokenizer
    from miles.rollout.embedded import EmbeddedRolloutEngine

    cfg = _config(make_config, tmp_path)
    engine_dir = cfg.paths.engine_dir(0)
    os.makedirs(engine_dir)
    with open(os.path.join(engine_dir, "results.csv"), "w") as f:
        f.write("keep")
    tok = build_tiny_tokenizer()
    eng = EmbeddedRolloutEngine(cfg, model=build_tiny_model(tok), tokenizer=tok, device="cpu")
    with pytest.raises(DirectoryInUseError):  # a second engine on the same directory
        EmbeddedRolloutEngine(cfg, model=build_tiny_model(tok), tokenizer=tok, device="cpu")
    eng.release_memory_occupation()
    eng.resume_memory_occupation()
    eng.close()
    assert os.listdir(engine_dir) == ["results.csv"]


# ---- finding 6: abandoned temporaries -----------------------------------------------------------------
def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_next_save_removes_temporaries_of_dead_writers_only(tmp_path, caplog):
    from miles import checkpoint

    save = tmp_path / "save"
    dead, alive = _dead_pid(), os.getppid()  # the parent (pytest's launcher) is alive, and not us
    for pid in (dead, alive):
        (save / f"{checkpoint.LATEST_FILE}.tmp{pid}").parent.mkdir(parents=True, exist_ok=True)
        (save / f"{checkpoint.LATEST_FILE}.tmp{pid}").write_text("rollout_000001\n")
    base = checkpoint.prepare(str(save), 2)
    checkpoint.write_meta(str(base), next_rollout_id=2, data_state={}, world_size=1)
    with caplog.at_level("INFO", logger="miles.checkpoint"):
        checkpoint.publish(str(save), base)
    left = sorted(os.listdir(save))
    assert left == sorted([checkpoint.LATEST_FILE, f"{checkpoint.LATEST_FILE}.tmp{alive}", "rollout_000002"])
    assert any(f"process {dead}" in r.getMessage() for r in caplog.records)
    assert json.loads((save / "rollout_000002" / checkpoint.META_FILE).read_text())["next_rollout_id"] == 2


def test_interrupted_line_says_signal_progress_and_checkpoint():
    from miles.run_lifecycle import RunState, interrupted_line

    state = RunState(run_dir="/run", metrics_file="/run/metrics.jsonl", records=[{"rollout_id": 0}, {"rollout_id": 2}],
                     latest_checkpoint="/ck/rollout_000002")
    assert interrupted_line(signal.SIGTERM, state, 3) == (
        "miles train: interrupted by SIGTERM after rollout 3; removed 3 directories, "
        "checkpoint /ck/rollout_000002 is the last complete one")
    assert interrupted_line(signal.SIGINT, RunState(run_dir="/run", metrics_file="/run/metrics.jsonl"), 1) == (
        "miles train: interrupted by SIGINT before the first rollout completed; removed 1 directory, "
        "no checkpoint was saved")
