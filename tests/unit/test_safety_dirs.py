"""The directories a run or a store creates and removes never take what they did not make with them:
checkpoints and metrics inside the run's scratch, a user's file in a store directory, the parents of a
deep root, a system directory as the root, and a lock file on a filesystem without locks."""

import dataclasses
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from miles.config import ArgumentError, parse_args
from miles.preflight import Environment, validate_args
from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state
from miles_plugins.host import ownership
from miles_plugins.host.ownership import CREATED_FILE, LOCK_FILE, DirectoryLock, make_directory

from test_store import make_params

BUCKET = 4096 + 100


def _validate(tmp_path, *argv):
    argv = list(argv)
    if "--metrics-file" not in argv:
        argv += ["--metrics-file", str(tmp_path / "metrics.jsonl")]
    env = Environment(cuda_available=lambda: False, has_module=lambda m: m == "tensorboard",
                      scratch_root=str(tmp_path / "scratch"), run_id="test")
    return validate_args(parse_args(argv), env)


def _error(tmp_path, *argv) -> str:
    with pytest.raises(ArgumentError) as ei:
        _validate(tmp_path, *argv)
    return str(ei.value)


def _config(make_config, tmp_path, run_id, *extra):
    cfg = make_config("--tiny-model", "--offload-train-target", "disk", "--offload-train-disk-dir",
                      str(tmp_path / "root"), *extra)
    return dataclasses.replace(cfg, run_id=run_id)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---- 1. outputs inside a directory the run creates and removes ------------------------------------------
@pytest.mark.parametrize("flag, where", [
    ("--save", "root"),                          # a new root: created by the run, removed at its end
    ("--save", "root/ckpt"),
    ("--save", "existing/trainer/ckpt"),         # trainer/ is the run's whether or not the root exists
    ("--metrics-file", "existing/optimizer_state/m.jsonl"),
    ("--tensorboard-dir", "existing/rollout/tb"),
    ("--load", "existing/trainer/old"),
])
def test_an_output_inside_a_directory_the_run_removes_is_refused_naming_both_flags(tmp_path, flag, where):
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "trainer" / "old").mkdir(parents=True)  # --load must exist
    root = tmp_path / ("existing" if where.startswith("existing") else "root")
    path = tmp_path / where
    msg = _error(tmp_path, "--tiny-model", "--offload-train-disk-dir", str(root), flag, str(path))
    assert msg.startswith(f"{flag} {path} lies inside ")
    assert "--offload-train-disk-dir" in msg and "removes" in msg
    assert "Fix: " in msg and f"outside {root}" in msg


def test_an_output_next_to_the_run_scratch_or_in_an_existing_root_is_accepted(tmp_path):
    (tmp_path / "existing").mkdir()
    _validate(tmp_path, "--tiny-model", "--offload-train-disk-dir", str(tmp_path / "root"),
              "--save", str(tmp_path / "ckpt"))
    _validate(tmp_path, "--tiny-model", "--offload-train-disk-dir", str(tmp_path / "existing"),
              "--save", str(tmp_path / "existing"))  # the user's own directory: the run does not remove it


def _checkpoint_of_a_killed_run(make_config, tmp_path):
    """What `--save <root>/trainer/ckpt` of a run killed with kill -9 left: the root and trainer/ marked as
    that run's (its pid is dead), and a complete checkpoint with its metrics inside."""
    root = tmp_path / "root"
    dead = {"host": socket.gethostname(), "pid": _dead_pid(), "run_id": "killed-run", "since": 0.0}
    save = root / "trainer" / "ckpt"
    (save / "rollout_000002").mkdir(parents=True)
    for d in (root, root / "trainer"):
        (d / CREATED_FILE).write_text(json.dumps(dead))
    (save / "rollout_000002" / "meta.json").write_text('{"next_rollout_id": 2}')
    (save / "latest_checkpointed_rollout.txt").write_text("rollout_000002\n")
    (save / "metrics.jsonl").write_text("{}\n")
    return save


