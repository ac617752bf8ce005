"""The rollout-engine contract's state machine (miles/rollout/contract.py), shared by every engine: which
memory tags are released, the open weight update, whether a generate runs. Each check raises the
contract's error naming the engine and the call to make; the engines keep only their own mechanics."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from miles.rollout.contract import MEMORY_TAGS, WEIGHTS

__all__ = ["EngineState", "UpdateSession", "check_prompts"]


def check_prompts(input_ids: Any, vocab_size: Optional[int] = None) -> list[list[int]]:
    """``generate``'s input_ids as lists of ints: a list of non-empty token-id lists (strings are refused:
    tokenize first), each id in ``[0, vocab_size)`` when the engine knows its vocabulary."""
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise TypeError(f"generate takes input_ids, a list of token-id lists, got {type(input_ids).__name__}")
    prompts = []
    for i, ids in enumerate(input_ids):
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise TypeError(f"input_ids[{i}] is a {type(ids).__name__}, not a list of token ids: tokenize prompts "
                            "first (miles.rl.encode_prompts)")
        if not ids:
            raise ValueError(f"input_ids[{i}] is empty")
        prompt = [int(t) for t in ids]
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
                raise ValueError(f"input_ids[{i}] has token ids [{shown}] outside the vocabulary [0, {vocab_size})")
        prompts.append(prompt)
    return prompts


@dataclass
class UpdateSession:
    """An open weight update: its version and what it copied so far."""

    version: int
    tensors: int = 0
    bytes: int = 0

    def count(self, stats: dict) -> None:
        self.tensors += stats["tensors"]
        self.bytes += stats["bytes"]


class EngineState:
    def __init__(self, engine_id: int):
        self.engine_id = engine_id
        self.released: set[str] = set()
        self.session: Optional[UpdateSession] = None
        self.generating = False
        # released without a backup and not yet rewritten by a complete weight update (the engine decides)
        self.weights_undefined = False

    def released_tags(self) -> list[str]:
        return [t for t in MEMORY_TAGS if t in self.released]

    def check_generate(self) -> None:
        released = self.released_tags()
        if released:
            raise RuntimeError(f"rollout engine {self.engine_id}: {released} released; call "
                               f"resume_memory_occupation({released}) before generate()")
        if self.session is not None:
            raise RuntimeError(f"rollout engine {self.engine_id}: weight update to version {self.session.version} "
                               "in progress; call end_weight_update() before generate()")
        if self.weights_undefined:
            raise RuntimeError(f"rollout engine {self.engine_id}: its weights were released without a backup and no "
                               "weight update has rewritten all of them since; push every weight (begin_weight_update, "
                               "update_weights_*, end_weight_update) before generate()")

    @contextlib.contextmanager
    def generating_call(self):
        """Around a generate: release is refused meanwhile."""
        self.check_generate()
        self.generating = True
        try:
            yield
        finally:
            self.generating = False

    def check_release(self, tags: Sequence[str]) -> None:
        if self.generating:
            raise RuntimeError(f"rollout engine {self.engine_id}: cannot release {list(tags)} while generate runs")
        if WEIGHTS in tags and self.session is not None:
            raise RuntimeError(f"rollout engine {self.engine_id}: cannot release weights during the weight update to "
                               f"version {self.session.version}; end it first")

    def begin(self, version: int) -> UpdateSession:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weight version must be an int >= 0, got {version!r}")
        if WEIGHTS in self.released:
            raise RuntimeError(f"rollout engine {self.engine_id}: weights are released; call "
                               "resume_memory_occupation(['weights']) before begin_weight_update()")
        if self.session is not None:
            raise RuntimeError(f"rollout engine {self.engine_id}: a weight update to version {self.session.version} "
                               f"is already open; end it before beginning version {version}")
        self.session = UpdateSession(version)
        return self.session

    def open_session(self, call: str) -> UpdateSession:
        if self.session is None:
            raise RuntimeError(f"rollout engine {self.engine_id}: {call}() outside a weight update; call "
                               "begin_weight_update(version) first")
        return self.session

    def ending(self, version: int) -> UpdateSession:
        """The open session ``end_weight_update(version)`` may close (still open: an engine that must tell
        its server first closes it after, with :meth:`end`)."""
        session = self.open_session("end_weight_update")
        if version != session.version:
            raise RuntimeError(f"end_weight_update({version!r}): the open update is for version {session.version}")
        return session

    def end(self, version: int) -> UpdateSession:
        session = self.ending(version)
        self.session = None
        return session
