"""Prompt data: JSONL files and the built-in arithmetic task.

Public API::

    items = load_prompt_data(path)                  # list[PromptItem]; PromptDataError names file:line
    items = arithmetic_task(num_prompts=256, seed=0)
    source = make_prompt_source(config)             # --prompt-data or the built-in task
    batch = source.get_batch(rollout_id, batch_size)   # deterministic in (rollout_seed, rollout_id)
    text = format_prompt(tokenizer, item.prompt)    # chat template (with generation prompt) if any
    ids = encode_prompts(tokenizer, [item.prompt, ...])  # list[list[int]] for the rollout engine
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # from the leaf that defines it: miles.config's validation imports this module (--prompt-data)
    from miles.config.run_config import RunConfig

__all__ = [
    "PromptItem",
    "PromptDataError",
    "PromptSource",
    "load_prompt_data",
    "arithmetic_task",
    "make_prompt_source",
    "format_prompt",
    "encode_prompts",
    "ARITHMETIC_INSTRUCTION",
]

ARITHMETIC_INSTRUCTION = "Answer with just the number."


@dataclass(frozen=True)
class PromptItem:
    """One prompt: the user-facing ``prompt`` text and the reference ``answer`` the reward checks."""

    prompt: str
    answer: str
    metadata: dict = field(default_factory=dict, compare=False, hash=False)


class PromptDataError(ValueError):
    """A bad prompt file; the message starts with ``<path>:<line>:`` where a line is at fault."""


def load_prompt_data(path: str) -> list[PromptItem]:
    """Read a JSONL file with one ``{"prompt": str, "answer": str|number, ...}`` object per line.

    Blank lines are skipped; other keys go to ``metadata``. Any malformed line raises
    :class:`PromptDataError` with the file name and 1-based line number; an empty file is an error too.
    """
    items: list[PromptItem] = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise PromptDataError(f"{path}: cannot open prompt data: {e.strerror or e}") from e
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise PromptDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            for key in ("prompt", "answer"):
                if key not in obj:
                    raise PromptDataError(f'{where}: missing key "{key}" (each line needs "prompt" and "answer")')
            prompt, answer = obj["prompt"], obj["answer"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise PromptDataError(f'{where}: "prompt" must be a non-empty string')
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise PromptDataError(f'{where}: "answer" must be a string or a number')
            meta = {k: v for k, v in obj.items() if k not in ("prompt", "answer")}
            items.append(PromptItem(prompt, str(answer), meta))
    if not items:
        raise PromptDataError(f"{path}: no prompts (the file is empty)")
    return items


def arithmetic_task(num_prompts: int = 256, seed: int = 0, max_operand: int = 30) -> list[PromptItem]:
    """The built-in task: ``"What is a + b? Answer with just the number."`` with ``answer = a + b``.

    Rewarded by :func:`miles.rl.rewards.arithmetic_reward` (partial credit for digits and closeness),
    so both a 135M instruct model (learns to answer tersely and correctly) and a tiny random model
    (learns to emit digits) improve within a few rollouts.
    """
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        items.append(PromptItem(f"What is {a} + {b}? {ARITHMETIC_INSTRUCTION}", str(a + b), {"task": "arithmetic"}))
    return items


class PromptSource:
    """Serves prompt batches: each epoch is a shuffled pass (seeded by ``seed`` and the epoch)."""

    def __init__(self, items: Sequence[PromptItem], seed: int = 0):
        if not items:
            raise ValueError("PromptSource needs at least one prompt")
        self.items = list(items)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.items)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def get_batch(self, rollout_id: int, batch_size: int) -> list[PromptItem]:
        """Prompts ``[rollout_id * batch_size, (rollout_id + 1) * batch_size)`` of the shuffled stream."""
        n = len(self.items)
        out = []
        for k in range(rollout_id * batch_size, (rollout_id + 1) * batch_size):
            epoch, pos = divmod(k, n)
            out.append(self.items[self._order(epoch)[pos]])
        return out


def make_prompt_source(config: RunConfig) -> PromptSource:
    """``--prompt-data`` or the built-in arithmetic task, shuffled with ``--rollout-seed``."""
    seed = config.rollout.rollout_seed
    path = config.rollout.prompt_data
    items = load_prompt_data(path) if path else arithmetic_task(seed=seed)
    return PromptSource(items, seed=seed)


def format_prompt(tokenizer: Any, prompt: str) -> str:
    """The prompt as the model sees it: the tokenizer's chat template with a generation prompt when it
    has one, else the raw text."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    return prompt


def encode_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each formatted prompt (special tokens come from the template, none are added)."""
    out = []
    for p in prompts:
        text = format_prompt(tokenizer, p)
        ids = tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
        out.append(list(ids))
    return out