def test_relaunch_after_kill_9_keeps_the_checkpoint_it_was_told_to_load(make_config, tmp_path):
    from miles.run_lifecycle import claim_run_root, remove_run_directories

    save = _checkpoint_of_a_killed_run(make_config, tmp_path)
    cfg = _config(make_config, tmp_path, "relaunch")
    lock = claim_run_root(cfg)  # the start-up sweep of what the killed run left
    try:
        assert (save / "rollout_000002" / "meta.json").exists() and (save / "metrics.jsonl").exists()
    finally:
        lock.release()
    remove_run_directories(cfg)
    assert (save / "latest_checkpointed_rollout.txt").exists() and (save / "rollout_000002" / "meta.json").exists()


def test_teardown_sweep_leaves_a_checkpoint_inside_the_run_directories(tmp_path):
    from miles.ray.node_sweep import sweep_run_root

    root = tmp_path / "root"
    make_directory(str(root / "trainer"), "me")
    (root / "trainer" / "ckpt" / "rollout_000001").mkdir(parents=True)
    (root / "trainer" / "ckpt" / "rollout_000001" / "meta.json").write_text("{}")
    make_directory(str(root / "rollout"), "me")
    result = sweep_run_root(str(root), "me")
    assert (root / "trainer" / "ckpt" / "rollout_000001" / "meta.json").exists()
    assert not (root / "rollout").exists()
    assert any("checkpoint" in entry and "ckpt" in entry for entry in result.left)


# ---- 2. the store removes only what a store made in its directory ---------------------------------------
@pytest.mark.parametrize("store_dir", ["lib", "root/optimizer_state"])
def test_a_users_file_in_the_store_directory_is_refused_and_kept(tmp_path, store_dir):
    own = tmp_path / store_dir / "rank00000" / "opt0_0"
    own.mkdir(parents=True)
    (own / "notes.txt").write_text("mine")
    (own / "bucket00000.bin").write_bytes(b"old run")
    with pytest.raises(StoreConfigError, match=r"1 entry the store did not make: notes\.txt.*move"):
        stream_optimizer_state(torch.optim.AdamW(make_params()), dir=str(tmp_path / store_dir), bucket_numel=BUCKET)
    assert (own / "notes.txt").read_text() == "mine"
    assert (own / "bucket00000.bin").read_bytes() == b"old run", "nothing is deleted when something is refused"
    assert not (own / LOCK_FILE).exists()


def test_what_a_store_left_is_still_cleared(tmp_path):
    own = tmp_path / "rank00000" / "opt0_0"
    own.mkdir(parents=True)
    (own / "bucket00999.bin").write_bytes(b"old run")
    (own / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": _dead_pid(), "run_id": "dead", "since": 0.0}))
    store = stream_optimizer_state(torch.optim.AdamW(make_params()), dir=str(tmp_path), bucket_numel=BUCKET)
    assert not (own / "bucket00999.bin").exists()
    store.close()


def test_a_file_added_during_the_run_stays_after_close(tmp_path, caplog):
    store = stream_optimizer_state(torch.optim.AdamW(make_params()), dir=str(tmp_path), bucket_numel=BUCKET)
    own = tmp_path / "rank00000" / "opt0_0"
    (own / "notes.txt").write_text("mine")
    with caplog.at_level("WARNING", logger="miles_plugins"):
        store.close()
    assert (own / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(own)) == ["notes.txt"], "the store's own files and lock are gone"
    assert "notes.txt" in caplog.text and "did not make" in caplog.text


# ---- 5. how far up a root is created, system roots, the size of the warning -----------------------------
def test_a_deep_missing_root_is_refused_and_nothing_is_created(make_config, tmp_path):
    from miles.run_lifecycle import claim_run_root

    cfg = _config(make_config, tmp_path, "deep")
    cfg = dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, root=str(tmp_path / "a" / "b" / "root")))
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / 'a'} does not exist.*create"):
        claim_run_root(cfg)
    assert not (tmp_path / "a").exists()


def test_make_directory_creates_at_most_the_run_tree_below_an_existing_parent(tmp_path):
    assert make_directory(str(tmp_path / "root" / "trainer" / "cell0_rank0"), "me")  # root + its layout
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_directory(str(tmp_path / "a" / "b" / "root" / "trainer" / "cell0_rank0"), "me")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("root", ["/", "/proc", "/etc/miles", "/usr/local/x", "/lib64/x", "/var/lib/miles", "/run/x",
                                  "HOME"])
def test_a_system_root_is_refused_in_one_line(tmp_path, root, monkeypatch):
    if root == "HOME":
        root = os.path.expanduser("~")
    msg = _error(tmp_path, "--tiny-model", "--offload-train-disk-dir", root)
    assert msg.startswith(f"--offload-train-disk-dir {root} ") and "\n" not in msg
    assert "Fix: " in msg


