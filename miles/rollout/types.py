"""Data types shared by rollout engines and the RL loop (plain, picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from miles.config import RunConfig
    from miles.routing import Routes

__all__ = ["SamplingParams", "Sample"]


@dataclass
class SamplingParams:
    """How to sample.

    ``temperature`` (0 = greedy), ``top_p`` (nucleus, 1 = off), ``max_new_tokens``, ``seed`` (None: the
    engine's running generator; an int makes the call reproducible for the same prompts and weights),
    ``n`` samples per prompt (outputs are prompt-major: the ``n`` samples of prompt ``i`` are at
    ``[i * n, (i + 1) * n)``), ``stop_token_ids`` (None: the tokenizer's / generation config's eos).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: Optional[int] = None
    n: int = 1
    stop_token_ids: Optional[tuple[int, ...]] = None

    @classmethod
    def from_config(cls, config: "RunConfig", rollout_id: int = 0) -> "SamplingParams":
        """From ``--rollout-temperature/--rollout-top-p/--rollout-max-response-len/--n-samples-per-prompt``;
        the seed is ``--rollout-seed + rollout_id`` so every rollout samples differently but
        reproducibly."""
        r = config.rollout
        return cls(
            temperature=r.rollout_temperature,
            top_p=r.rollout_top_p,
            max_new_tokens=r.rollout_max_response_len,
            seed=r.rollout_seed + rollout_id,
            n=r.n_samples_per_prompt,
        )

    @classmethod
    def coerce(cls, sampling: "SamplingParams | dict | None") -> "SamplingParams":
        if sampling is None:
            return cls()
        if isinstance(sampling, cls):
            return sampling
        return cls(**dict(sampling))

    def check(self) -> "SamplingParams":
        """Itself, once every field is in range (ValueError naming the field and its value otherwise)."""
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (1: off), got {self.top_p!r}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n!r}")
        if problems:
            raise ValueError("sampling params: " + "; ".join(problems))
        return self


@dataclass
class Sample:
    """One generated response.

    ``index``: position in the returned list; ``prompt_index``: which input prompt; ``prompt_ids`` and
    ``response_ids`` (the stop token, when generated, is the last response token);
    ``response_logprobs[j]`` = the engine's ``log_softmax(logits / temperature)`` of ``response_ids[j]``
    (top-p not applied; temperature 0 reports temperature-1 log-probs); ``response_text`` decoded
    without special tokens; ``finish_reason`` ``"stop"`` or ``"length"``; ``reward``/``advantage`` are
    filled in by the RL loop; ``weight_version`` of the engine weights that generated it; ``routes``: the
    experts each MoE layer chose for its tokens when the engine records them (R3, :mod:`miles.routing`), else
    None.
    """

    index: int
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    finish_reason: str
    weight_version: int = 0
    reward: Optional[float] = None
    advantage: Optional[float] = None
    metadata: dict = field(default_factory=dict)
    routes: Optional["Routes"] = None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)
