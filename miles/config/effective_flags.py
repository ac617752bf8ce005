"""Flags that would change nothing in the chosen configuration: rejected, naming what would make them count.

A flag counts as *given* when its parsed value differs from its parser default (the dataclass field's
default). Comparing values, not command-line tokens, keeps :func:`~miles.config.validation.validate_args`
a function of the namespace alone (a namespace built in code is judged like a parsed one); the price is
that repeating a default explicitly (``--stream-optimizer-state-moment-dtype fp32`` without streaming)
is accepted, which is harmless because it asks for exactly what the run does.

``--offload-train-disk-dir`` is deliberately not a rule: it says where the run may write (site launch
scripts set it once for every configuration), not how the run behaves.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from miles.config.arguments import CONFIG_GROUPS, flag_name

PARSER_DEFAULTS = {f.name: f.default for _, cls in CONFIG_GROUPS for f in dataclasses.fields(cls)}

_STREAM = "--stream-optimizer-state-to-disk"


def trainer_offload_on(a: argparse.Namespace) -> bool:
    """Trainer offload as validation resolves it: explicit --offload-train/--no-offload-train, else on under
    --colocate or with --offload-train-target=disk."""
    if a.offload_train is not None:
        return a.offload_train
    return bool(a.colocate or a.offload_train_target == "disk")


def _disk_offload_on(a: argparse.Namespace) -> bool:
    return trainer_offload_on(a) and a.offload_train_target == "disk"


def _offload_off(a: argparse.Namespace) -> tuple[str, str]:
    if a.offload_train is False:
        return "--no-offload-train turns trainer offload off", "drop --no-offload-train"
    return ("trainer offload is off (it is on under --colocate, with --offload-train or "
            "--offload-train-target=disk)"), "add --colocate or --offload-train"


@dataclass(frozen=True)
class EffectRule:
    """``field`` changes the run only when ``counts(args)``; otherwise ``why_not(args)`` gives (why it
    changes nothing, what would make it count)."""

    field: str
    counts: Callable[[argparse.Namespace], bool]
    why_not: Callable[[argparse.Namespace], tuple[str, str]]


_NEEDS_STREAMING = (f"{_STREAM} is off", f"add {_STREAM} --offload-train-target=disk")

RULES: tuple[EffectRule, ...] = (
    *(EffectRule(name, lambda a: a.stream_optimizer_state_to_disk, lambda a: _NEEDS_STREAMING)
      for name in ("stream_optimizer_state_moment_dtype", "stream_optimizer_state_bucket_numel",
                   "stream_optimizer_state_chunk_mb", "stream_optimizer_state_host_cache_mb",
                   "stream_optimizer_state_device_budget_mb",
                   "stream_optimizer_state_verify", "stream_optimizer_state_flush_at_sleep")),
    EffectRule("offload_train_disk_chunk_mb", _disk_offload_on,
               lambda a: ("trainer offload does not go to disk (the streamed state's chunk is "
                          "--stream-optimizer-state-chunk-mb)", "add --offload-train-target=disk")),
    EffectRule("offload_train_target", trainer_offload_on, _offload_off),
    *(EffectRule(name, lambda a: a.optimizer == "adam", lambda a: (f"--optimizer {a.optimizer} has no Adam terms",
                                                                   "use --optimizer adam"))
      for name in ("adam_beta1", "adam_beta2", "adam_eps")),
)


def _shown(value) -> str:
    return "" if isinstance(value, bool) else f" {value}"


def first_ineffective_flag(a: argparse.Namespace, has_tensorboard: bool) -> Optional[tuple[str, str, str]]:
    """``(flag, message, fix)`` for the first flag given that would change nothing, else None."""
    for rule in RULES:
        value = getattr(a, rule.field)
        if value != PARSER_DEFAULTS[rule.field] and not rule.counts(a):
            flag = flag_name(rule.field)
            why, fix = rule.why_not(a)
            return flag, f"{flag}{_shown(value)} has no effect: {why}.", f"{fix}, or drop {flag}."
    if a.tensorboard_dir and not has_tensorboard:
        return ("--tensorboard-dir", f"--tensorboard-dir {a.tensorboard_dir} has no effect: TensorBoard is not "
                "installed.", "pip install tensorboard, or drop --tensorboard-dir (metrics still go to "
                "--metrics-file).")
    return None
