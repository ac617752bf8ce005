"""Rollouts recorded to files and replayed (slime's ``--save-debug-rollout-data`` and
``--load-debug-rollout-data``): train on exactly the samples an earlier run generated, so two training
configurations (micro-batching, parallel layout, optimizer storage) can be compared loss for loss over
several rollouts instead of only until their engines first sample different tokens.

One JSON file per rollout, the path a template with ``{rollout_id}``. JSON, not pickle: a replayed file
is untrusted input. :class:`ReplayShape` is what the run assumes of every rollout it replays (from its flags
and its model); :meth:`ReplayShape.read` takes a regular file only, bounds its size and what parsing it may
allocate by that shape, checks every field's type and range, the sample count and order, the lengths and
token ids against the flags and the model, and says what is wrong with which file. :meth:`ReplayShape.check`
reads every file a run will replay, so that a bad one stops the run before Ray and the actors start.

Samples with routes (R3, :class:`miles.routing.Routes`) keep them: ``"routes"`` holds the ids base64-encoded
(compact, one JSON value), read back checked against the model's route shape (:attr:`ReplayShape.routes`:
expert count, top-k and MoE layers) and the sample's token count, every id below the expert count and distinct
within a token's top-k; a file's samples carry routes all or none.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

from miles.config.paths import rollout_data_path
from miles.rollout.types import Sample
from miles.routing import Routes, RoutesError, RouteShape, UnsupportedRouterError
from miles.untrusted_json import TooLargeError, UntrustedJSONError, read_json

if TYPE_CHECKING:
    from miles.config import RunConfig

__all__ = ["ROLLOUT_DATA_FORMAT", "RolloutDataError", "ReplayShape", "write_rollout"]

ROLLOUT_DATA_FORMAT = "miles-rollout-data/1"
LOAD_FLAG = "--load-debug-rollout-data"

# What one sample may take in a file, generously (write_rollout writes less): a token id with its separator
# even pretty-printed, a log-prob in full precision, a response token's text JSON-escaped, the fields around.
_ID_BYTES, _LOGPROB_BYTES, _TEXT_BYTES, _SAMPLE_BYTES = 24, 40, 256, 1024
# A file may be this many times the largest rollout of the run's shape before it is refused unparsed: memory
# stays bounded by a multiple of what the run itself would hold, and a file somewhat off the shape (a few
# responses too long) is parsed, so that the refusal names the sample, its length and the flag.
_SLACK = 4
# A model config that names no position limit: the prompt length a file is sized for.
_UNBOUNDED_PROMPT_TOKENS = 1 << 17
_MODEL_CONFIG_BYTES = 4 << 20
_MAX_DEPTH = 4  # document -> samples -> sample -> its lists and its routes' object
_ROUTES_VALUES = 8  # a sample's "routes" member: the object and its four members, with room
# The largest |reward| a recording may hold. GRPO turns a group's rewards into fp32 (miles.rl.advantages): a finite
# fp64 reward beyond fp32's 3.4e38 becomes inf there and its advantage nan, and the group's std sums squared
# deviations of up to (2 x bound)^2 each: at 1e6 that is 4e12 per sample, finite for any group size below 8e25.
# fp32 also spaces its values 0.0625 apart at 1e6, so a larger reward scale would lose the rewards' differences.
MAX_ABS_REWARD = 1e6


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
                        "weight_version": s.weight_version, "reward": s.reward,
                        **({"routes": s.routes.to_json()} if s.routes is not None else {})} for s in samples]}
    try:
        with open(path, "x") as f:
            json.dump(doc, f)
    except FileExistsError:
        raise RolloutDataError(f"{path} exists: this run does not overwrite a recorded rollout; pass another "
                               "--save-debug-rollout-data template or move the file") from None
    return path


@dataclass(frozen=True)
class ReplayShape:
    """What the run assumes of every rollout it replays: ``prompts`` (--rollout-batch-size) x
    ``samples_per_prompt`` (--n-samples-per-prompt) samples, prompt-major, the ``samples_per_prompt`` samples
    of a prompt sharing its tokens; responses of at most ``max_response_len`` tokens
    (--rollout-max-response-len); token ids below the model's ``vocab_size``; prompt + response within the
    model's ``max_positions`` (None: its config names no limit); ``routes``: the shape of the model's routes
    (None: a model without MoE routers miles records, whose recordings carry none). ``model``: where the model's
    limits come from, as messages name it."""

    template: str
    prompts: int
    samples_per_prompt: int
    max_response_len: int
    vocab_size: int
    max_positions: Optional[int]
    model: str
    routes: Optional[RouteShape] = None

    @classmethod
    def of_run(cls, config: "RunConfig", model_config: Mapping[str, Any], model: str) -> "ReplayShape":
        """The shape of ``config``'s replay (--load-debug-rollout-data set) for the model of ``model_config``
        (its transformers config; a multimodal one's ``text_config``), described as ``model``."""
        sizes = model_config.get("text_config") if isinstance(model_config.get("text_config"), dict) else model_config
        positions = next((sizes[k] for k in ("max_position_embeddings", "n_positions") if k in sizes), None)
        vocab_size = sizes.get("vocab_size")
        if type(vocab_size) is not int or vocab_size < 1:
            raise RolloutDataError(f"{LOAD_FLAG}: {model} gives no vocab_size (got {_clipped(vocab_size)}) to check "
                                   "the recorded rollouts' token ids against; pass a complete model folder")
        from miles.routing.routers import route_shape_of_config  # torch and transformers, when a replay is checked

        try:
            routes = route_shape_of_config(sizes)
        except UnsupportedRouterError:  # an MoE family no engine of miles records routes of: its recordings carry none
            routes = None
        r = config.rollout
        return cls(template=r.load_debug_rollout_data, prompts=r.rollout_batch_size,
                   samples_per_prompt=r.n_samples_per_prompt, max_response_len=r.rollout_max_response_len,
                   vocab_size=vocab_size, max_positions=positions if type(positions) is int and positions > 0 else None,
                   model=model, routes=routes)

    @classmethod
    def of_policy(cls, config: "RunConfig", source, tokenizer) -> "ReplayShape":
        """:meth:`of_run` for the run's policy (:func:`miles.models.prepare_policy`'s ``source``): its folder's
        config.json, or the tiny model's config and vocabulary."""
        from miles.models import TINY_MODEL_CONFIG

        if source.path is None:
            return cls.of_run(config, {**TINY_MODEL_CONFIG, "vocab_size": len(tokenizer)}, "the tiny model")
        path = os.path.join(source.path, "config.json")
        try:
            model_config = read_json(path, _MODEL_CONFIG_BYTES)
        except (OSError, UntrustedJSONError) as e:
            raise RolloutDataError(f"{LOAD_FLAG}: the model's {path} cannot be read to check the recorded rollouts "
                                   f"against ({getattr(e, 'strerror', None) or e})") from None
        return cls.of_run(config, model_config, path)

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def sample_tokens(self) -> int:
        """The most tokens (prompt + response) one sample may have."""
        return self.max_positions or (_UNBOUNDED_PROMPT_TOKENS + self.max_response_len)

    @property
    def max_file_bytes(self) -> int:
        """The largest file a rollout of this shape can be: bounds what is read."""
        per_sample = (_SAMPLE_BYTES + _ID_BYTES * self.sample_tokens + self._routes_bytes
                      + (_LOGPROB_BYTES + _TEXT_BYTES) * self.max_response_len)
        return _SLACK * (1024 + self.samples * per_sample)

    @property
    def _routes_bytes(self) -> int:
        """The most a sample's routes take in a file: base64 (4 characters per 3 bytes) of its tokens' ids."""
        return 0 if self.routes is None else 4 * -(-self.sample_tokens * self.routes.bytes_per_token // 3)

    @property
    def max_values(self) -> int:
        """The most JSON values such a file holds (each sample: its fields, its routes' object, its token ids, a
        log-prob per response token): bounds what parsing it allocates."""
        routes = 0 if self.routes is None else _ROUTES_VALUES
        return _SLACK * (16 + self.samples * (16 + routes + self.sample_tokens + self.max_response_len))

    def check(self, rollout_ids: Iterable[int]) -> None:
        """Read every rollout of ``rollout_ids`` as :meth:`read` does (one at a time), so that a missing or
        bad file stops the run before anything starts."""
        for rollout_id in rollout_ids:
            self.read(rollout_id)

    def read(self, rollout_id: int) -> list[Sample]:
        """The samples of rollout ``rollout_id`` as :func:`write_rollout` wrote them, checked against this
        shape, every field of its type and range; :class:`RolloutDataError` naming the file, the sample, the
        value and its bound otherwise."""
        path = rollout_data_path(self.template, rollout_id)
        try:
            doc = read_json(path, self.max_file_bytes, _MAX_DEPTH, self.max_values)
        except OSError as e:
            raise RolloutDataError(f"{LOAD_FLAG} {path}: cannot read the recorded rollout {rollout_id} "
                                   f"({e.strerror}); the run replays one file per rollout it trains") from None
        except TooLargeError as e:
            raise RolloutDataError(
                f"{LOAD_FLAG} {path}: not a recorded rollout of this run ({e}; a rollout of --rollout-batch-size "
                f"{self.prompts} x --n-samples-per-prompt {self.samples_per_prompt} samples, responses of at most "
                f"--rollout-max-response-len {self.max_response_len} tokens, is far smaller)") from None
        except UntrustedJSONError as e:
            raise RolloutDataError(f"{LOAD_FLAG} {path}: not a recorded rollout of this run ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != ROLLOUT_DATA_FORMAT:
            raise RolloutDataError(f"{LOAD_FLAG} {path}: not a recorded rollout (format {_shown(doc)}, expected "
                                   f"{ROLLOUT_DATA_FORMAT!r})")
        if doc.get("rollout_id") != rollout_id:
            raise RolloutDataError(f"{LOAD_FLAG} {path}: holds rollout {doc.get('rollout_id')!r}, not {rollout_id}")
        records = doc.get("samples")
        if not isinstance(records, list) or len(records) != self.samples:
            count = len(records) if isinstance(records, list) else "no list of"
            raise RolloutDataError(
                f"{LOAD_FLAG} {path}: {count} samples; this run trains {self.samples} per rollout "
                f"(--rollout-batch-size {self.prompts} x --n-samples-per-prompt {self.samples_per_prompt}): "
                "replay with the batch shape of the run that recorded it")
        samples = [self._sample(path, i, r) for i, r in enumerate(records)]
        for s in samples:
            if (s.routes is None) != (samples[0].routes is None):
                has, lacks = ("lacks", "has") if s.routes is None else ("has", "lacks")
                raise RolloutDataError(f"{LOAD_FLAG} {path}: sample {s.index} {has} routes and sample 0 {lacks}: a "
                                       "rollout records routes for all its samples or none")
            first = samples[s.prompt_index * self.samples_per_prompt]
            if s.prompt_ids != first.prompt_ids:
                raise RolloutDataError(
                    f"{LOAD_FLAG} {path}: sample {s.index}: prompt_ids differ from those of sample {first.index}, "
                    f"the first of prompt {s.prompt_index}'s group of --n-samples-per-prompt {self.samples_per_prompt}"
                    ": GRPO compares the samples of one prompt; replay with the flags of the run that recorded it")
        return samples

    def _sample(self, path: str, i: int, r: Any) -> Sample:
        def bad(what: str) -> RolloutDataError:
            return RolloutDataError(f"{LOAD_FLAG} {path}: sample {i}: {what}")

        n = self.samples_per_prompt
        if not isinstance(r, dict):
            raise bad("not an object")
        if r.get("index") != i or r.get("prompt_index") != i // n:
            raise bad(f"index {r.get('index')!r} / prompt_index {r.get('prompt_index')!r}, expected {i} / "
                      f"{i // n} (samples are stored prompt-major)")
        prompt_ids, response_ids = r.get("prompt_ids"), r.get("response_ids")
        for name, ids in (("prompt_ids", prompt_ids), ("response_ids", response_ids)):
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise bad(f"{name} must be a non-empty list of token ids")
            t, token = next(((t, x) for t, x in enumerate(ids) if not 0 <= x < self.vocab_size), (None, None))
            if t is not None:
                raise bad(f"{name}[{t}] = {token} is not a token id of the model's vocabulary (0..{self.vocab_size - 1}"
                          f", {self.model}): replay with the model of the run that recorded it")
        if len(response_ids) > self.max_response_len:
            raise bad(f"a response of {len(response_ids)} tokens, more than --rollout-max-response-len "
                      f"{self.max_response_len}: replay with the flags of the run that recorded it")
        tokens = len(prompt_ids) + len(response_ids)
        if self.max_positions is not None and tokens > self.max_positions:
            raise bad(f"prompt + response = {len(prompt_ids)} + {len(response_ids)} tokens, more than the "
                      f"{self.max_positions} positions of the model (max_position_embeddings, {self.model}): "
                      "replay with the model of the run that recorded it")
        logprobs = r.get("response_logprobs")
        if (not isinstance(logprobs, list) or len(logprobs) != len(response_ids)
                or not all(type(x) in (int, float) and math.isfinite(x) and x <= 0 for x in logprobs)):
            raise bad(f"response_logprobs must be {len(response_ids)} finite numbers <= 0, the log-probability of "
                      "each response token")
        reward = r.get("reward")
        if type(reward) not in (int, float) or not math.isfinite(reward):
            raise bad(f"reward {_clipped(reward)} is not a finite number")
        if abs(reward) > MAX_ABS_REWARD:
            raise bad(f"reward {_clipped(reward)} is beyond +-{MAX_ABS_REWARD:g}, where GRPO's fp32 advantages lose "
                      "the rewards' differences or overflow: record rewards of a smaller scale")
        text, finish, version = r.get("response_text"), r.get("finish_reason"), r.get("weight_version")
        if not isinstance(text, str) or finish not in ("stop", "length") or type(version) is not int:
            raise bad("response_text must be a string, finish_reason 'stop' or 'length', weight_version an int")
        return Sample(index=i, prompt_index=i // n, prompt_ids=prompt_ids, response_ids=response_ids,
                      response_logprobs=[float(x) for x in logprobs], response_text=text, finish_reason=finish,
                      weight_version=version, reward=float(reward), routes=self._routes(bad, r, tokens))

    def _routes(self, bad, r: dict, tokens: int) -> Optional[Routes]:
        if "routes" not in r:
            return None
        if self.routes is None:
            raise bad(f"carries routes, but {self.model} has no MoE router miles records: replay with the model of "
                      "the run that recorded it")
        try:
            return Routes.from_json(r["routes"], self.routes, tokens)
        except RoutesError as e:
            raise bad(f"{e}: replay with the model of the run that recorded it") from None


def _clipped(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _shown(doc: Any) -> str:
    return _clipped(doc.get("format")) if isinstance(doc, dict) else type(doc).__name__
