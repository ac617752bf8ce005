"""The rollout manager: the rollout engine actors (the embedded torch engine) behind one interface.

With several engines the prompts are split into contiguous slices, one per engine, and the samples
come back in prompt-major order (the ``n`` samples of prompt ``i`` at ``[i * n, (i + 1) * n)``), which
is what GRPO's group-contiguous advantages expect.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

from miles.config import RunConfig
from miles.logging_setup import configure_logging

from . import actor_factory
from .errors import close_then_kill, wait_all
from .train_actor import node_id

logger = logging.getLogger(__name__)


class RolloutEngineActor:
    """Ray actor around :class:`miles.rollout.embedded.EmbeddedRolloutEngine` (built inside the actor)."""

    def __init__(self, config: RunConfig, engine_id: int):
        configure_logging(config.logging.log_level)
        import torch

        torch.set_num_threads(config.cluster.num_cpus_per_rank)
        self.engine_id = engine_id
        backend = config.rollout.rollout_engine
        if backend != "embedded":
            raise NotImplementedError(f"--rollout-engine {backend} is not available in this build; "
                                      "use --rollout-engine embedded")
        from miles.rollout.embedded import EmbeddedRolloutEngine

        self.engine = EmbeddedRolloutEngine(config, engine_id=engine_id)

    def info(self) -> dict[str, Any]:
        return {"engine": self.engine_id, "pid": os.getpid(), "node_id": node_id(), "description": self.engine.get_description(),
                "device": str(self.engine.device)}

    def generate(self, prompts, sampling) -> list:
        return self.engine.generate(prompts, sampling)

    def release_memory(self) -> dict:
        return self.engine.release_memory()

    def resume_memory(self) -> dict:
        return self.engine.resume_memory()

    def update_weights(self, weights, version: Optional[int] = None) -> int:
        return self.engine.update_weights(weights, version)

    def close(self) -> bool:
        self.engine.close()
        return True


class RolloutManager:
    def __init__(self, config: RunConfig, pg, use_gpu: bool):
        self.config = config
        self.engines = actor_factory.make_rollout_engines(config, pg, use_gpu, RolloutEngineActor)
        self.labels = [f"rollout engine {i}" for i in range(len(self.engines))]
        self.released = False

    def _all(self, method: str, *args) -> list[Any]:
        refs = [getattr(e, method).remote(*args) for e in self.engines]
        return wait_all(refs, method, self.labels)

    def init(self) -> list[dict[str, Any]]:
        return self._all("info")

    def generate(self, prompts: Sequence, sampling) -> list:
        """Samples of all prompts, prompt-major; ``prompt_index`` / ``index`` refer to the full list."""
        n_eng = len(self.engines)
        per = -(-len(prompts) // n_eng)
        slices = [(i * per, min(len(prompts), (i + 1) * per)) for i in range(n_eng)]
        slices = [(a, b) for a, b in slices if a < b]
        refs = [self.engines[i].generate.remote(list(prompts[a:b]), sampling) for i, (a, b) in enumerate(slices)]
        parts = wait_all(refs, "generate", [self.labels[i] for i in range(len(slices))])
        samples = []
        for (a, _), part in zip(slices, parts):
            for s in part:
                s.prompt_index += a
                s.index = len(samples)
                samples.append(s)
        return samples

    def release_memory(self) -> list[dict]:
        out = self._all("release_memory")
        self.released = True
        return out

    def resume_memory(self) -> list[dict]:
        out = self._all("resume_memory")
        self.released = False
        return out

    def update_weights(self, weights_ref, version: Optional[int] = None) -> list[int]:
        return wait_all([e.update_weights.remote(weights_ref, version) for e in self.engines], "update_weights",
                        self.labels)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        close_then_kill(self.engines, "close", timeout_s)
