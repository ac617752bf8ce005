"""`miles bench checkpoint` end to end on a tiny CPU state: the report it prints is built from what it
measured (rounds, ratios), and it leaves nothing behind in its directory, also when it fails."""

import json
import os

import pytest

from miles.bench import checkpoint as bench
from miles.bench.common import median
from miles.cli import main as miles_main

TINY = ["--gb", "0.006", "--bucket-numel", "150K", "--device", "cpu", "--quiet"]


def test_bench_runs_rounds_and_reports_ratios_from_them(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_dir = tmp_path / "d"
    rc = bench.main(TINY + ["--dir", str(bench_dir), "--repeat", "2", "--fwd-bwd-seconds", "0.05",
                            "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    printed = capsys.readouterr().out

    assert r["params"] == 500_000 and r["num_buckets"] == 4  # 125K-param tensors cut at 150K elements
    assert r["state_bytes"] >= 12 * r["params"]
    rounds = r["rounds"]
    assert len(rounds) == 2
    for key in ("step_alone", "plain_copy", "save_wait"):
        assert r[key]["all"] == [x[key] for x in rounds]
        assert r[key]["seconds"] == median(r[key]["all"])
    ratios = r["save_vs_copy"]
    assert ratios["all"] == [x["save_wait"] / x["plain_copy"] for x in rounds]
    assert ratios["ratio"] == median(ratios["all"])
    assert ratios["of_medians"] == r["save_wait"]["seconds"] / r["plain_copy"]["seconds"]
    for x in rounds:  # each round's lines were printed while it ran
        assert f"plain copy of the same files (shutil.copyfile + fsync each): {x['plain_copy']:.2f} s" in printed
        assert f"save_to(wait=True): {x['save_wait']:.2f} s" in printed
        assert f"save_to(wait=True) / plain copy in this round: {x['save_vs_copy']:.3f}" in printed
        assert x["save_wait_stats"]["bytes"] == r["state_bytes"]

    bg = r["background"]
    assert list(bg) == ["right_away", "after_fwd_bwd"]
    assert bg["right_away"]["gap_seconds"] == 0.0 and bg["after_fwd_bwd"]["gap_seconds"] == 0.05
    assert bg["after_fwd_bwd"]["fwd_bwd"] >= 0.05 and r["fwd_bwd_kind"] == "sleep"
    for key, b in bg.items():
        assert b["next_step"] == median([x["background"][key]["next_step"] for x in rounds])
        assert b["next_step_vs_alone"] == [x["background"][key]["next_step"] / x["step_alone"] for x in rounds]
        assert all(0 <= c <= r["num_buckets"] for c in b["copied_by_writer"])
        assert b["published"] > 0 and b["stalled"] >= 0

    assert f"save_to(wait=True) / plain copy = {ratios['of_medians']:.3f}" in printed
    assert f"within each round: save_to(wait=True) / plain copy median {ratios['ratio']:.3f}" in printed
    assert r["report"] in printed  # the JSON carries the table that was printed
    assert not os.path.exists(bench_dir)  # live files, copies, checkpoints and the directory it made are gone


def test_scratch_is_removed_on_error_and_a_given_dir_is_kept(tmp_path, monkeypatch):
    def disk_full(files, dst_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "_plain_copy", disk_full)
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "other").write_text("not the bench's")
    with pytest.raises(OSError, match="No space left"):
        bench.main(TINY + ["--dir", str(keep)])
    assert sorted(os.listdir(keep)) == ["other"]


@pytest.mark.parametrize("argv, message", [
    (["--gb", "0"], "argument --gb: must be > 0, got 0; give the streamed state in GB"),
    (["--gb", "two"], "argument --gb: 'two' is not a number"),
    (["--repeat", "0"], "argument --repeat: must be > 0, got 0"),
    (["--bucket-numel", "-5"], "argument --bucket-numel: must be > 0, got -5"),
])
def test_bad_arguments_say_which_value_and_what_to_give(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        miles_main(["bench", "checkpoint", *argv])  # registered as `miles bench checkpoint`
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_dir_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + ["--dir", str(f)])
    assert e.value.code == 2 and f"argument --dir: {f} exists and is not a directory" in capsys.readouterr().err
