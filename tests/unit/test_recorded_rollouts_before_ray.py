"""A run replaying recorded rollouts (--load-debug-rollout-data) reads and checks every file it will replay
before Ray and the actors start: a bad one stops it in one line naming the file, the sample, the value and its
bound, and leaves no metrics file."""

import os

import pytest

from miles.config import parse_args
from miles.preflight import validate_args
from miles.rollout.recorded import write_rollout
from miles.rollout.types import Sample


def _samples(prompt_len=3, response_len=4):
    return [Sample(index=i, prompt_index=i // 2, prompt_ids=[40 + i // 2] * prompt_len,
                   response_ids=[50] * response_len, response_logprobs=[-0.5] * response_len, response_text="x", finish_reason="length",
                   weight_version=0, reward=float(i % 2)) for i in range(4)]


@pytest.fixture
def no_ray(monkeypatch, tmp_path):
    """Ray must not start: the refusal comes first."""
    monkeypatch.chdir(tmp_path)

    def fail(config):
        raise AssertionError("Ray was started before the recorded rollouts were checked")

    monkeypatch.setattr("miles.train._init_ray", fail)


def _refusal(tmp_path, template) -> str:
    """The one line the run (--tiny-model: 100 tokens, 1024 positions) stops with, replaying ``template``."""
    from miles.train import RunError, run

    config = validate_args(parse_args([
        "--tiny-model", "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--offload-train-disk-dir", str(tmp_path / "disk"),
        "--metrics-file", str(tmp_path / "metrics.jsonl"), "--load-debug-rollout-data", template]))
    with pytest.raises(RunError) as e:
        run(config)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "metrics.jsonl").exists()
    return str(e.value)


def _record(tmp_path, second):
    """Rollout 0 as a run records it, rollout 1 ``second``'s samples; the template."""
    template = str(tmp_path / "rec" / "r_{rollout_id}.json")
    write_rollout(template, 0, _samples())
    write_rollout(template, 1, second)
    return template


def test_a_response_beyond_the_flag_stops_the_run_before_ray(tmp_path, no_ray):
    samples = _samples()
    samples[1].response_ids, samples[1].response_logprobs = [50] * 3000, [-0.5] * 3000
    message = _refusal(tmp_path, _record(tmp_path, samples))
    assert message == (f"run stopped: --load-debug-rollout-data {tmp_path / 'rec' / 'r_1.json'}: sample 1: a response "
                       "of 3000 tokens, more than --rollout-max-response-len 8: replay with the flags of the run that "
                       "recorded it")


def test_a_sample_beyond_the_models_positions_stops_the_run_before_ray(tmp_path, no_ray):
    message = _refusal(tmp_path, _record(tmp_path, _samples(prompt_len=1020, response_len=8)))
    assert "r_1.json: sample 0: prompt + response = 1020 + 8 tokens, more than the 1024 positions of the model " \
           "(max_position_embeddings, the tiny model)" in message


def test_a_token_id_beyond_the_models_vocabulary_stops_the_run_before_ray(tmp_path, no_ray):
    samples = _samples()
    samples[2].response_ids[3] = 100  # the tiny model's character vocabulary has 100 tokens
    assert "r_1.json: sample 2: response_ids[3] = 100 is not a token id of the model's vocabulary (0..99, the tiny " \
           "model)" in _refusal(tmp_path, _record(tmp_path, samples))


def test_a_missing_or_malformed_recording_stops_the_run_before_ray(tmp_path, no_ray):
    template = str(tmp_path / "rec" / "r_{rollout_id}.json")
    write_rollout(template, 0, _samples())
    assert "r_1.json: cannot read the recorded rollout 1 (No such file or directory)" in _refusal(tmp_path, template)
    (tmp_path / "rec" / "r_1.json").write_text('{"format": "miles-rollout-data/1", "rollout_id": 1}')
    assert "r_1.json: no list of samples; this run trains 4 per rollout" in _refusal(tmp_path, template)


@pytest.mark.parametrize("kind, words", [
    ("fifo", "(a FIFO, not a regular file"),
    ("zero", "(a character device, not a regular file"),
    ("nested", "(nested 5000 levels deep, more than the 4 it may have"),
])
def test_a_fifo_a_device_or_deep_nesting_stops_the_run_before_ray_in_one_line(tmp_path, no_ray, kind, words):
    template = str(tmp_path / "rec" / "r_{rollout_id}.json")
    write_rollout(template, 0, _samples())
    path = tmp_path / "rec" / "r_1.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("[" * 5000 + "]" * 5000)
    message = _refusal(tmp_path, template)
    assert f"--load-debug-rollout-data {path}: not a recorded rollout of this run {words}" in message


def test_a_dry_run_checks_the_recordings_as_the_run_reads_them(tmp_path, capsys):
    """--dry-run validates everything a run would refuse before Ray: the recordings too."""
    from miles.cli import main

    samples = _samples()
    samples[1].response_ids, samples[1].response_logprobs = [50] * 3000, [-0.5] * 3000
    argv = ["train", "--tiny-model", "--dry-run", "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--metrics-file",
            str(tmp_path / "metrics.jsonl"), "--load-debug-rollout-data"]
    assert main([*argv, _record(tmp_path, samples)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the log lines
    assert last.startswith("miles train --dry-run: run stopped: --load-debug-rollout-data") and "sample 1: a response " \
        "of 3000 tokens, more than --rollout-max-response-len 8" in last
    good = str(tmp_path / "good" / "r_{rollout_id}.json")
    write_rollout(good, 0, _samples())
    write_rollout(good, 1, _samples())
    assert main([*argv, good]) == 0
    assert "the recorded rollouts check out" in capsys.readouterr().out
