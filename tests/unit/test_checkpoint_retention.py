"""Interrupted saves and checkpoint retention: a save cut short by Ctrl-C, SIGTERM or a crash leaves no
half checkpoint behind once the run ends or the next run starts, and ``--save-keep-latest N`` keeps the
newest N complete checkpoints (and always the latest and the one ``--load`` resumed from). Nothing that
this code did not make, and no complete checkpoint beyond the rule, is ever removed."""

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from miles import checkpoint
from miles.config import ArgumentError

from test_safety_checkpoints import _complete_checkpoint, _loadable


class _Group:
    """The driver's view of the train ranks, as ``_save`` and ``_publish`` use it: every rank's part is a
    model file. ``interrupt``: a signal arrives while the ranks write (after part of the files)."""

    world_size = 1

    def __init__(self, payload="new", interrupt=None):
        self.payload, self.interrupt = payload, interrupt

    def save(self, base, wait):
        os.makedirs(os.path.join(base, "model"), exist_ok=True)
        with open(os.path.join(base, "model", "weights"), "w") as f:
            f.write(self.payload)
        if self.interrupt is not None:
            self.interrupt._handle(signal.SIGTERM, None)

    def finish_save(self):
        pass


class _Prompts:
    def __len__(self):
        return 8


def _config(make_config, tmp_path, *flags):
    cfg = make_config("--tiny-model", "--offload-train-disk-dir", str(tmp_path / "root"), "--save",
                      str(tmp_path / "save"), *flags)
    return dataclasses.replace(cfg, run_id="test")


def _save_and_publish(cfg, completed, state, group=None):
    import miles.train as train

    pending = train._save(cfg, group or _Group(), completed, train._DataCursor(_Prompts(), completed), wait=True)
    train._publish(cfg, group or _Group(), pending, state, waited=True)


def _state(**extra):
    from miles.run_lifecycle import RunState

    return RunState(run_dir="/run", metrics_file="/run/metrics.jsonl", **extra)  # as _resume leaves it


def _entries(save):
    return sorted(os.listdir(save))


# ---- retention ---------------------------------------------------------------------------------------
def test_keep_latest_keeps_exactly_n_newest_and_logs_what_it_removed(make_config, tmp_path, caplog):
    cfg = _config(make_config, tmp_path, "--save-keep-latest", "2")
    save, state = cfg.checkpoint.save, _state()
    with caplog.at_level(logging.INFO, logger="miles.checkpoint"):
        for completed in range(1, 6):
            _save_and_publish(cfg, completed, state)
            assert len([n for n in _entries(save) if n.startswith("rollout_")]) == min(completed, 2)
    assert _entries(save) == [checkpoint.LATEST_FILE, "rollout_000004", "rollout_000005"]
    assert checkpoint.resolve(save) == os.path.join(save, "rollout_000005")
    assert state.checkpoints == [os.path.join(save, "rollout_000004"), os.path.join(save, "rollout_000005")]
    removed = [r.getMessage() for r in caplog.records if r.name == "miles.checkpoint" and "rollout_000001" in r.getMessage()]
    assert len(removed) == 1 and "removed" in removed[0] and "newest 2" in removed[0]


def test_keep_latest_never_removes_the_latest_nor_the_loaded_checkpoint(make_config, tmp_path):
    cfg = _config(make_config, tmp_path, "--save-keep-latest", "1")
    save = cfg.checkpoint.save
    for completed in range(1, 6):  # an earlier, longer run
        _complete_checkpoint(save, completed, f"old{completed}")
    loaded = os.path.join(save, "rollout_000002")  # this run resumed from rollout 2 ...
    _save_and_publish(cfg, 3, _state(loaded_checkpoint=loaded))  # ... and saved rollout 3 again
    # the newest (5), the one `latest` names (3) and the one --load resumed from (2)
    assert _entries(save) == [checkpoint.LATEST_FILE, "rollout_000002", "rollout_000003", "rollout_000005"]
    assert checkpoint.resolve(save) == os.path.join(save, "rollout_000003")
    with open(os.path.join(save, "rollout_000003", "model", "weights")) as f:
        assert f.read() == "new"


