"""Replayed rollouts (--load-debug-rollout-data) against what the run assumes: lengths against the flags and the
model, token ids against its vocabulary, the groups GRPO compares; a FIFO, a device or deep nesting refused in
one line; what reading a file may allocate bounded by the rollout the flags allow."""

import os
import subprocess
import sys
import textwrap

import pytest

from miles.rollout.recorded import ReplayShape, RolloutDataError, write_rollout
from miles.rollout.types import Sample


def _shape(template, prompts=2, per_prompt=2, max_response_len=8, vocab_size=100, max_positions=64):
    return ReplayShape(template=template, prompts=prompts, samples_per_prompt=per_prompt,
                       max_response_len=max_response_len, vocab_size=vocab_size, max_positions=max_positions,
                       model="the tiny model")


def _samples(prompts=2, per_prompt=2, prompt_len=3, response_len=4):
    return [Sample(index=i, prompt_index=i // per_prompt, prompt_ids=[1 + i // per_prompt] * prompt_len,
                   response_ids=[7] * response_len, response_logprobs=[-0.5] * response_len, response_text="x",
                   finish_reason="length", weight_version=0, reward=float(i % 2)) for i in range(prompts * per_prompt)]


def _record(tmp_path, samples, rollout_id=0):
    template = str(tmp_path / "r_{rollout_id}.json")
    write_rollout(template, rollout_id, samples)
    return template


def _refusal(shape, rollout_id=0) -> str:
    with pytest.raises(RolloutDataError) as e:
        shape.read(rollout_id)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_response_longer_than_the_flag_allows_is_refused_naming_file_sample_length_and_flag(tmp_path):
    samples = _samples()
    samples[3].response_ids, samples[3].response_logprobs = [7] * 3000, [-0.5] * 3000
    template = _record(tmp_path, samples)
    message = _refusal(_shape(template, max_positions=4096))
    assert message.startswith(f"--load-debug-rollout-data {tmp_path / 'r_0.json'}: sample 3: a response of 3000 "
                              "tokens, more than --rollout-max-response-len 8")


def test_prompt_and_response_beyond_the_models_positions_are_refused(tmp_path):
    template = _record(tmp_path, _samples(prompt_len=1100, response_len=8))
    message = _refusal(_shape(template, max_positions=1024))
    assert "r_0.json: sample 0: prompt + response = 1100 + 8 tokens, more than the 1024 positions of the model" \
        in message
    assert "max_position_embeddings, the tiny model" in message


@pytest.mark.parametrize("part", ["prompt_ids", "response_ids"])
def test_a_token_id_outside_the_models_vocabulary_is_refused(tmp_path, part):
    samples = _samples()
    getattr(samples[2], part)[1] = 100
    if part == "prompt_ids":  # the group shares its prompt
        samples[3].prompt_ids = list(samples[2].prompt_ids)
    message = _refusal(_shape(_record(tmp_path, samples)))
    assert f"sample 2: {part}[1] = 100 is not a token id of the model's vocabulary (0..99, the tiny model)" in message


def test_the_samples_of_one_prompt_must_share_its_tokens(tmp_path):
    samples = _samples()
    samples[1].prompt_ids = [9, 9, 9]
    message = _refusal(_shape(_record(tmp_path, samples)))
    assert "sample 1: prompt_ids differ from those of sample 0, the first of prompt 0's group" in message


@pytest.mark.parametrize("logprob", [0.5, float("nan"), float("-inf")])
def test_a_logprob_that_is_not_a_log_probability_is_refused(tmp_path, logprob):
    samples = _samples()
    samples[0].response_logprobs[2] = logprob
    assert "sample 0: response_logprobs must be 4 finite numbers <= 0" in _refusal(_shape(_record(tmp_path, samples)))


def test_a_rollout_as_large_as_the_flags_and_model_allow_reads_back(tmp_path):
    samples = _samples(prompt_len=56, response_len=8)
    for s in samples:
        s.prompt_ids = [99] * 56
        s.response_ids, s.response_logprobs = [98] * 8, [-1.2345678901234567e-300] * 8
        s.response_text = "\U0001f600" * 64
    assert _shape(_record(tmp_path, samples)).read(0) == samples


