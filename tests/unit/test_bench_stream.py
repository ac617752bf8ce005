"""`miles bench stream` end to end on a tiny CPU state: the report it prints is built from what it
measured (rounds, ratios, bytes), and it leaves nothing behind in its directory."""

import json
import os

import pytest

from miles.bench.common import median
from miles.bench.stream import main


def test_median():
    assert median([3.0]) == 3.0
    assert median([4.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_bench_runs_rounds_and_reports_ratios_from_them(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_dir = tmp_path / "d"
    rc = main(["--params", "2M", "--device", "cpu", "--dir", str(bench_dir), "--buckets", "3", "--repeat", "2",
               "--chunk-mb", "4", "--fwd-bwd-seconds", "0.05", "--host-cache-fractions", "1", "--quiet",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    state_bytes = 12 * r["params"]  # fp32 masters + moments, the bytes a step moves each way
    assert r["state_bytes"] >= state_bytes  # the files: segments padded to 4 KiB

    # every round measured both floors and both engines
    for label in ("concurrent", "sequential"):
        assert len(r["floor"][label]["all_seconds"]) == 2
        assert r["floor"][label]["seconds"] == median(r["floor"][label]["all_seconds"])
    assert r["floor"]["best_seconds"] == min(r["floor"]["concurrent"]["seconds"], r["floor"]["sequential"]["seconds"])
    for engine in ("sync", "pipelined"):
        assert len(r[engine]["all_seconds"]) == 2
        assert r[engine]["bytes"] == 2 * state_bytes  # masters + moments, read and written
    p, s = r["pipelined"], r["sync"]
    assert len(p["x_floor_by_round"]) == 2
    assert all(abs(x - w / min(c, q)) < 1e-9 for x, w, c, q in zip(
        p["x_floor_by_round"], p["all_seconds"], r["floor"]["concurrent"]["all_seconds"],
        r["floor"]["sequential"]["all_seconds"]))
    assert p["speedup_vs_sync_by_round"] == [a / b for a, b in zip(s["all_seconds"], p["all_seconds"])]
    assert p["peak_resident_bytes"] <= p["residency_bound_bytes"]

    # the exposed-I/O modes ran 1 + repeat iterations; with the whole state cached, the measured
    # iterations read nothing from disk
    modes = r["exposed"]["modes"]
    assert list(modes) == ["plain", "ahead+behind", "ahead+behind+cache1"]
    assert all(len(m["rows"]) == 3 for m in modes.values())
    assert all(row["disk_read"] == state_bytes for row in modes["plain"]["rows"])
    assert all(row["disk_read"] == 0 for row in modes["ahead+behind+cache1"]["rows"][1:])

    printed = capsys.readouterr().out
    assert f"pipelined / floor = {p['seconds'] / r['floor']['best_seconds']:.3f}" in printed
    assert "within each round: pipelined / that round's floor median" in printed
    assert not os.path.exists(bench_dir)  # store files and the floor's scratch file are gone


def test_bench_with_fp8_moments_streams_half_the_bytes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["--params", "2M", "--device", "cpu", "--dir", str(tmp_path / "d"), "--buckets", "2",
               "--chunk-mb", "4", "--moment-dtype", "fp8e4m3", "--skip-sync", "--skip-exposed", "--quiet",
               "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    # 4 B master + 2 x (1 B code + 4 B scale per 256 elements) per param, each way
    moved = r["pipelined"]["bytes"] / 2
    assert 6 * r["params"] <= moved < 6.1 * r["params"] and r["state_bytes"] >= moved
    assert "fp8e4m3 moments" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "0"], "argument --repeat: must be > 0, got 0; give a round count"),
    (["--buckets", "0"], "argument --buckets: must be > 0, got 0"),
    (["--depth", "-1"], "argument --depth: must be >= 0, got -1"),
    (["--fwd-bwd-seconds", "nan"], "argument --fwd-bwd-seconds: must be >= 0, got nan"),
    (["--io-threads", "two"], "argument --io-threads: 'two' is not a number"),
])
def test_bad_arguments_say_which_value_and_what_to_give(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _allocation_fails(*args, **kwargs):
    raise AssertionError("the bench allocated its state before checking that it fits")


def test_params_beyond_this_machine_are_refused_before_anything_is_allocated(tmp_path, capsys, monkeypatch):
    from miles.bench import stream

    monkeypatch.setattr(stream, "make_state", _allocation_fails)
    bench_dir = tmp_path / "d"
    rc = main(["--params", "1e15", "--device", "cpu", "--dir", str(bench_dir), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("miles bench stream: error: --params 1e+15 needs about 18,000,000.0 GB of host memory (18 "
                          "B/param: bf16 params, fp32 masters and grads, and the resident step's Adam moments), but "
                          "this machine has "), err
    assert " GB free there. Fix: give at most about --params " in err
    assert not bench_dir.exists(), "nothing was created"


@pytest.mark.parametrize("argv, free, disk, message", [
    (["--params", "100M"], 10**9, 10**12,
     "--params 100M needs about 1.8 GB of host memory (18 B/param: bf16 params, fp32 masters and grads, and the "
     "resident step's Adam moments), but this machine has 1.0 GB free there. Fix: give at most about --params 55.6M "
     "here."),
    (["--params", "100M", "--host-cache-fractions", "0.5,1"], 2 * 10**9, 10**12,
     "--params 100M needs about 2.2 GB of host memory (10 B/param of params and grads, and the exposed runs' host "
     "cache of --host-cache-fractions 1: 12 B/param), but this machine has 2.0 GB free there. Fix: give at most "
     "about --params 90.9M here."),
    (["--params", "100M", "--skip-exposed"], 10**12, 2 * 10**9,
     "--params 100M needs about 2.4 GB of disk under {dir} (the bucket files, 12 B/param, and the floor's scratch "
     "file of as many bytes), but this machine has 2.0 GB free there. Fix: give at most about --params 83.3M here."),
])
def test_the_refusal_names_the_value_the_memory_it_needs_and_what_the_machine_has(argv, free, disk, message,
                                                                                   tmp_path, capsys, monkeypatch):
    import collections

    from miles.bench import stream

    monkeypatch.setattr(stream, "make_state", _allocation_fails)
    monkeypatch.setattr(stream, "free_memory", lambda device: free)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(stream.shutil, "disk_usage", lambda path: usage(disk, 0, disk))
    bench_dir = tmp_path / "d"
    assert main([*argv, "--device", "cpu", "--dir", str(bench_dir), "--quiet"]) == 2
    assert capsys.readouterr().err == f"miles bench stream: error: {message.format(dir=bench_dir)}\n"


def test_a_count_prints_as_the_bench_reads_it_back():
    from miles.bench.common import count_text, parse_count

    for count in (7, 12_000, 450_000_000, 1_500_000_000, 10**15):
        assert parse_count(count_text(count)) == count, count_text(count)
    assert count_text(55_555_555) == "55.6M"


@pytest.mark.parametrize("text, problem", [
    ("0.5", "0.5 is not a whole number"),
    ("1.5", "1.5 is not a whole number"),
    ("1.0000005M", "1.0000005M is not a whole number"),
    ("999999", "999999 is less than 1M (a smaller state, under 12 MB, times the store's fixed costs rather than the "
               "disk)"),
    ("1", "1 is less than 1M (a smaller state, under 12 MB, times the store's fixed costs rather than the disk)"),
])
def test_params_must_be_a_whole_count_of_at_least_1m(tmp_path, capsys, text, problem):
    with pytest.raises(SystemExit) as e:
        main(["--params", text, "--device", "cpu", "--dir", str(tmp_path / "d"), "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"argument --params: {problem}; give a whole param count of at least 1M, e.g. 100M or 1.5B" in err, err
    assert not (tmp_path / "d").exists()


def test_params_spelled_with_a_suffix_are_exact():
    from miles.bench.stream import MIN_PARAMS, MIN_PARAMS_WHY
    from miles.bench.common import count_arg

    parse = count_arg("a count", MIN_PARAMS, MIN_PARAMS_WHY)
    assert [parse(t) for t in ("1M", "1.5B", "1.1B", "0.3B", "2_000_000", "1e6")] == \
        [10**6, 1_500_000_000, 1_100_000_000, 300_000_000, 2_000_000, 10**6]


def test_a_directory_the_bench_did_not_make_stays_and_a_relative_default_is_explained(tmp_path, capsys, monkeypatch):
    import argparse

    from miles.bench import stream

    mine = tmp_path / "mine"
    mine.mkdir()
    rc = main(["--params", "1M", "--device", "cpu", "--dir", str(mine), "--buckets", "2", "--repeat", "1",
               "--chunk-mb", "4", "--skip-exposed", "--skip-sync", "--quiet"])
    assert rc == 0 and mine.is_dir() and not list(mine.iterdir()), "the user's directory stays, emptied of the bench"
    parser = argparse.ArgumentParser()
    stream.add_arguments(parser)
    help_of_dir = next(a.help for a in parser._actions if a.dest == "dir")
    assert help_of_dir.startswith("directory on the disk under test, relative to the current directory unless "
                                  "absolute; made when missing.")
