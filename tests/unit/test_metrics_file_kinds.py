"""--metrics-file as users point it: a symbolic link they made stays one and is written through (a resume's
rewrite included); a directory, a FIFO, a device or a binary file is refused at validation in one line, without
opening the FIFO for reading."""

import json
import os

import pytest

from miles.config import ArgumentError, parse_args
from miles.preflight import validate_args
from miles.metrics import MetricsSink


def _validate(tmp_path, metrics_file):
    return validate_args(parse_args(["--tiny-model", "--offload-train-disk-dir", str(tmp_path / "d"),
                                     "--metrics-file", str(metrics_file)]))


def _line(rollout_id, run_id):
    return json.dumps({"rollout_id": rollout_id, "run_id": run_id}) + "\n"


def test_a_symlink_the_user_made_stays_a_symlink_through_a_resume_and_its_records(tmp_path):
    real = tmp_path / "store" / "metrics.jsonl"
    real.parent.mkdir()
    real.write_text("".join(_line(i, "a") for i in range(4)))
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(real)
    _validate(tmp_path, link)
    sink = MetricsSink(str(link), None, "b", superseded_runs=["a"], start_rollout=2)  # a resume at rollout 2
    sink.write({"rollout_id": 2})
    sink.close()
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert [(r["rollout_id"], r["run_id"]) for r in map(json.loads, real.read_text().splitlines())] == [
        (0, "a"), (1, "a"), (2, "b")]
    assert sorted(p.name for p in real.parent.iterdir()) == ["metrics.jsonl"]  # no temporary left


def _refusal(tmp_path, metrics_file) -> str:
    with pytest.raises(ArgumentError) as e:
        _validate(tmp_path, metrics_file)
    assert "\n" not in str(e.value) and e.value.flags == ("--metrics-file",)
    return str(e.value)


def test_a_directory_is_refused_at_validation(tmp_path):
    (tmp_path / "m").mkdir()
    assert f"--metrics-file {tmp_path / 'm'} is a directory, not a regular file" in _refusal(tmp_path, tmp_path / "m")


def test_a_fifo_or_a_link_to_one_is_refused_at_validation_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    for path in (tmp_path / "fifo", tmp_path / "link"):
        assert f"--metrics-file {path} is a FIFO, not a regular file" in _refusal(tmp_path, path)


def test_a_device_is_refused_at_validation(tmp_path):
    assert "--metrics-file /dev/zero is a character device, not a regular file" in _refusal(tmp_path, "/dev/zero")


def test_a_binary_file_is_refused_at_validation_and_a_text_file_or_a_link_to_one_passes(tmp_path):
    path = tmp_path / "binary.jsonl"
    path.write_bytes(_line(0, "a").encode() + b"\x00\xff\xfe")
    message = _refusal(tmp_path, path)
    assert f"--metrics-file {path} is not a text file (byte {len(_line(0, 'a')) + 1} is not UTF-8)" in message
    (tmp_path / "m.jsonl").write_text(_line(0, "a") + "a note \u00e9\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "m.jsonl")
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "new.jsonl")
    for name in ("m.jsonl", "link.jsonl", "dangling.jsonl", "absent.jsonl"):
        assert _validate(tmp_path, tmp_path / name).logging.metrics_file == str(tmp_path / name)
