"""Rule-based rewards in [0, 1].

Public API::

    arithmetic_reward(response, answer) -> float
    text_match_reward(response, answer) -> float
    default_reward(response, answer) -> float      # integer answer -> arithmetic, else text match
    compute_rewards(responses, answers, reward_fn=default_reward) -> list[float]
"""

from __future__ import annotations

import re
import string
from typing import Callable, Sequence

__all__ = ["arithmetic_reward", "text_match_reward", "default_reward", "compute_rewards"]

_INT = re.compile(r"-?\d+")


def arithmetic_reward(response: str, answer: str | int) -> float:
    """Reward of a response to an integer question, with partial credit.

    ``0.5 * correct + 0.3 * closeness + 0.2 * digit_fraction`` where ``correct`` is 1 when the last
    integer in the response equals the answer, ``closeness = max(0, 1 - |last - answer| / max(|answer|, 1))``
    (0 without any integer) and ``digit_fraction`` is the share of non-space characters that are digits.
    Exactly ``"<answer>"`` (optionally with a trailing period) scores 1.0; ``"3 + 4 = 7"`` scores 0.92;
    a response without digits scores 0.
    """
    target = int(str(answer).strip())
    text = response.strip()
    nums = _INT.findall(text)
    if not nums:
        return 0.0
    last = int(nums[-1])
    correct = 1.0 if last == target else 0.0
    closeness = max(0.0, 1.0 - abs(last - target) / max(abs(target), 1))
    chars = [c for c in text.rstrip(".") if not c.isspace()]
    digit_fraction = sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
    return float(min(1.0, 0.5 * correct + 0.3 * closeness + 0.2 * digit_fraction))


def _normalize(s: str) -> str:
    s = s.lower().strip()
    s = s.translate(str.maketrans("", "", string.punctuation))
    return " ".join(s.split())


def text_match_reward(response: str, answer: str) -> float:
    """1.0 for a normalized exact match (case, punctuation and spacing ignored); ``0.5 + 0.5 * len(answer)
    / len(response)`` when the answer is contained in the response; otherwise ``0.5 *`` word-level F1."""
    r, a = _normalize(response), _normalize(str(answer))
    if not a:
        return 0.0
    if r == a:
        return 1.0
    if a in r:
        return 0.5 + 0.5 * len(a) / len(r)
    rw, aw = r.split(), a.split()
    common = sum(min(rw.count(w), aw.count(w)) for w in set(aw))
    if not common:
        return 0.0
    p, q = common / len(rw), common / len(aw)
    return 0.5 * (2 * p * q / (p + q))


def default_reward(response: str, answer: str) -> float:
    """:func:`arithmetic_reward` when the answer is an integer, else :func:`text_match_reward`."""
    if _INT.fullmatch(str(answer).strip()):
        return arithmetic_reward(response, answer)
    return text_match_reward(response, answer)


def compute_rewards(
    responses: Sequence[str], answers: Sequence[str], reward_fn: Callable[[str, str], float] = default_reward
) -> list[float]:
    """Element-wise rewards; ``responses[i]`` is judged against ``answers[i]``."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    return [float(reward_fn(r, a)) for r, a in zip(responses, answers)]
