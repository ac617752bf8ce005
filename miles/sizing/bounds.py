"""The ranges of every number the planner takes, and the one check that refuses a value outside them.

The upper bounds are far above any machine or model built today, and low enough that every figure, loop
and message of a plan stays small: a plan within them finishes in seconds, and a value outside them is
refused at once, in one line naming it and its range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_PARAMS = 10**15  # parameters of a model (a thousand times the largest trained today)
MAX_LAYERS = 10_000  # decoder layers (and pipeline stages, MTP layers)
MAX_HIDDEN = 10**6  # hidden size
MAX_WIDTH = 10**7  # other widths: vocabulary, FFN sizes, heads, head dims, latent ranks
MAX_EXPERTS = 10_000  # routed experts per layer
# Trained tensors of a model (two per routed expert and layer; GLM-5 has 40k): building, sharding and
# planning them takes ~10 us each, so a plan at the bound takes seconds.
MAX_TENSORS = 250_000
# Buckets planned over the ranks of one plan (one rank per pipeline stage, two stores each; GLM-5 on
# PP4 with the default device budget: 2560), ~20 us each.
MAX_BUCKETS = 100_000
MAX_PARALLEL = 10**6  # TP, DP, EP or ETP size
MAX_JSON_BYTES = 4 << 20  # a --config or --from-bench file


class PlanInputError(ValueError):
    """A value the planner cannot plan with; the message is one line naming it, its range and what to do."""


@dataclass(frozen=True)
class Bound:
    """Values from `low` to `high` (`low` itself excluded when `low_open`); `integer`: whole numbers only."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False
    unit: str = ""

    def holds(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return math.isfinite(value) and above and value <= self.high

    def describe(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.integer:
            return f"an integer from {self.low:g} to {self.high:g}{unit}"
        upper = f" and <= {self.high:g}" if math.isfinite(self.high) else ""
        return f"a number {'>' if self.low_open else '>='} {self.low:g}{upper}{unit}"


def shown(value, limit: int = 60) -> str:
    """A value as a message quotes it: on one line, and short whatever it holds."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown_path(path: str, limit: int = 200) -> str:
    """A path as a message quotes it: as is when printable and short, else on one line with its end (the
    file's name) kept."""
    if path.isprintable() and len(path) <= limit:
        return path
    return f"'...{repr(path[-limit:])[1:]}" if len(path) > limit else repr(path)


def check_bound(error: type[Exception], what: str, value, bound: Bound) -> None:
    """Raise `error` naming `what`, the value and the range, unless the bound holds it."""
    if not bound.holds(value):
        raise error(f"{what} {shown(value)}: must be {bound.describe()}")


def check_bounds(error: type[Exception], values: dict, bounds: dict[str, Bound], flag_prefix: str = "--") -> None:
    """check_bound for each field of `bounds` that `values` holds and is not None, named as a flag."""
    for name, bound in bounds.items():
        if values[name] is not None:
            check_bound(error, f"{flag_prefix}{name.replace('_', '-')}", values[name], bound)


PARAMS = Bound(1, MAX_PARAMS, integer=True, unit="parameters")
BUCKET_NUMEL = Bound(1, MAX_PARAMS, integer=True, unit="elements")
PARALLEL_SIZE = Bound(1, MAX_PARALLEL, integer=True)
PIPELINE_SIZE = Bound(1, MAX_LAYERS, integer=True)
STAGE_LAYERS = Bound(0, MAX_LAYERS, integer=True, unit="layers")
CHECKPOINT_COPIES = Bound(0, 100, integer=True)
TIMING = Bound(0, math.inf, low_open=True)  # bytes and seconds of a `miles bench stream` result

# Hardware fields; None (where the field allows it) means "not given".
HARDWARE = {
    "nodes": Bound(1, 10**5, integer=True),
    # Ranks that share a node's disk: `miles train`'s disk check plans all of a run's ranks as one node.
    "gpus_per_node": Bound(1, 10**5, integer=True),
    "hbm_gb": Bound(0, 10**5, low_open=True, unit="GB"),
    "host_ram_gb": Bound(0, 10**6, low_open=True, unit="GB"),
    "disk_read_gbps": Bound(0, 10**4, low_open=True, unit="GB/s"),
    "disk_write_gbps": Bound(0, 10**4, low_open=True, unit="GB/s"),
    "disk_combined_gbps": Bound(0, 10**4, low_open=True, unit="GB/s"),
    "disk_gb": Bound(0, 10**9, low_open=True, unit="GB"),
    "pcie_gbps": Bound(0, 10**4, low_open=True, unit="GB/s"),
    "host_tier_gb": Bound(0, 10**6, unit="GB"),
    "device_budget_mb": Bound(0, 10**9, low_open=True, unit="MB"),
    "reserve_gb": Bound(0, 10**5, unit="GB"),
}

# Fields of a model config; the *_OR_NONE ones take 0 for "the model has none".
HIDDEN = Bound(1, MAX_HIDDEN, integer=True)
LAYERS = Bound(1, MAX_LAYERS, integer=True)
WIDTH = Bound(1, MAX_WIDTH, integer=True)
WIDTH_OR_NONE = Bound(0, MAX_WIDTH, integer=True)
EXPERTS = Bound(0, MAX_EXPERTS, integer=True)
LAYER_COUNT_OR_NONE = Bound(0, MAX_LAYERS, integer=True)
