"""Rollout engines, all behind one contract (:class:`miles.rollout.contract.RolloutEngine`).

    from miles.rollout import EmbeddedRolloutEngine, RolloutEngine, SamplingParams, Sample, remote_engine_class
    Engine = remote_engine_class(num_cpus=1)          # = ray.remote(num_cpus=1)(EmbeddedRolloutEngine)
    engine = Engine.remote(args, engine_id=0)
"""

from typing import Any

from miles.rollout.contract import RolloutEngine  # noqa: F401
from miles.rollout.types import Sample, SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:  # torch is imported only when the engine is used
    if name == "EmbeddedRolloutEngine":
        from miles.rollout.embedded import EmbeddedRolloutEngine

        return EmbeddedRolloutEngine
    raise AttributeError(name)


def remote_engine_class(**ray_options: Any):
    """``ray.remote(**ray_options)(EmbeddedRolloutEngine)`` (plain ``ray.remote`` without options)."""
    import ray

    from miles.rollout.embedded import EmbeddedRolloutEngine

    return ray.remote(**ray_options)(EmbeddedRolloutEngine) if ray_options else ray.remote(EmbeddedRolloutEngine)
