"""Starting a checkpoint removes only what an interrupted save of this code left, and never follows a link;
a resume never restarts Adam from zero unasked (another streaming mode, optimizer state missing)."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

from miles import checkpoint
from miles_plugins.optimizers.nvme_stream import stream_optimizer_state
from miles_plugins.host.ownership import CREATED_FILE, read_record


def _mark(path, pid, host=None):
    """A folder recorded as made by process ``pid`` of ``host`` (default: this host)."""
    os.makedirs(path)
    with open(os.path.join(path, CREATED_FILE), "w") as f:
        json.dump({"host": host or socket.gethostname(), "pid": pid, "run_id": "other-run", "since": 0.0}, f)


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---- 3. what prepare may remove -------------------------------------------------------------------
def test_a_folder_this_code_did_not_make_is_refused_and_kept(tmp_path):
    save = tmp_path / "save"
    theirs = save / "rollout_000002"
    os.makedirs(theirs)
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot start the checkpoint .*rollout_000002: it has no "
                       r"record of the run that made it \(\.miles-created\).*move it away, or save elsewhere"):
        checkpoint.prepare(str(save), 2)
    assert (theirs / "notes.txt").read_text() == "mine" and os.listdir(theirs) == ["notes.txt"]


@pytest.mark.parametrize("complete", [False, True])
def test_a_symbolic_link_at_the_name_is_refused_and_never_followed(tmp_path, complete):
    save, elsewhere = tmp_path / "save", tmp_path / "elsewhere"
    os.makedirs(save)
    _mark(elsewhere, _dead_pid())  # what the link points at looks like an interrupted save of ours
    if complete:
        (elsewhere / "meta.json").write_text("{}")
    os.symlink(elsewhere, save / "rollout_000002")
    before = sorted(os.listdir(elsewhere))
    with pytest.raises(checkpoint.CheckpointError, match=r"rollout_000002: it is a symbolic link \(to .*elsewhere\), "
                       "which a save never follows"):
        checkpoint.prepare(str(save), 2)
    assert os.path.islink(save / "rollout_000002") and sorted(os.listdir(elsewhere)) == before
    assert sorted(os.listdir(save)) == ["rollout_000002"]  # nothing set aside either


def test_a_file_at_the_name_is_refused(tmp_path):
    save = tmp_path / "save"
    os.makedirs(save)
    (save / "rollout_000002").write_text("data")
    with pytest.raises(checkpoint.CheckpointError, match="rollout_000002: it is not a folder"):
        checkpoint.prepare(str(save), 2)
    assert (save / "rollout_000002").read_text() == "data"


def test_a_folder_being_saved_by_a_live_process_or_of_another_host_is_refused(tmp_path):
    save = tmp_path / "save"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _mark(save / "rollout_000001", live.pid)
        with pytest.raises(checkpoint.CheckpointError, match=rf"it is being saved by pid {live.pid} .*still running"):
            checkpoint.prepare(str(save), 1)
    finally:
        live.kill()
        live.wait()
    _mark(save / "rollout_000002", 1, host="another-host")
    with pytest.raises(checkpoint.CheckpointError, match="another-host.*this host cannot tell whether it still runs"):
        checkpoint.prepare(str(save), 2)
    assert os.path.isdir(save / "rollout_000002")


def test_an_interrupted_save_of_a_dead_process_is_removed_and_said(tmp_path, caplog):
    save = tmp_path / "save"
    _mark(save / "rollout_000002", _dead_pid())
    (save / "rollout_000002" / "model").mkdir()
    with caplog.at_level(logging.INFO, logger="miles.checkpoint"):
        base = checkpoint.prepare(str(save), 2, run_id="this-run")
    assert os.listdir(base) == [CREATED_FILE] and read_record(os.path.join(base, CREATED_FILE)).run_id \
        == "this-run"
    assert "left unfinished by an interrupted save (made by pid" in caplog.text


def test_a_copy_set_aside_is_not_put_back_over_a_folder_this_code_did_not_make(tmp_path, caplog):
    save = tmp_path / "save"
    base = checkpoint.prepare(str(save), 1)
    checkpoint.write_meta(base, next_rollout_id=1, data_state={}, world_size=1)
    checkpoint.publish(str(save), base)
    aside = save / f"rollout_000001.prev-{_dead_pid()}"
    os.rename(base, aside)  # a dead process set it aside, and then someone put their own folder there
    os.makedirs(save / "rollout_000001")
    (save / "rollout_000001" / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="miles.checkpoint"):
        checkpoint.prepare(str(save), 2)
    assert (save / "rollout_000001" / "notes.txt").read_text() == "mine" and (aside / "meta.json").exists()
    assert "has no record of the run that made it" in caplog.text and "set aside" in caplog.text


# ---- 7. a resume across a change of streaming mode --------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def _trained(model, streamed_dir=None):
    """(optimizer, store or None) after one step; the store streams to ``streamed_dir`` when given."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = None if streamed_dir is None else stream_optimizer_state(opt, dir=str(streamed_dir))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt, store


