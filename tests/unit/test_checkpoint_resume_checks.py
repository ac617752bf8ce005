"""What ``--load`` resumes is read as untrusted input and checked before Ray and the actors start:

- the latest marker names a checkpoint folder of this code's spelling directly inside the --load folder (a real
  folder, not a symbolic link), and is itself a regular file read bounded;
- every field of meta.json has its type and range, or one line names the file, the field, the value and the fix;
- a checkpoint at or past --num-rollout (nothing left to run), optimizer state saved in the other streaming mode,
  and a --load folder of other files are refused in one line; an empty or missing folder starts fresh, said once.
"""

import json
import logging
import os
import threading

import pytest

from miles import checkpoint
from miles.checkpoint import CheckpointError

TINY = ("--tiny-model", "--num-rollout", "4")


def _complete(folder, completed=2, **meta):
    """A checkpoint folder as a save leaves it (its meta.json; the model is not read before Ray starts)."""
    base = os.path.join(str(folder), checkpoint.checkpoint_name(completed))
    os.makedirs(base)
    fields = {"next_rollout_id": completed, "data_state": {"consumed_prompts": 8}, "world_size": 1, **meta}
    with open(os.path.join(base, checkpoint.META_FILE), "w") as f:
        json.dump(fields, f)
    return base


def _mark(save, name):
    with open(os.path.join(str(save), checkpoint.LATEST_FILE), "w") as f:
        f.write(name + "\n")


def _run_flags(tmp_path, *flags):
    return [*flags, "--offload-train-disk-dir", str(tmp_path / "offload"), "--metrics-file", str(tmp_path / "m.jsonl")]


def _refused_before_ray(tmp_path, monkeypatch, *flags):
    """``miles.train.run`` of these flags: the RunError it raises before Ray starts (a test failure if it starts)."""
    from miles import train
    from miles.config import parse_args
    from miles.preflight import validate_args

    def no_ray(_config):
        raise AssertionError("Ray was started for a checkpoint the run cannot resume")

    monkeypatch.setattr(train, "_init_ray", no_ray)
    config = validate_args(parse_args(_run_flags(tmp_path, *flags)))
    with pytest.raises(train.RunError) as e:
        train.run(config)
    return str(e.value)


def _dry_run(tmp_path, capsys, *flags):
    from miles.cli import main

    code = main(["train", *_run_flags(tmp_path, *flags), "--dry-run"])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- A: the latest marker is confined to the --load folder ---------------------------------------------------
@pytest.mark.parametrize("named", ["../elsewhere/rollout_000002", "ABSOLUTE", "rollout_000002/../../elsewhere",
                                   "rollout_2", "notes"])
def test_a_marker_naming_anything_but_a_checkpoint_folder_of_ours_is_refused(tmp_path, named):
    outside = _complete(tmp_path / "elsewhere")
    save = tmp_path / "save"
    save.mkdir()
    os.makedirs(save / "notes" / "model")
    (save / "notes" / checkpoint.META_FILE).write_text('{"next_rollout_id": 1}')
    _mark(save, outside if named == "ABSOLUTE" else named)
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_rollout\.txt names .*not a checkpoint folder of "
                                              r"the form this code writes \(rollout_NNNNNN, directly inside"):
        checkpoint.resolve(str(save))


def test_a_marker_naming_a_symbolic_link_out_of_the_folder_is_refused(tmp_path):
    outside = _complete(tmp_path / "elsewhere")
    save = tmp_path / "save"
    save.mkdir()
    os.symlink(outside, save / "rollout_000002")
    _mark(save, "rollout_000002")
    with pytest.raises(CheckpointError, match="rollout_000002, a symbolic link .*which a load never follows"):
        checkpoint.resolve(str(save))


def test_a_marker_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    save = tmp_path / "save"
    _complete(save)
    os.mkfifo(save / checkpoint.LATEST_FILE)
    outcome = []

    def resolve():
        try:
            outcome.append(checkpoint.resolve(str(save)))
        except CheckpointError as e:
            outcome.append(e)

    reader = threading.Thread(target=resolve, daemon=True)
    reader.start()
    reader.join(20)
    assert outcome, "resolve blocked on a FIFO named as the latest marker"
    assert isinstance(outcome[0], CheckpointError) and "a FIFO, not a regular file" in str(outcome[0])


def test_a_marker_linked_to_a_device_is_refused_before_reading_it(tmp_path):
    save = tmp_path / "save"
    _complete(save)
    os.symlink("/dev/zero", save / checkpoint.LATEST_FILE)
    with pytest.raises(CheckpointError, match="latest_checkpointed_rollout.txt: a character device, not a regular"):
        checkpoint.resolve(str(save))