def test_keep_latest_touches_only_complete_checkpoints_of_its_own_naming(make_config, tmp_path):
    cfg = _config(make_config, tmp_path, "--save-keep-latest", "1")
    save = cfg.checkpoint.save
    outside = _complete_checkpoint(str(tmp_path / "elsewhere"), 1, "outside")
    _complete_checkpoint(save, 1, "one")
    for foreign in ("rollout_5", "rollout_000001.bak", "notes", "rollout_000000"):  # the last: no meta.json
        os.makedirs(os.path.join(save, foreign))
    for named in ("rollout_5", "rollout_000001.bak"):
        with open(os.path.join(save, named, checkpoint.META_FILE), "w") as f:
            f.write("{}")
    os.symlink(outside, os.path.join(save, "rollout_000000007"))  # our naming, but a link to elsewhere
    with open(os.path.join(save, "rollout_000006"), "w") as f:  # our naming, but a file
        f.write("mine")
    _save_and_publish(cfg, 8, _state())
    assert _entries(save) == [checkpoint.LATEST_FILE, "notes", "rollout_000000", "rollout_000000007",
                              "rollout_000001.bak", "rollout_000006", "rollout_000008", "rollout_5"]
    assert checkpoint.read_meta(outside)["data_state"]["payload"] == "outside"


def test_without_the_flag_every_checkpoint_is_kept(make_config, tmp_path):
    cfg = _config(make_config, tmp_path)
    assert cfg.checkpoint.save_keep_latest is None
    for completed in range(1, 4):
        _save_and_publish(cfg, completed, _state())
    assert _entries(cfg.checkpoint.save) == [checkpoint.LATEST_FILE, "rollout_000001", "rollout_000002",
                                             "rollout_000003"]


@pytest.mark.parametrize("flags, match", [
    (("--save", "SAVE", "--save-keep-latest", "0"), r"--save-keep-latest must be >= 1 \(got 0\)"),
    (("--save-keep-latest", "2"), r"--save-keep-latest needs --save"),
])
def test_keep_latest_is_validated(make_config, tmp_path, flags, match):
    flags = [str(tmp_path / "save") if f == "SAVE" else f for f in flags]
    with pytest.raises(ArgumentError, match=match):
        make_config("--tiny-model", *flags)


# ---- interrupted saves: cleaned at the next start ------------------------------------------------------
SAVE_AND_DIE = textwrap.dedent("""
    import os, sys
    from miles import checkpoint
    base = checkpoint.prepare(sys.argv[1], int(sys.argv[2]), run_id="killed-run")
    os.makedirs(os.path.join(base, "model"))
    open(os.path.join(base, "model", "part"), "w").write("half")
    if sys.argv[3] == "die":
        os.kill(os.getpid(), 9)  # SIGKILL mid-save: no cleanup at all
    print("saving", flush=True)
    sys.stdin.read()
""")


def _half_save(save, completed, how):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", SAVE_AND_DIE, save, str(completed), how], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if how == "die":
        child.wait()
        assert child.returncode == -signal.SIGKILL
    else:
        assert child.stdout.readline().strip() == "saving"
    return child


def _run_doing(monkeypatch, cfg, body):
    import miles.train as train

    monkeypatch.setattr(train, "_run_holding_root", body)
    return train.run(cfg)


def test_next_start_removes_half_checkpoints_of_dead_runs_and_keeps_everything_else(make_config, tmp_path,
                                                                                    monkeypatch, caplog):
    cfg = _config(make_config, tmp_path)
    save = cfg.checkpoint.save
    _complete_checkpoint(save, 2, "two")
    _half_save(save, 4, "die")
    assert os.path.isdir(os.path.join(save, "rollout_000004"))
    live = _half_save(save, 6, "wait")  # another run's save in progress
    try:
        os.makedirs(os.path.join(save, "rollout_000008", "model"))  # no record of who made it
        os.makedirs(os.path.join(save, "scratch"))  # not our naming
        with caplog.at_level(logging.INFO, logger="miles.checkpoint"):
            _run_doing(monkeypatch, cfg, lambda config, stop, state: state)
    finally:
        live.stdin.close()
        live.wait()
    assert _entries(save) == [checkpoint.LATEST_FILE, "rollout_000002", "rollout_000006", "rollout_000008",
                              "scratch"]
    assert _loadable(save) == ("two", "two")
    removed = [r for r in caplog.records if "rollout_000004" in r.getMessage()]
    assert len(removed) == 1 and removed[0].levelno == logging.INFO and "removed" in removed[0].getMessage()
    assert "killed-run" in removed[0].getMessage()
    left = [r for r in caplog.records if r.levelno == logging.WARNING and "rollout_000008" in r.getMessage()]
    assert len(left) == 1 and "rollout_000006" in left[0].getMessage() and f"pid {live.pid}" in left[0].getMessage()