def test_a_fifo_a_device_or_a_directory_is_refused_without_blocking(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.json")
    os.mkfifo(tmp_path / "r_0.json")
    (tmp_path / "r_1.json").symlink_to("/dev/zero")
    os.mkdir(tmp_path / "r_2.json")
    shape = _shape(template)
    assert "r_0.json: not a recorded rollout of this run (a FIFO, not a regular file" in _refusal(shape, 0)
    assert "r_1.json: not a recorded rollout of this run (a character device, not a regular file" in _refusal(shape, 1)
    assert "r_2.json: not a recorded rollout of this run (a directory, not a regular file" in _refusal(shape, 2)


def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path):
    (tmp_path / "r_0.json").write_text("[" * 10_000 + "]" * 10_000)
    message = _refusal(_shape(str(tmp_path / "r_{rollout_id}.json")))
    assert "r_0.json: not a recorded rollout of this run (nested 10000 levels deep, more than the 4" in message


_MEASURE = textwrap.dedent("""
    import resource, sys
    from miles.rollout.recorded import ReplayShape, RolloutDataError
    shape = ReplayShape(template=sys.argv[1], prompts=16, samples_per_prompt=4, max_response_len=64,
                        vocab_size=50000, max_positions=32768, model="m")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        shape.read(0)
        print("accepted")
    except RolloutDataError as e:
        print(e)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
""")


def test_what_reading_a_file_allocates_is_bounded_by_the_rollout_the_flags_allow(tmp_path):
    """46 MiB of empty lists (4 bytes of text, 64 of memory each) under flags whose largest rollout is a 52 MB
    file of 2.1M values (a file may be 4x that): refused before parsing, the peak RSS growing by less than 4x
    the file, where parsing it takes over 700 MiB."""
    path = tmp_path / "r_0.json"
    with open(path, "wb") as f:
        f.write(b'{"format": "miles-rollout-data/1", "rollout_id": 0, "samples": [')
        f.write(b"[], " * (46 << 18))
        f.write(b"[]]}")
    size = path.stat().st_size
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "r_{rollout_id}.json")], capture_output=True,
                         text=True, timeout=300, check=True).stdout.splitlines()
    assert "holds up to 24,117,254 values, more than the 8,409,152 it may have" in out[0]
    assert int(out[1]) < 4 * size, f"reading a {size}-byte file grew the RSS by {int(out[1])} bytes"


def test_a_file_larger_than_the_flags_allow_is_refused_before_it_is_read(tmp_path):
    shape = _shape(str(tmp_path / "r_{rollout_id}.json"))
    with open(tmp_path / "r_0.json", "wb") as f:
        f.truncate(shape.max_file_bytes + 1)
    assert f"{shape.max_file_bytes + 1:,} bytes, more than the {shape.max_file_bytes:,} it may have" in _refusal(shape)


@pytest.mark.parametrize("reward", [1e308, -1e308, 3.5e38, 1e6 + 1, -(10**7)])
def test_a_reward_beyond_the_bound_is_refused_naming_file_sample_and_value(tmp_path, reward):
    samples = _samples()
    samples[1].reward = reward
    message = _refusal(_shape(_record(tmp_path, samples)))
    assert message.startswith(f"--load-debug-rollout-data {tmp_path / 'r_0.json'}: sample 1: reward {reward!r} is "
                              "beyond +-1e+06, where GRPO's fp32 advantages"), message


def test_rewards_read_back_up_to_the_bound_where_grpo_stays_finite(tmp_path):
    from miles.rl.advantages import grpo_advantages
    from miles.rollout.recorded import MAX_ABS_REWARD

    samples = _samples(prompts=1, per_prompt=4)
    for s, reward in zip(samples, (1e6, -1e6, 1e6, -1e6)):
        s.reward = reward
    read = _shape(_record(tmp_path, samples), prompts=1, per_prompt=4).read(0)
    advantages = grpo_advantages([s.reward for s in read], group_size=4)
    assert MAX_ABS_REWARD == 1e6 and [s.reward for s in read] == [1e6, -1e6, 1e6, -1e6]
    assert bool(advantages.isfinite().all())
    assert not bool(grpo_advantages([1e308, 0.0], group_size=2).isfinite().all()), "what the bound keeps out"