def test_miles_train_refuses_a_marker_out_of_the_folder_before_ray_starts(tmp_path, monkeypatch):
    _complete(tmp_path / "elsewhere", 1)
    save = tmp_path / "save"
    save.mkdir()
    _mark(save, "../elsewhere/rollout_000001")
    message = _refused_before_ray(tmp_path, monkeypatch, *TINY, "--load", str(save))
    assert "not a checkpoint folder of the form this code writes" in message


# ---- B: every field of meta.json is checked when it is read -------------------------------------------------------
@pytest.mark.parametrize("field, value, must_be", [
    ("next_rollout_id", "abc", "a whole number >= 0"),
    ("next_rollout_id", -3, "a whole number >= 0"),
    ("next_rollout_id", True, "a whole number >= 0"),
    ("next_rollout_id", 2.5, "a whole number >= 0"),
    ("data_state", [], "an object"),
    ("world_size", "x", "a whole number >= 1"),
    ("world_size", 0, "a whole number >= 1"),
    ("runs", "a", "a list of run ids"),
    ("runs", [1], "a list of run ids"),
    ("format", 2, "1, the format this code reads"),
    ("streamed_optimizer_state", "yes", "true or false"),
    ("time", 5, "a string"),
    ("parallel_layout", [2], "an object"),
])
def test_a_meta_field_of_the_wrong_type_or_range_is_one_line_naming_file_field_value_and_fix(tmp_path, field, value,
                                                                                            must_be):
    base = _complete(tmp_path / "save", **{field: value})
    with pytest.raises(CheckpointError) as e:
        checkpoint.read_meta(base)
    message = str(e.value)
    assert message.startswith(os.path.join(base, checkpoint.META_FILE) + f" has {field} {value!r}, which must be "
                              f"{must_be}")
    assert "\n" not in message and "Resume from another checkpoint, or start fresh without --load" in message


@pytest.mark.parametrize("nested, value, shown", [
    ("data_state", {"consumed_prompts": -1}, "data_state.consumed_prompts -1"),
    ("data_state", {"num_prompts": "8"}, "data_state.num_prompts '8'"),
    ("parallel_layout", {"tensor_model_parallel_size": 0}, "parallel_layout.tensor_model_parallel_size 0"),
    ("parallel_layout", {"pipeline_model_parallel_size": None}, "parallel_layout.pipeline_model_parallel_size None"),
    ("parallel_layout", {"decoder_first_pipeline_num_layers": "3"},
     "parallel_layout.decoder_first_pipeline_num_layers '3'"),
])
def test_the_fields_inside_data_state_and_the_layout_are_checked_too(tmp_path, nested, value, shown):
    base = _complete(tmp_path / "save", **{nested: value})
    with pytest.raises(CheckpointError, match=f"meta.json has {shown}, which must be a whole number"):
        checkpoint.read_meta(base)


