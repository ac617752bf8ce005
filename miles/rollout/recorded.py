"""Rollouts recorded to files and replayed (slime's ``--save-debug-rollout-data`` and
``--load-debug-rollout-data``): train on exactly the samples an earlier run generated, so two training
configurations (micro-batching, parallel layout, optimizer storage) can be compared loss for loss over
several rollouts instead of only until their engines first sample different tokens.

One JSON file per rollout, the path a template with ``{rollout_id}``. JSON, not pickle: a replayed file
is untrusted input. :func:`read_rollout` bounds the size, checks every field's type and range and the
sample count and order the run expects, and says what is wrong with which file.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

from miles.config.paths import rollout_data_path
from miles.rollout.types import Sample

__all__ = ["ROLLOUT_DATA_FORMAT", "RolloutDataError", "write_rollout", "read_rollout"]

ROLLOUT_DATA_FORMAT = "miles-rollout-data/1"
MAX_ROLLOUT_FILE_BYTES = 4 << 30  # a rollout of 4096 samples x 32k tokens as JSON is ~2 GB


class RolloutDataError(ValueError):
    """A recorded rollout that cannot be written or replayed; the message names the file and the fix."""


def write_rollout(template: str, rollout_id: int, samples: Sequence[Sample]) -> str:
    """Write the samples (with their rewards) of rollout ``rollout_id``; never over an existing file."""
    path = rollout_data_path(template, rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"format": ROLLOUT_DATA_FORMAT, "rollout_id": rollout_id,
           "samples": [{"index": s.index, "prompt_index": s.prompt_index, "prompt_ids": list(s.prompt_ids),
                        "response_ids": list(s.response_ids), "response_logprobs": list(s.response_logprobs),
                        "response_text": s.response_text, "finish_reason": s.finish_reason,
                        "weight_version": s.weight_version, "reward": s.reward} for s in samples]}
    try:
        with open(path, "x") as f:
            json.dump(doc, f)
    except FileExistsError:
        raise RolloutDataError(f"{path} exists: this run does not overwrite a recorded rollout; pass another "
                               "--save-debug-rollout-data template or move the file") from None
    return path


def read_rollout(template: str, rollout_id: int, prompts: int, samples_per_prompt: int) -> list[Sample]:
    """The samples of rollout ``rollout_id`` as :func:`write_rollout` wrote them, checked: ``prompts`` x
    ``samples_per_prompt`` samples, prompt-major (GRPO groups them so), every field of its type and range."""
    path = rollout_data_path(template, rollout_id)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise RolloutDataError(f"{path}: cannot read the recorded rollout {rollout_id} ({e.strerror}); "
                               "--load-debug-rollout-data needs one file per rollout the run trains") from None
    if size > MAX_ROLLOUT_FILE_BYTES:
        raise RolloutDataError(f"{path}: {size} bytes, more than the {MAX_ROLLOUT_FILE_BYTES} a recorded rollout "
                               "may have; this is not a file --save-debug-rollout-data wrote")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(MAX_ROLLOUT_FILE_BYTES + 1))
    except (OSError, ValueError) as e:
        raise RolloutDataError(f"{path}: not a recorded rollout ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != ROLLOUT_DATA_FORMAT:
        raise RolloutDataError(f"{path}: not a recorded rollout (format {_shown(doc)}, expected "
                               f"{ROLLOUT_DATA_FORMAT!r})")
    if doc.get("rollout_id") != rollout_id:
        raise RolloutDataError(f"{path}: holds rollout {doc.get('rollout_id')!r}, not {rollout_id}")
    records = doc.get("samples")
    expected = prompts * samples_per_prompt
    if not isinstance(records, list) or len(records) != expected:
        count = len(records) if isinstance(records, list) else "no list of"
        raise RolloutDataError(f"{path}: {count} samples; this run trains {expected} per rollout "
                               f"(--rollout-batch-size {prompts} x --n-samples-per-prompt {samples_per_prompt}): "
                               "replay with the batch shape of the run that recorded it")
    return [_sample(path, i, r, samples_per_prompt) for i, r in enumerate(records)]


def _shown(doc: Any) -> str:
    return repr(doc.get("format")) if isinstance(doc, dict) else type(doc).__name__


def _sample(path: str, i: int, r: Any, samples_per_prompt: int) -> Sample:
    def bad(what: str) -> RolloutDataError:
        return RolloutDataError(f"{path}: sample {i}: {what}")

    if not isinstance(r, dict):
        raise bad("not an object")
    if r.get("index") != i or r.get("prompt_index") != i // samples_per_prompt:
        raise bad(f"index {r.get('index')!r} / prompt_index {r.get('prompt_index')!r}, expected {i} / "
                  f"{i // samples_per_prompt} (samples are stored prompt-major)")
    prompt_ids, response_ids = r.get("prompt_ids"), r.get("response_ids")
    for name, ids in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
        if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
            raise bad(f"{name} must be a non-empty list of token ids >= 0")
    logprobs = r.get("response_logprobs")
    if (not isinstance(logprobs, list) or len(logprobs) != len(response_ids)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs)):
        raise bad(f"response_logprobs must be {len(response_ids)} numbers, one per response token")
    reward = r.get("reward")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise bad(f"reward {reward!r} is not a finite number")
    text, finish, version = r.get("response_text"), r.get("finish_reason"), r.get("weight_version")
    if not isinstance(text, str) or finish not in ("stop", "length") or type(version) is not int:
        raise bad("response_text must be a string, finish_reason 'stop' or 'length', weight_version an int")
    # the log-probs are checked where the trainer takes them (NaN, inf, > 0: a skipped step that says so)
    return Sample(index=i, prompt_index=i // samples_per_prompt, prompt_ids=prompt_ids, response_ids=response_ids,
                  response_logprobs=[float(x) for x in logprobs], response_text=text, finish_reason=finish,
                  weight_version=version, reward=float(reward))
