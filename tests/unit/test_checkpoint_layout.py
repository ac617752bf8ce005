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