def test_a_meta_without_the_rollout_to_resume_at_or_nested_deeply_is_refused(tmp_path):
    base = _complete(tmp_path / "a")
    with open(os.path.join(base, checkpoint.META_FILE), "w") as f:
        json.dump({"world_size": 1}, f)
    with pytest.raises(CheckpointError, match="meta.json has no next_rollout_id"):
        checkpoint.read_meta(base)
    with open(os.path.join(base, checkpoint.META_FILE), "w") as f:
        f.write('{"next_rollout_id": 1, "data_state": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match="meta.json is not valid JSON of a checkpoint .*nested"):
        checkpoint.read_meta(base)


def test_miles_train_refuses_a_bad_meta_before_ray_starts(tmp_path, monkeypatch):
    base = _complete(tmp_path / "save", next_rollout_id="abc")
    message = _refused_before_ray(tmp_path, monkeypatch, *TINY, "--load", base)
    assert "meta.json has next_rollout_id 'abc', which must be a whole number >= 0" in message


# ---- C: a checkpoint with nothing left to run ------------------------------------------------------------------------
def test_resuming_a_finished_run_is_refused_before_ray_naming_the_rollout_and_the_fix(tmp_path, monkeypatch):
    save = tmp_path / "save"
    _mark(save, os.path.basename(_complete(save, 4)))
    message = _refused_before_ray(tmp_path, monkeypatch, *TINY, "--load", str(save))
    assert "rollout_000004 resumes at rollout 4 and --num-rollout is 4" in message
    assert "Raise --num-rollout above 4" in message and "\n" not in message


def test_dry_run_refuses_a_finished_run_and_passes_with_more_rollouts_or_finetune(tmp_path, capsys):
    base = _complete(tmp_path / "save", 4)
    code, _, err = _dry_run(tmp_path, capsys, *TINY, "--load", base)
    assert code == 1 and "resumes at rollout 4 and --num-rollout is 4" in err and "Raise --num-rollout" in err
    code, out, _ = _dry_run(tmp_path, capsys, "--tiny-model", "--num-rollout", "5", "--load", base)
    assert code == 0 and f"--load: resumes {base} at rollout 4" in out
    code, _, _ = _dry_run(tmp_path, capsys, *TINY, "--load", base, "--finetune")
    assert code == 0


# ---- D: a --load folder that holds no checkpoint ------------------------------------------------------------------
def test_a_load_folder_of_other_files_is_refused_listing_them(tmp_path, capsys):
    model = tmp_path / "some-model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model / name).write_text("{}")
    with pytest.raises(CheckpointError) as e:
        checkpoint.checked_resume_target(_config(tmp_path, "--load", str(model)))
    message = str(e.value)
    assert message.startswith(f"{model} holds no checkpoint (no latest_checkpointed_rollout.txt, no meta.json) but "
                              "other files: config.json; model.safetensors.")
    assert "drop --load to start fresh" in message
    code, _, err = _dry_run(tmp_path, capsys, *TINY, "--load", str(model))
    assert code == 1 and "holds no checkpoint" in err


def test_the_listing_of_a_large_folder_is_bounded(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(300):
        (folder / f"file{i:03d}").write_text("")
    with pytest.raises(CheckpointError, match=r"other files: 300 entries, first 5: file000; file001; file002; "
                                              r"file003; file004\. Pass") as e:
        checkpoint.checked_resume_target(_config(tmp_path, "--load", str(folder)))
    assert len(str(e.value)) < 600


def test_a_load_folder_of_unpublished_checkpoints_is_refused_naming_the_newest(tmp_path):
    folder = tmp_path / "unpublished"
    _complete(folder, 3)
    (folder / "rollout_000005").mkdir()  # an unfinished save: no meta.json
    with pytest.raises(CheckpointError, match=r"has no latest_checkpointed_rollout.txt, but complete checkpoints "
                                              r"that a save did not get to publish: rollout_000003\. Pass --load "
                                              r".*unpublished/rollout_000003 to resume the newest"):
        checkpoint.checked_resume_target(_config(tmp_path, "--load", str(folder)))


@pytest.mark.parametrize("case", ["empty", "unfinished saves only", "missing, also --save",
                                  "also --save, with its metrics"])
def test_an_empty_or_missing_folder_starts_fresh_saying_so_in_one_line(tmp_path, caplog, case):
    load = tmp_path / "ckpt"
    flags = ["--load", str(load)] + (["--save", str(load)] if "also --save" in case else [])
    if not case.startswith("missing"):
        load.mkdir()
    if case == "unfinished saves only":
        (load / "rollout_000002").mkdir()
        (load / (checkpoint.LATEST_FILE + ".tmp12-34-abc")).write_text("rollout_000002")
    if case.endswith("with its metrics"):
        (load / "metrics.jsonl").write_text("{}\n")
    with caplog.at_level(logging.WARNING, logger="miles.checkpoint"):
        assert checkpoint.checked_resume_target(_config(tmp_path, *flags)) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "miles.checkpoint"]
    assert len(lines) == 1 and lines[0].startswith(f"--load {load}: ") and "\n" not in lines[0]
    assert lines[0].endswith("; this run starts fresh at rollout 0")


# ---- E: optimizer state saved in the other streaming mode -------------------------------------------------------
STREAM = ("--stream-optimizer-state-to-disk", "--offload-train-target=disk")


@pytest.mark.parametrize("saved, flags, fix", [
    (checkpoint.STREAMED_DIR, (), "add --stream-optimizer-state-to-disk --offload-train-target=disk"),
    (checkpoint.OPTIMIZER_DIR, STREAM, "drop --stream-optimizer-state-to-disk"),
])
def test_resuming_across_a_change_of_streaming_mode_is_refused_before_ray(tmp_path, monkeypatch, saved, flags, fix):
    base = _complete(tmp_path / "save")
    os.makedirs(os.path.join(base, saved))
    message = _refused_before_ray(tmp_path, monkeypatch, *TINY, *flags, "--load", base)
    assert f"{base} holds optimizer state" in message and f"To resume it, {fix}; or pass --no-load-optim" in message


def test_dry_run_refuses_the_other_streaming_mode_and_no_load_optim_resumes_the_weights(tmp_path, capsys):
    base = _complete(tmp_path / "save")
    os.makedirs(os.path.join(base, checkpoint.STREAMED_DIR))
    code, _, err = _dry_run(tmp_path, capsys, *TINY, "--load", base)
    assert code == 1 and "streamed to disk (--stream-optimizer-state-to-disk)" in err
    code, _, _ = _dry_run(tmp_path, capsys, *TINY, "--load", base, "--no-load-optim")
    assert code == 0
    code, _, _ = _dry_run(tmp_path, capsys, *TINY, *STREAM, "--load", base)
    assert code == 0


def _config(tmp_path, *flags):
    from miles.config import parse_args
    from miles.preflight import validate_args

    return validate_args(parse_args(_run_flags(tmp_path, *TINY, *flags)))
