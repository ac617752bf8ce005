"""`miles bench rl` works in arm-<name>/ folders under --dir: it replaces its own from an earlier run and
refuses, before running anything, to touch one it did not make."""

import os

import pytest

from miles.bench.rl import ARM_MARKER, arm_dir_of
from miles.cli import main as miles_main


def test_a_folder_the_bench_did_not_make_is_refused_before_anything_runs(tmp_path, capsys):
    mine = tmp_path / "arm-stream"
    mine.mkdir()
    (mine / "notes.txt").write_text("not the bench's")
    with pytest.raises(SystemExit, match="arm-stream exists and was not made by miles bench rl"):
        miles_main(["bench", "rl", "--preset", "llama-tiny", "--dir", str(tmp_path), "--arms", "resident-cpu,stream"])
    assert sorted(os.listdir(tmp_path)) == ["arm-stream"]  # no model written, no floor file, nothing removed
    assert (mine / "notes.txt").read_text() == "not the bench's"


def test_a_file_or_a_link_in_its_place_is_refused_too(tmp_path):
    (tmp_path / "arm-stream").write_text("x")
    with pytest.raises(SystemExit, match="not made by miles bench rl"):
        arm_dir_of(str(tmp_path), "stream")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ARM_MARKER).write_text("")
    os.symlink(target, tmp_path / "arm-resident-cpu")
    with pytest.raises(SystemExit, match="not made by miles bench rl"):
        arm_dir_of(str(tmp_path), "resident-cpu")


def test_its_own_folder_from_an_earlier_run_may_be_replaced(tmp_path):
    earlier = tmp_path / "arm-stream"
    earlier.mkdir()
    (earlier / ARM_MARKER).write_text("")
    assert arm_dir_of(str(tmp_path), "stream") == str(earlier)
    assert arm_dir_of(str(tmp_path), "resident-disk") == str(tmp_path / "arm-resident-disk")  # not there yet


def test_the_report_says_whether_the_arms_trained_alike():
    from miles.bench.rl import series_agreement

    def arm(name, losses, rewards=(0.5, 0.25, 0.75)):
        return {"arm": name, "losses": list(losses), "rewards": list(rewards)}

    same = [arm("stream-plan", (0.1, -0.2, 0.3)), arm("stream", (0.1, -0.2, 0.3)), {"arm": "x", "error": "exit 1"}]
    assert series_agreement(same) == "exactness: losses and rewards of stream-plan, stream equal bit for bit over 3 rollouts"
    apart = series_agreement([arm("stream-plan", (0.1, -0.2, 0.3)), arm("stream", (0.1, -0.2000001, 0.3)),
                              arm("resident-cpu", (0.1, -0.2, 0.3), rewards=(0.5, 0.25, 0.5))])
    assert apart == ("exactness: stream departs from stream-plan at rollout 1 (loss -0.2000001 vs -0.2, reward 0.25 vs "
                     "0.25); resident-cpu departs from stream-plan at rollout 2 (loss 0.3 vs 0.3, reward 0.5 vs 0.75)")
    assert series_agreement(same[:1]) is None
