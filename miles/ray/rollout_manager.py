"""The rollout manager: the rollout engine actors behind the rollout-engine contract
(:class:`miles.rollout.contract.RolloutEngine`; the embedded torch engine implements it).

With several engines the prompts are split into contiguous slices, one per engine, and the samples
come back in prompt-major order (the ``n`` samples of prompt ``i`` at ``[i * n, (i + 1) * n)``), which
is what GRPO's group-contiguous advantages expect.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

from miles.config import RunConfig
from miles.logging_setup import configure_logging
from miles.progress import waiting

from . import actor_factory
from .actor_logs import ActorLogs, reports_logs
from .errors import close_then_kill, wait_all
from .train_actor import node_id

logger = logging.getLogger(__name__)


def build_engine(config: RunConfig, engine_id: int):
    """The engine ``--rollout-engine`` names: the embedded torch engine, or sglang
    (:class:`miles.rollout.sglang.engine.SglangRolloutEngine`, in-process or at ``--sglang-url``)."""
    backend = config.rollout.rollout_engine
    if backend == "embedded":
        from miles.rollout.embedded import EmbeddedRolloutEngine

        # No backup of released weights: the loop pushes every weight after resuming them (contract.py)
        return EmbeddedRolloutEngine(config, engine_id=engine_id, backup="none",
                                     record_routes=config.training.use_rollout_routing_replay)
    if backend == "sglang":
        from miles.rollout.sglang.engine import SglangRolloutEngine

        return SglangRolloutEngine.from_config(config, engine_id=engine_id)
    raise ValueError(f"--rollout-engine {backend!r}: the engines are embedded and sglang")


class RolloutEngineActor:
    """Ray actor around the engine ``--rollout-engine`` chooses (built inside the actor, :func:`build_engine`)."""

    def __init__(self, config: RunConfig, engine_id: int):
        configure_logging(config.logging.log_level)
        self.logs = ActorLogs(f"engine {engine_id}")
        import torch

        torch.set_num_threads(config.cluster.num_cpus_per_rank)
        self.engine_id = engine_id
        self.engine = build_engine(config, engine_id)

    @reports_logs
    def info(self) -> dict[str, Any]:
        return {"engine": self.engine_id, "pid": os.getpid(), "node_id": node_id(), "description": self.engine.get_description(),
                "device": str(self.engine.device), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "weight_payload": self.engine.weight_payload, "tp_size": self.engine.tp_size}

    # The rollout-engine contract (miles.rollout.contract.RolloutEngine), one Ray method each: the driver
    # calls the memory and session methods (their replies carry the engine's log lines), the train ranks
    # the two update methods, bucket by bucket (plain results: a train rank does not re-log lines).
    @reports_logs
    def generate(self, input_ids, sampling_params, return_logprob: bool = True) -> list:
        return self.engine.generate(input_ids, sampling_params, return_logprob)

    @reports_logs
    def release_memory_occupation(self, tags=None) -> dict:
        return self.engine.release_memory_occupation(tags)

    @reports_logs
    def resume_memory_occupation(self, tags=None) -> dict:
        return self.engine.resume_memory_occupation(tags)

    @reports_logs
    def begin_weight_update(self, version: int) -> None:
        self.engine.begin_weight_update(version)

    @reports_logs
    def end_weight_update(self, version: int) -> dict:
        return self.engine.end_weight_update(version)

    def update_weights_from_tensor(self, serialized_named_tensors, load_format="flattened_bucket",
                                   flush_cache: bool = False) -> dict:
        return self.engine.update_weights_from_tensor(serialized_named_tensors, load_format, flush_cache)

    @reports_logs
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend) -> None:
        self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name,
                                              backend)

    def update_weights_from_distributed(self, bucket_specs, group_name, src: int = 0) -> dict:
        return self.engine.update_weights_from_distributed(bucket_specs, group_name, src)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    @reports_logs
    def share_weights(self) -> list:
        return self.engine.share_weights()

    @reports_logs
    def close(self) -> bool:
        self.engine.close()
        return True


class RolloutManager:
    def __init__(self, config: RunConfig, pg, use_gpu: bool):
        self.config = config
        self.engines = actor_factory.make_rollout_engines(config, pg, use_gpu, RolloutEngineActor)
        # an engine that drives a server (--sglang-url) is named with it: waits and failures then say which server
        servers = config.rollout.sglang_url or [None] * len(self.engines)
        self.labels = [f"rollout engine {i}" + (f" (sglang server {url})" if url else "")
                       for i, url in enumerate(servers)]
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
        labels = [self.labels[i] for i in range(len(slices))]
        with waiting(f"generate on {', '.join(labels)}"):
            parts = wait_all(refs, "generate", labels)
        samples = []
        for (a, _), part in zip(slices, parts):
            for s in part:
                s.prompt_index += a
                s.index = len(samples)
                samples.append(s)
        return samples

    def share_weights(self, engine_ids: Sequence[int]) -> list[list]:
        """``engine_ids[r]``'s weights by reference, for train rank r to rebuild its own from at wake (each
        engine asked once); valid until that engine releases its weights."""
        distinct = list(dict.fromkeys(engine_ids))
        refs = [self.engines[i].share_weights.remote() for i in distinct]
        shared = dict(zip(distinct, wait_all(refs, "share_weights", [self.labels[i] for i in distinct])))
        return [shared[i] for i in engine_ids]

    def release_memory(self, tags=None) -> list[dict]:
        """``release_memory_occupation(tags)`` on every engine (None: weights and KV cache)."""
        out = self._all("release_memory_occupation", tags)
        self.released = True
        return out

    def resume_memory(self, tags=None) -> list[dict]:
        """``resume_memory_occupation(tags)`` on every engine (None: weights and KV cache)."""
        out = self._all("resume_memory_occupation", tags)
        self.released = False
        return out

    def begin_weight_update(self, version: int) -> None:
        self._all("begin_weight_update", version)

    def end_weight_update(self, version: int) -> list[dict]:
        return self._all("end_weight_update", version)

    def join_weight_group(self, spec: dict[str, Any], engine_ids, rank_offsets) -> list:
        """Refs of the given engines joining the weight-update group ``spec`` (the train source is rank 0),
        engine ``engine_ids[k]`` from rank ``rank_offsets[k]`` on; the caller waits for them together with the
        source's join (the rendezvous needs both sides)."""
        return [self.engines[i].init_weights_update_group.remote(spec["master_address"], spec["master_port"], offset,
                                                                 spec["world_size"], spec["group_name"],
                                                                 spec["backend"])
                for i, offset in zip(engine_ids, rank_offsets)]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        close_then_kill(self.engines, "close", timeout_s)