def test_next_start_puts_back_a_checkpoint_a_killed_resave_had_set_aside(make_config, tmp_path, monkeypatch):
    cfg = _config(make_config, tmp_path)
    save = cfg.checkpoint.save
    _complete_checkpoint(save, 2, "old")
    _half_save(save, 2, "die")  # re-saving rollout 2 (a resumed run), killed part way
    assert any(".prev-" in n for n in _entries(save))
    _run_doing(monkeypatch, cfg, lambda config, stop, state: state)
    assert _entries(save) == [checkpoint.LATEST_FILE, "rollout_000002"]
    assert _loadable(save) == ("old", "old")
    with open(os.path.join(save, checkpoint.LATEST_FILE)) as f:
        assert f.read().strip() == "rollout_000002"


# ---- interrupted saves: cleaned at the interrupted run's own teardown ----------------------------------
def _interrupted_run(make_config, tmp_path, monkeypatch, completed, capsys):
    import miles.train as train

    cfg = _config(make_config, tmp_path)

    def saving_when_the_signal_arrives(config, stop, state):
        train._save(config, _Group(interrupt=stop), completed, train._DataCursor(_Prompts(), 0), wait=True)
        pytest.fail("the signal did not stop the save")

    with pytest.raises(SystemExit) as exit_info:
        _run_doing(monkeypatch, cfg, saving_when_the_signal_arrives)
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert "miles train: interrupted by SIGTERM" in capsys.readouterr().err
    return cfg.checkpoint.save


@pytest.mark.parametrize("interrupted_rollout", [4, 2], ids=["new save: no half left", "re-save: the old one back"])
def test_an_interrupted_save_leaves_only_the_complete_checkpoint(make_config, tmp_path, monkeypatch, capsys,
                                                                  interrupted_rollout):
    save = str(tmp_path / "save")
    _complete_checkpoint(save, 2, "old")
    _interrupted_run(make_config, tmp_path, monkeypatch, interrupted_rollout, capsys)
    assert _entries(save) == [checkpoint.LATEST_FILE, "rollout_000002"]
    assert _loadable(save) == ("old", "old")


SIGTERM_MID_SAVE = textwrap.dedent("""
    import dataclasses, os, sys, time
    import miles.train as train
    from miles.config import parse_args
    from miles.preflight import Environment, validate_args
    tmp = sys.argv[1]
    os.makedirs(os.path.join(tmp, "scratch"))
    env = Environment(cuda_available=lambda: False, has_module=lambda m: False,
                      scratch_root=os.path.join(tmp, "scratch"), run_id="sigterm-run")
    cfg = validate_args(parse_args(["--tiny-model", "--save", os.path.join(tmp, "save"),
                                    "--metrics-file", os.path.join(tmp, "metrics.jsonl")]), env)

    class Group:
        world_size = 1
        def save(self, base, wait):
            os.makedirs(os.path.join(base, "model"))
            open(os.path.join(base, "model", "part"), "w").write("half")
            print("saving", flush=True)
            time.sleep(60)

    class Prompts:
        def __len__(self):
            return 8

    def body(config, stop, state):
        train._save(config, Group(), 3, train._DataCursor(Prompts(), 0), wait=True)

    train._run_holding_root = body
    train.run(cfg)
""")


def test_a_real_sigterm_during_a_save_leaves_no_half_checkpoint(tmp_path):
    save = str(tmp_path / "save")
    _complete_checkpoint(save, 1, "one")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", SIGTERM_MID_SAVE, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "saving"
    assert os.path.isdir(os.path.join(save, "rollout_000003"))
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM, err
    assert _entries(save) == [checkpoint.LATEST_FILE, "rollout_000001"]
    assert _loadable(save) == ("one", "one")
