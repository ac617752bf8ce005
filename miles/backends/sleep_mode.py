"""How a train rank sleeps, decided once from the run's config; everyone else asks :func:`sleep_mode`.

    OFF           --offload-train is off: sleep and wake report themselves skipped
    AUTO          the sleep plan (--offload-train-plan auto): each tensor group by its cheapest exact way back,
                  measured at every sleep (miles.backends.planned_sleep; no process hook)
    OFFLOAD_ALL   --offload-train-plan offload-all: every weight and resident optimizer tensor to the target
                  (torch_memory_saver's process-wide pause on GPU, so the actor is launched with its hook)

Kept free of torch: the driver asks it when it launches the train actors (miles.ray.actor_factory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.config.arguments import OFFLOAD_TRAIN_PLANS

if TYPE_CHECKING:
    from miles.config import RunConfig

OFF = "off"
AUTO, OFFLOAD_ALL = OFFLOAD_TRAIN_PLANS


def sleep_mode(config: "RunConfig") -> str:
    """:data:`OFF`, :data:`AUTO` or :data:`OFFLOAD_ALL` for this run's train ranks."""
    if not config.offload.offload_train:
        return OFF
    return OFFLOAD_ALL if config.offload.offload_all else AUTO
