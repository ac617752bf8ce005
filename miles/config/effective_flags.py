"""Flags that would change nothing in the chosen configuration: rejected, naming what would make them count.

A flag counts as *given* when its parsed value differs from its parser default (the dataclass field's
default). Comparing values, not command-line tokens, keeps :func:`~miles.preflight.validation.validate_args`
a function of the namespace alone (a namespace built in code is judged like a parsed one); the price is
that repeating a default explicitly (``--stream-optimizer-state-moment-dtype fp32`` without streaming)
is accepted, which is harmless because it asks for exactly what the run does.

``--offload-train-disk-dir`` is deliberately not a rule: it says where the run may write (site launch
scripts set it once for every configuration), not how the run behaves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from miles.config.arguments import CONFIG_GROUPS, STREAM_FLAG, flag_name
from miles.config.run_config import STORE_FIELD_FLAGS, RunConfig, field_value

PARSER_DEFAULTS = {f.name: f.default for _, cls in CONFIG_GROUPS for f in dataclasses.fields(cls)}


def is_given(d: RunConfig, name: str) -> bool:
    """Field ``name`` differs from its parser default (the module doc: what "given" means)."""
    return field_value(d, name) != PARSER_DEFAULTS[name]


def _offload_off(d: RunConfig) -> tuple[str, str]:
    if d.offload.offload_train is False:
        return "--no-offload-train turns trainer offload off", "drop --no-offload-train"
    return ("trainer offload is off (it is on under --colocate, with --offload-train or "
            "--offload-train-target=disk)"), "add --colocate or --offload-train"


@dataclass(frozen=True)
class EffectRule:
    """``field`` changes the run only when ``counts(draft)``; otherwise ``why_not(draft)`` gives (why it
    changes nothing, what would make it count). ``draft``: the RunConfig validation checks (tri-states
    unresolved)."""

    field: str
    counts: Callable[[RunConfig], bool]
    why_not: Callable[[RunConfig], tuple[str, str]]


_NEEDS_STREAMING = (f"{STREAM_FLAG} is off", f"add {STREAM_FLAG} --offload-train-target=disk")

RULES: tuple[EffectRule, ...] = (
    *(EffectRule(name, lambda d: d.optimizer.stream_optimizer_state_to_disk, lambda d: _NEEDS_STREAMING)
      for name in (*STORE_FIELD_FLAGS.values(), "stream_optimizer_state_flush_at_sleep")),
    EffectRule("offload_train_disk_chunk_mb", lambda d: d.trainer_offload_to_disk,
               lambda d: ("trainer offload does not go to disk (the streamed state's chunk is "
                          "--stream-optimizer-state-chunk-mb)", "add --offload-train-target=disk")),
    EffectRule("offload_train_target", lambda d: d.trainer_offload, _offload_off),
    EffectRule("offload_train_plan", lambda d: d.trainer_offload, _offload_off),
    EffectRule("experimental_model_parallel",
               lambda d: d.training.tensor_model_parallel_size * d.training.pipeline_model_parallel_size > 1,
               lambda d: ("tensor and pipeline parallel sizes are 1",
                          "add --tensor-model-parallel-size or --pipeline-model-parallel-size > 1")),
    *(EffectRule(name, lambda d: d.training.use_tis,
                 lambda d: ("importance weights are truncated only under --use-tis", "add --use-tis"))
      for name in ("tis_clip", "tis_clip_low")),
    EffectRule("moe_grouped_gemm", lambda d: d.training.train_backend == "megatron",
               lambda d: (f"--train-backend {d.training.train_backend} builds its experts with transformers' own "
                          "modules", "add --train-backend megatron")),
    EffectRule("max_tokens_per_gpu", lambda d: d.training.use_dynamic_batch_size,
               lambda d: ("micro-batches hold --micro-batch-size samples unless --use-dynamic-batch-size",
                          "add --use-dynamic-batch-size")),
    EffectRule("micro_batch_size", lambda d: not d.training.use_dynamic_batch_size,
               lambda d: ("--use-dynamic-batch-size fills micro-batches up to --max-tokens-per-gpu tokens",
                          "drop --use-dynamic-batch-size")),
    *(EffectRule(name, lambda d: d.optimizer.optimizer == "adam",
                 lambda d: (f"--optimizer {d.optimizer.optimizer} has no Adam terms", "use --optimizer adam"))
      for name in ("adam_beta1", "adam_beta2", "adam_eps")),
)


def _shown(value) -> str:
    return "" if isinstance(value, bool) else f" {value}"


def first_ineffective_flag(d: RunConfig, has_tensorboard: bool) -> Optional[tuple[str, str, str]]:
    """``(flag, message, fix)`` for the first flag given in the draft ``d`` that would change nothing, else None."""
    for rule in RULES:
        if is_given(d, rule.field) and not rule.counts(d):
            flag = flag_name(rule.field)
            why, fix = rule.why_not(d)
            return flag, f"{flag}{_shown(field_value(d, rule.field))} has no effect: {why}.", f"{fix}, or drop {flag}."
    tensorboard_dir = d.logging.tensorboard_dir
    if tensorboard_dir and not has_tensorboard:
        return ("--tensorboard-dir", f"--tensorboard-dir {tensorboard_dir} has no effect: TensorBoard is not "
                "installed.", "pip install tensorboard, or drop --tensorboard-dir (metrics still go to "
                "--metrics-file).")
    return None
