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
    skipped = [arm("a", (0.1, float("nan"), 0.3)), arm("b", (0.1, float("nan"), 0.3))]  # a skipped step each
    assert series_agreement(skipped).endswith("equal bit for bit over 3 rollouts")


def test_the_train_line_shows_the_forward_backward_peak_where_a_gpu_reported_it():
    from test_sleep_plan_record import _bench_record

    from miles.bench.rl import format_report, phase_report

    rates = {"device_copy": 2e12, "d2h_pinned": 50e9, "h2d_pinned": 25e9, "disk_write": 2e9, "disk_read": 1e9}
    on_gpu = [_bench_record() | {"forward_backward_device_peak_gb": peak} for peak in (30.2, 29.8)]
    on_cpu = [_bench_record()]

    def text(records):
        return format_report({"model": "m", "backend": "megatron", "workload": "w", "rates": rates, "arms": [
            {"arm": "stream", "rollouts": 3, "reward_first": 0.0, "reward_last": 0.0,
             "phases": phase_report(records, "disk", rates)}]})

    assert "(rank: fwd/bwd 1.000, peak 30.2 GB + optimizer 0.200" in text(on_gpu)  # the largest of the rollouts
    assert "peak" not in text(on_cpu)