def _checkpoint(tmp_path, streamed):
    model = _model()
    opt, store = _trained(model, tmp_path / "live-save" if streamed else None)
    base = checkpoint.prepare(str(tmp_path / "save"), 1)
    checkpoint.save_train_state(base, model=model, optimizer=opt, store=store, rank=0, world_size=1)
    checkpoint.write_meta(base, next_rollout_id=1, data_state={}, world_size=1,
                          extra={"streamed_optimizer_state": streamed})
    if store is not None:
        store.close()
    return base


def _load(base, tmp_path, streamed, load_optimizer=True):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = stream_optimizer_state(opt, dir=str(tmp_path / "live-load")) if streamed else None
    try:
        return checkpoint.load_train_state(base, model=model, optimizer=opt, store=store, rank=0, world_size=1,
                                           load_optimizer=load_optimizer)
    finally:
        if store is not None:
            store.close()


@pytest.mark.parametrize("saved, now", [(True, False), (False, True)])
def test_a_resume_across_a_change_of_streaming_mode_is_refused(tmp_path, saved, now):
    base = _checkpoint(tmp_path, saved)
    modes = {True: r"streamed to disk \(--stream-optimizer-state-to-disk\)",
             False: r"in memory \(without --stream-optimizer-state-to-disk\)"}
    with pytest.raises(checkpoint.CheckpointError, match=rf"holds optimizer state {modes[saved]} and this run keeps "
                       rf"it {modes[now]}: resuming across a change of streaming mode would restart Adam from zero.*"
                       "--no-load-optim to resume the weights alone with fresh optimizer state"):
        _load(base, tmp_path, now)
    assert _load(base, tmp_path, now, load_optimizer=False)["optimizer"] == "skipped"  # --no-load-optim
    assert _load(base, tmp_path, saved)["optimizer"] == ("streamed" if saved else "state_dict")


def test_a_checkpoint_whose_optimizer_state_went_missing_is_refused(tmp_path):
    import shutil
    plain = _checkpoint(tmp_path, False)
    os.unlink(checkpoint.optimizer_file(plain, 0))
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks the optimizer state of rank 0 .*rank00000\.pt.*"
                       "incomplete.*--no-load-optim"):
        _load(plain, tmp_path, False)
    shutil.rmtree(os.path.join(plain, checkpoint.OPTIMIZER_DIR))  # the meta still says how it was saved
    with pytest.raises(checkpoint.CheckpointError, match="lacks the optimizer state of rank 0"):
        _load(plain, tmp_path, False)
    shutil.rmtree(tmp_path / "save")
    streamed = _checkpoint(tmp_path, True)
    shutil.rmtree(os.path.join(streamed, checkpoint.STREAMED_DIR))
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks its streamed optimizer state .*nvme_opt_state"):
        _load(streamed, tmp_path, True)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_checkpoint_saved_without_optimizer_state_loads_with_fresh_state(tmp_path, caplog, streamed):
    model = _model()
    base = checkpoint.prepare(str(tmp_path / "save"), 1)
    checkpoint.save_train_state(base, model=model, optimizer=None, store=None, rank=0, world_size=1)
    checkpoint.write_meta(base, next_rollout_id=1, data_state={}, world_size=1)
    with caplog.at_level(logging.WARNING, logger="miles.checkpoint"):
        assert _load(base, tmp_path, streamed)["optimizer"] == "absent: fresh optimizer state"
    assert "holds no optimizer state (it was saved without any)" in caplog.text
