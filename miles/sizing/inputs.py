"""What a plan takes: the hardware, the training settings and the error of inputs that do not describe a run.

Light (no torch): `miles plan` builds its parser from these defaults and refuses bad arguments before it
imports the estimate's machinery (the store's codecs need torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from miles_plugins.optimizers.streaming.config import MOMENT_DTYPES
from miles_plugins.optimizers.streaming.units import MiB

from .bounds import BUCKET_NUMEL, CHECKPOINT_COPIES, HARDWARE, PlanInputError, check_bounds

GB = 1e9
WEIGHT_BYTES = {"fp32": 4, "bf16": 2}  # the model's weights: bf16 (Megatron); fp32 for the torch backend on CPU
GRAD_BYTES = {"fp32": 4, "bf16": 2}  # Megatron DDP accumulates grads in fp32 unless told to use bf16
DEFAULT_RESERVE_FRACTION = 0.10  # of HBM, for activations, CUDA context, NCCL and allocator slack


def short_decimal(value: float) -> str:
    """A speed or hardware size as the plan prints it: two decimals (three significant digits below 1),
    trailing zeros dropped: 1.4310890165543473 -> 1.43, 2.10 -> 2.1, 50.0 -> 50, 0.123456 -> 0.123."""
    decimals = 2 if value == 0 or abs(value) >= 1 else 2 - math.floor(math.log10(abs(value)))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


class SizingError(PlanInputError):
    """Inputs that do not describe a run; the message names the values and what to change."""


@dataclass(frozen=True)
class Hardware:
    """Per-node resources. Defaults: one node of 8 H200s (141 GB HBM, 2 TB RAM) whose disk moves what the H200
    test host's disk measured in `miles bench stream` (docs/benchmarks.md): measure yours (--from-bench)."""

    nodes: int = 1
    gpus_per_node: int = 8
    hbm_gb: float = 141.0
    host_ram_gb: float = 2000.0
    disk_read_gbps: float = 1.9  # O_DIRECT, reading alone (bench: 18 GB in 9.53 s)
    disk_write_gbps: float = 2.6  # O_DIRECT, writing alone (bench: 18 GB in 6.93 s)
    disk_combined_gbps: Optional[float] = None  # reading and writing at once (bench: 36 GB in 17.17 s = 2.1)
    disk_gb: Optional[float] = None  # node-local disk capacity, when it should be checked
    pcie_gbps: float = 50.0  # pinned host <-> GPU, each direction (measured 51-55 GB/s)
    host_tier_gb: float = 0.0  # host RAM per rank holding hot buckets (--stream-optimizer-state-host-cache-mb)
    # the stores' device budget, MiB (--stream-optimizer-state-device-budget-mb); None: the store's default,
    # one DEFAULT_BUCKET_NUMEL bucket in flight
    device_budget_mb: Optional[float] = None
    reserve_gb: Optional[float] = None  # HBM kept for activations etc.; None: DEFAULT_RESERVE_FRACTION of HBM

    def __post_init__(self) -> None:
        check_bounds(SizingError, vars(self), HARDWARE)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def reserve_bytes(self) -> float:
        return (self.reserve_gb if self.reserve_gb is not None else DEFAULT_RESERVE_FRACTION * self.hbm_gb) * GB

    @property
    def device_budget_bytes(self) -> Optional[int]:
        return None if self.device_budget_mb is None else int(self.device_budget_mb * MiB)


@dataclass(frozen=True)
class Training:
    moment_dtype: str = "fp32"
    # elements per bucket, used as given (--stream-optimizer-state-bucket-numel); None: the store fits it to its
    # device budget, at most DEFAULT_BUCKET_NUMEL
    bucket_numel: Optional[int] = None
    grad_dtype: str = "fp32"
    weight_dtype: str = "bf16"
    # The trainer's weights go to the disk while the rollout runs (its grads are dropped, not backed up)
    offload_train_to_disk: bool = True
    # False: the Adam state stays in memory (and goes to the disk with the trainer when it offloads there)
    stream_optimizer_state: bool = True
    checkpoint_copies: int = 1  # saved copies of the streamed state kept on the node-local disk

    def __post_init__(self) -> None:
        if self.moment_dtype not in MOMENT_DTYPES:
            raise SizingError(f"--moment-dtype {self.moment_dtype!r}: choose one of {', '.join(MOMENT_DTYPES)}")
        if self.grad_dtype not in GRAD_BYTES:
            raise SizingError(f"--grad-dtype {self.grad_dtype!r}: choose one of {', '.join(GRAD_BYTES)}")
        if self.weight_dtype not in WEIGHT_BYTES:
            raise SizingError(f"weight dtype {self.weight_dtype!r}: choose one of {', '.join(WEIGHT_BYTES)}")
        check_bounds(SizingError, vars(self), {"bucket_numel": BUCKET_NUMEL, "checkpoint_copies": CHECKPOINT_COPIES})
