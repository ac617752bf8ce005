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
