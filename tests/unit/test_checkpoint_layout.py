"""A checkpoint records the parallel layout it was saved with; resuming its optimizer state onto another TP/PP
layout (or another stage split) is refused, naming the flags that would resume it; DP changes pass (the store
reshards), and checkpoints from before the record count as TP = PP = 1."""

import pytest

from miles.checkpoint import LAYOUT_META, CheckpointError, check_resume_layout, layout_meta
from miles.parallel.layout import ParallelLayout


def meta_of(layout):
    return {LAYOUT_META: layout_meta(layout)}


def test_the_same_layout_or_another_data_parallel_size_resumes():
    saved = ParallelLayout(world=8, tp=2, pp=2, first_stage_layers=3)
    check_resume_layout("/ckpt/rollout_4", meta_of(saved), saved)
    check_resume_layout("/ckpt/rollout_4", meta_of(saved), ParallelLayout(world=16, tp=2, pp=2, first_stage_layers=3))
    check_resume_layout("/ckpt/rollout_4", {}, ParallelLayout(world=4))  # saved before the record: TP = PP = 1


@pytest.mark.parametrize("now,named", [
    (ParallelLayout(world=8, tp=4, pp=2, first_stage_layers=3), "--tensor-model-parallel-size 2"),
    (ParallelLayout(world=8, tp=2, pp=4, first_stage_layers=3), "--pipeline-model-parallel-size 2"),
    (ParallelLayout(world=8, tp=2, pp=2), "--decoder-first-pipeline-num-layers 3"),
])
def test_another_tp_pp_layout_is_refused_naming_what_would_resume(now, named):
    saved = ParallelLayout(world=8, tp=2, pp=2, first_stage_layers=3)
    with pytest.raises(CheckpointError) as e:
        check_resume_layout("/ckpt/rollout_4", meta_of(saved), now)
    text = str(e.value)
    assert text.startswith("/ckpt/rollout_4 holds optimizer state sharded for") and f"Resume with {named}" in text
    assert "--no-load-optim" in text


def test_a_checkpoint_from_before_the_record_refuses_tp2():
    with pytest.raises(CheckpointError, match="sharded for --tensor-model-parallel-size 1 and this run has "
                                              "--tensor-model-parallel-size 2"):
        check_resume_layout("/ckpt/rollout_4", {}, ParallelLayout(world=2, tp=2))


# ---- before anything starts: miles train refuses the checkpoint, and meta.json is read as untrusted input ----
def _checkpoint(root, meta_text: str) -> str:
    base = root / "rollout_000002"
    base.mkdir(parents=True)
    (base / "meta.json").write_text(meta_text)
    return str(base)


def test_miles_train_refuses_another_layout_before_ray_starts(tmp_path, monkeypatch):
    import json

    from miles import train
    from miles.config import parse_args
    from miles.preflight import validate_args

    saved = ParallelLayout(world=2, tp=2)
    base = _checkpoint(tmp_path, json.dumps({"next_rollout_id": 2, LAYOUT_META: layout_meta(saved)}))
    config = validate_args(parse_args(["--tiny-model", "--load", base, "--offload-train-disk-dir",
                                       str(tmp_path / "offload")]))

    def no_ray(_config):
        raise AssertionError("Ray was started for a checkpoint the run cannot resume")

    monkeypatch.setattr(train, "_init_ray", no_ray)
    with pytest.raises(train.RunError, match="run stopped: .*rollout_000002 holds optimizer state sharded for "
                                             "--tensor-model-parallel-size 2 and this run has "
                                             "--tensor-model-parallel-size 1"):
        train.run(config)


def test_the_weights_alone_resume_onto_another_layout(tmp_path):
    import json

    from miles.checkpoint import resume_target

    base = _checkpoint(tmp_path, json.dumps({"next_rollout_id": 2, LAYOUT_META: layout_meta(ParallelLayout(world=2, tp=2))}))
    assert resume_target(base, False, ParallelLayout(world=1)) == (base, json.loads(open(f"{base}/meta.json").read()))
    assert resume_target(None, True, ParallelLayout(world=1)) is None
    assert resume_target(str(tmp_path / "empty"), True, ParallelLayout(world=1)) is None  # nothing saved there yet


@pytest.mark.parametrize("text,problem", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ("{not json", "is not valid JSON"),
    ("\udcff", "is not valid JSON"),
])
def test_a_meta_file_that_is_no_checkpoint_of_ours_is_refused(tmp_path, text, problem):
    from miles.checkpoint import read_meta

    base = _checkpoint(tmp_path, "")
    with open(f"{base}/meta.json", "wb") as f:
        f.write(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(CheckpointError, match=f"meta.json {problem}.*start fresh without --load"):
        read_meta(base)


def test_a_meta_file_over_the_bound_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    from miles import checkpoint

    monkeypatch.setattr(checkpoint, "META_MAX_BYTES", 1 << 10)
    base = _checkpoint(tmp_path, '{"pad": "' + "x" * 4096 + '"}')
    with pytest.raises(CheckpointError, match="meta.json: 4,107 bytes, more than the 1,024"):
        checkpoint.read_meta(base)


def test_dry_run_checks_the_checkpoint_to_resume(tmp_path, capsys):
    import json

    from miles.cli import main

    base = _checkpoint(tmp_path, json.dumps({"next_rollout_id": 2, LAYOUT_META: layout_meta(ParallelLayout(world=2, tp=2))}))
    argv = ["train", "--tiny-model", "--load", base, "--offload-train-disk-dir", str(tmp_path / "offload"), "--dry-run"]
    assert main(argv) == 1
    assert "miles train --dry-run: --load: " in capsys.readouterr().err
    assert main([*argv, "--no-load-optim"]) == 0
    assert f"--load: resumes {base} at rollout 2" in capsys.readouterr().out
