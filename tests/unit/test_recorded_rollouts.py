"""Recorded rollouts (--save/--load-debug-rollout-data): written as JSON, read back equal, and every way a
file can be wrong refused with the file and the fix named. Plus the flags' validation."""

import json

import pytest

from miles.config import ArgumentError, parse_args
from miles.preflight import validate_args
from miles.config.paths import rollout_data_path
from miles.rollout.recorded import ReplayShape, RolloutDataError, write_rollout
from miles.rollout.types import Sample


def _samples(prompts=2, per_prompt=2):
    return [Sample(index=i, prompt_index=i // per_prompt, prompt_ids=[1, 2 + i // per_prompt],
                   response_ids=[5, 6, 7][: 1 + i % 3],
                   response_logprobs=[-0.5, -1.25, -2.0][: 1 + i % 3], response_text=f"r{i}",
                   finish_reason="stop" if i % 2 else "length", weight_version=3, reward=0.25 * i)
            for i in range(prompts * per_prompt)]


def _shape(template, prompts=2, per_prompt=2):
    return ReplayShape(template=template, prompts=prompts, samples_per_prompt=per_prompt, max_response_len=8,
                       vocab_size=100, max_positions=1024, model="the tiny model")


def test_a_recorded_rollout_reads_back_equal(tmp_path):
    template = str(tmp_path / "sub" / "rollout_{rollout_id}.json")
    path = write_rollout(template, 7, _samples())
    assert path == str(tmp_path / "sub" / "rollout_7.json") == rollout_data_path(template, 7)
    assert _shape(template).read(7) == _samples()


def test_a_recording_never_overwrites_a_file(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.json")
    (tmp_path / "r_0.json").write_text("mine")
    with pytest.raises(RolloutDataError, match="exists"):
        write_rollout(template, 0, _samples())
    assert (tmp_path / "r_0.json").read_text() == "mine"


def _doc(**changes):
    doc = {"format": "miles-rollout-data/1", "rollout_id": 0,
           "samples": [{"index": s.index, "prompt_index": s.prompt_index, "prompt_ids": s.prompt_ids,
                        "response_ids": s.response_ids, "response_logprobs": s.response_logprobs,
                        "response_text": s.response_text, "finish_reason": s.finish_reason,
                        "weight_version": s.weight_version, "reward": s.reward} for s in _samples()]}
    first = changes.pop("first", {})
    doc["samples"][0].update(first)
    doc.update(changes)
    return doc


@pytest.mark.parametrize("text, words", [
    ("{not json", "not a recorded rollout"),
    (json.dumps([1, 2]), "not a recorded rollout (format list"),
    (json.dumps(_doc(format="other/9")), "format 'other/9'"),
    (json.dumps(_doc(rollout_id=3)), "holds rollout 3, not 0"),
    (json.dumps(_doc(samples=[])), "0 samples; this run trains 4"),
    (json.dumps(_doc(first={"index": 2})), "sample 0: index 2"),
    (json.dumps(_doc(first={"prompt_ids": [1, -4]})), "prompt_ids[1] = -4 is not a token id of the model's "
                                                       "vocabulary (0..99, the tiny model)"),
    (json.dumps(_doc(first={"response_ids": [1.5]})), "response_ids must be"),
    (json.dumps(_doc(first={"response_logprobs": [-1.0, -2.0]})), "response_logprobs must be 1 finite numbers <= 0"),
    (json.dumps(_doc(first={"reward": float("nan")})), "reward nan is not a finite number"),
    (json.dumps(_doc(first={"reward": True})), "reward True is not a finite number"),
    (json.dumps(_doc(first={"finish_reason": "abort"})), "finish_reason 'stop' or 'length'"),
])
def test_a_file_that_is_not_a_recording_of_this_run_is_refused_saying_why(tmp_path, text, words):
    (tmp_path / "r_0.json").write_text(text)
    with pytest.raises(RolloutDataError) as e:
        _shape(str(tmp_path / "r_{rollout_id}.json")).read(0)
    assert str(tmp_path / "r_0.json") in str(e.value) and words in str(e.value)


def test_a_missing_or_oversized_file_is_refused_before_it_is_read(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.json")
    with pytest.raises(RolloutDataError, match="cannot read the recorded rollout 0"):
        _shape(template).read(0)
    bound = _shape(template).max_file_bytes
    (tmp_path / "r_0.json").write_text(json.dumps(_doc()) + " " * bound)
    with pytest.raises(RolloutDataError, match=f"more than the {bound:,} it may have"):
        _shape(template).read(0)


def _validate(tmp_path, *flags):
    return validate_args(parse_args(["--tiny-model", "--offload-train-disk-dir", str(tmp_path / "d"),
                                     "--num-rollout", "3", *flags]))


def test_the_templates_need_the_placeholder_and_a_recording_no_existing_file(tmp_path):
    with pytest.raises(ArgumentError, match=r"no \{rollout_id\} in the path") as e:
        _validate(tmp_path, "--save-debug-rollout-data", str(tmp_path / "r.json"))
    assert "--save-debug-rollout-data" in e.value.fix
    with pytest.raises(ArgumentError, match=r"no \{rollout_id\}"):
        _validate(tmp_path, "--load-debug-rollout-data", str(tmp_path / "r.json"))
    template = str(tmp_path / "r_{rollout_id}.json")
    with pytest.raises(ArgumentError, match="the same template"):
        _validate(tmp_path, "--save-debug-rollout-data", template, "--load-debug-rollout-data", template)
    (tmp_path / "r_2.json").write_text("{}")
    with pytest.raises(ArgumentError, match=r"r_2.json exists \(1 of the run's 3"):
        _validate(tmp_path, "--save-debug-rollout-data", template)
    cfg = _validate(tmp_path, "--save-debug-rollout-data", str(tmp_path / "new_{rollout_id}.json"))
    assert cfg.rollout.save_debug_rollout_data.endswith("new_{rollout_id}.json")