def test_system_scratch_and_a_home_subdirectory_are_accepted(tmp_path):
    _validate(tmp_path, "--tiny-model", "--offload-train-disk-dir", "/var/tmp/miles-test-root")
    _validate(tmp_path, "--tiny-model", "--offload-train-disk-dir", "/dev/shm/miles-test-root")
    _validate(tmp_path, "--tiny-model", "--offload-train-disk-dir", os.path.join(os.path.expanduser("~"), "scratch-x"))


def test_the_store_refuses_a_system_directory(tmp_path):
    with pytest.raises(StoreConfigError, match="system directory /proc"):
        stream_optimizer_state(torch.optim.AdamW(make_params()), dir="/proc/miles-test", bucket_numel=BUCKET)


def test_the_left_behind_warning_is_capped(make_config, tmp_path, caplog):
    from miles.run_lifecycle import claim_run_root, remove_run_directories

    cfg = _config(make_config, tmp_path, "many")
    (tmp_path / "root").mkdir()
    for i in range(400):
        (tmp_path / "root" / f"user{i:04d}.txt").write_text("x")
    claim_run_root(cfg).release()
    with caplog.at_level("WARNING", logger="miles.train"):
        remove_run_directories(cfg)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "400 entries, first 5: " in warning and "user0004.txt" in warning and "user0005.txt" not in warning
    assert len(warning) < 1000


def test_the_start_up_sweep_warning_is_capped(tmp_path, caplog):
    d = tmp_path / "root"
    d.mkdir()
    (d / CREATED_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "run_id": "dead",
                                              "since": 0.0}))
    for i in range(300):
        make_directory(str(d / f"theirs{i:03d}"), "another-run")
    with caplog.at_level("WARNING"):
        ownership.claim_directory(str(d), "new").release()
    [warning] = [r.getMessage() for r in caplog.records if "no longer running" in r.getMessage()]
    assert "300 entries, first 5: " in warning and len(warning) < 1500


# ---- 16. a filesystem without locks ----------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EINVAL, errno.ENOTSUP])
def test_flock_refused_by_the_filesystem_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch, code):
    def no_locks(fd, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ownership.LockUnsupportedError) as ei:
        DirectoryLock.acquire(str(tmp_path), "run", "run root")
    msg = str(ei.value)
    assert str(tmp_path) in msg and errno.errorcode[code] in msg and "local filesystem" in msg
    assert ei.value.errno == code
    assert os.listdir(tmp_path) == []


def test_flock_refused_keeps_a_lock_file_it_did_not_create(tmp_path, monkeypatch):
    (tmp_path / LOCK_FILE).write_text("someone's")
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    with pytest.raises(ownership.LockUnsupportedError):
        DirectoryLock.acquire(str(tmp_path), "run")
    assert (tmp_path / LOCK_FILE).read_text() == "someone's"


def test_a_run_root_on_a_filesystem_without_locks_is_not_left_behind(make_config, tmp_path, monkeypatch):
    from miles.run_lifecycle import claim_run_root

    cfg = _config(make_config, tmp_path, "nolocks")
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    with pytest.raises(ownership.LockUnsupportedError, match=r"run root.*ENOLCK.*local filesystem"):
        claim_run_root(cfg)
    assert not (tmp_path / "root").exists()


def test_miles_train_on_a_filesystem_without_locks_exits_with_one_line(make_config, tmp_path, monkeypatch, capsys):
    from miles.train import run

    cfg = _config(make_config, tmp_path, "nolocks-run")
    monkeypatch.setattr(fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "no locks")))
    with pytest.raises(SystemExit) as exit_info:
        run(cfg)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("miles train: ") and "ENOLCK" in err[0], err


def test_miles_train_with_a_root_whose_parent_is_missing_exits_with_one_line(make_config, tmp_path, capsys):
    from miles.train import run

    cfg = _config(make_config, tmp_path, "parentless")
    cfg = dataclasses.replace(cfg, paths=dataclasses.replace(cfg.paths, root=str(tmp_path / "a" / "b" / "root")))
    with pytest.raises(SystemExit) as exit_info:
        run(cfg)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0], err
    assert not (tmp_path / "a").exists()
