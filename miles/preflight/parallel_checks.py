"""The parallel flags judged before Ray starts: Megatron's layout rules (miles/parallel/layout.py) on the
run's world size and the policy's sizes, what the backend builds, and the rollout batch over data parallelism.

A :class:`~miles.parallel.layout.LayoutError` becomes the one :class:`ArgumentError` of validation, naming the
flags, the values and the fix.
"""

from __future__ import annotations

import os
from typing import Any

from miles.config.errors import ArgumentError
from miles.config.run_config import RunConfig
from miles.preflight.environment import Environment
from miles.parallel.layout import (DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE, EP_FLAG, FIRST_STAGE_FLAG, LAST_STAGE_FLAG,
                                   PP_FLAG, SP_FLAG, TP_FLAG, ETP_FLAG, LayoutError, check_layout)

__all__ = ["check_parallel", "model_parallel_sizes", "EXPERIMENTAL_MODEL_PARALLEL_FLAG"]

EXPERIMENTAL_MODEL_PARALLEL_FLAG = "--experimental-model-parallel"


def model_parallel_sizes(d: RunConfig, env: Environment) -> dict[str, Any]:
    """The policy's sizes the layout rules read (None where unknown here: a size is then not checked): a
    checkpoint's as the megatron backend's family of it reads them, the tiny model's from its config."""
    unknown = dict(num_layers=None, num_attention_heads=None, num_query_groups=None, num_experts=None,
                   indexer_layers=None, linear_key_heads=None, linear_value_heads=None)
    if d.model_source == "tiny":
        from miles.models import TINY_MODEL_CONFIG as tiny

        return dict(unknown, num_layers=tiny["num_hidden_layers"], num_attention_heads=tiny["num_attention_heads"],
                    num_query_groups=tiny["num_key_value_heads"], num_experts=0)
    if d.model_source != "hf_checkpoint":
        return unknown
    from miles.backends.megatron_backend.families import layout_sizes, read_config

    config_path = os.path.join(d.model.hf_checkpoint, "config.json")
    try:
        return dict(unknown, **layout_sizes(read_config(env.read_json(config_path), config_path)))
    except (OSError, ValueError):  # the model checks report an unreadable or unbuildable config.json in their words
        return unknown


def _given_model_parallel_flags(d: RunConfig) -> list[tuple[str, str]]:
    """(the flag as given, why the torch backend cannot do it) for each model-parallel flag set."""
    t = d.training
    data_parallel_only = "is data parallel only"
    given = [(t.tensor_model_parallel_size > 1, f"{TP_FLAG} {t.tensor_model_parallel_size}", data_parallel_only),
             (t.pipeline_model_parallel_size > 1, f"{PP_FLAG} {t.pipeline_model_parallel_size}", data_parallel_only),
             (t.expert_model_parallel_size > 1, f"{EP_FLAG} {t.expert_model_parallel_size}",
              "replicates every expert on every rank"),
             (t.sequence_parallel, SP_FLAG, data_parallel_only),
             (t.expert_tensor_parallel_size != DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE,
              f"{ETP_FLAG} {t.expert_tensor_parallel_size}", data_parallel_only),
             (t.decoder_first_pipeline_num_layers is not None,
              f"{FIRST_STAGE_FLAG} {t.decoder_first_pipeline_num_layers}", data_parallel_only),
             (t.decoder_last_pipeline_num_layers is not None,
              f"{LAST_STAGE_FLAG} {t.decoder_last_pipeline_num_layers}", data_parallel_only)]
    return [(flag, why) for on, flag, why in given if on]


def _check_backend_has_model_parallelism(d: RunConfig) -> None:
    """Model-parallel flags on the torch backend: the first fault, since no layout of them can train there."""
    given = _given_model_parallel_flags(d)
    backend = d.training.train_backend
    if given and backend != "megatron":
        shown, why = given[0]
        flag = shown.split()[0]
        raise ArgumentError(f"{shown} needs --train-backend megatron: the {backend} backend {why}.",
                            (flag, "--train-backend"), f"add --train-backend megatron, or drop {flag}.")


def _check_megatron_builds(d: RunConfig) -> None:
    layout = d.parallel_layout
    if layout.tp % layout.etp:
        raise ArgumentError(
            f"{ETP_FLAG} {layout.etp} does not divide {TP_FLAG} {layout.tp}: the megatron backend gathers an "
            "expert's tensor-parallel pieces within a TP group for the weight handoff and checkpoints.",
            (ETP_FLAG, TP_FLAG), f"pass an {ETP_FLAG} that divides {layout.tp} (1 always does).")
    if layout.tp * layout.pp > 1 and not d.cluster.dry_run and not d.training.experimental_model_parallel:
        raise ArgumentError(
            f"{TP_FLAG} {layout.tp} x {PP_FLAG} {layout.pp}: the megatron trainer builds TP/PP > 1 models, checked "
            "with their ranks sharing one GPU, but this version has not run them across GPUs.", (TP_FLAG, PP_FLAG),
            f"add {EXPERIMENTAL_MODEL_PARALLEL_FLAG} to train with this layout anyway (scripts/validate_parallel.sh "
            "checks it on a host with 2+ GPUs first), pass --dry-run to check the layout on this machine, or train "
            "with TP = PP = 1.")


def _check_batch_split(d: RunConfig) -> None:
    dp, rollout, world = d.parallel_layout.dp, d.rollout, d.cluster.num_train_ranks
    total = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if total % dp:
        over, multiple = ((f"--num-train-ranks {world}", "num-train-ranks") if dp == world else
                          (f"the data-parallel size {dp} (--num-train-ranks {world} / (TP x PP))", str(dp)))
        raise ArgumentError(
            f"--rollout-batch-size x --n-samples-per-prompt = {total} samples do not split evenly over {over}.",
            ("--rollout-batch-size", "--n-samples-per-prompt", "--num-train-ranks"),
            f"make rollout-batch-size * n-samples-per-prompt a multiple of {multiple}.")


def check_parallel(d: RunConfig, env: Environment) -> None:
    """The backend (first: it decides whether the other rules apply), the layout on the run's world (and the
    policy's sizes where known), what the megatron backend builds, the batch split."""
    _check_backend_has_model_parallelism(d)
    sizes = model_parallel_sizes(d, env) if d.training.train_backend == "megatron" else {}
    try:
        check_layout(d.parallel_layout, sequence_parallel=d.training.sequence_parallel, **sizes)
    except LayoutError as e:
        raise ArgumentError(e.problem, e.flags, e.fix) from None
    if d.training.train_backend == "megatron":
        _check_megatron_builds(d)
    _check_batch_split(d)


def layout_summary(cfg: RunConfig, env: Environment) -> str:
    """What ``miles train --dry-run`` prints: the layout, each stage's decoder layers (when the policy's layer
    count is known here) and the first ranks' coordinates in Megatron's order."""
    from miles.parallel.layout import rank_coordinates, stage_layers

    layout = cfg.parallel_layout
    lines = [f"parallel layout: {cfg.cluster.num_train_ranks} train ranks = {layout.describe()}"
             + (", sequence parallel" if cfg.training.sequence_parallel else "")]
    num_layers = model_parallel_sizes(cfg, env)["num_layers"]
    if num_layers is not None:
        for stage, layers in enumerate(stage_layers(num_layers, layout)):
            lines.append(f"  stage {stage}: decoder layers {layers.start}-{layers.stop - 1} ({len(layers)})")
    shown = rank_coordinates(layout)[:_RANKS_SHOWN]
    lines += [f"  rank {c.rank}: tp {c.tp} pp {c.pp} dp {c.dp} | ep {c.ep} etp {c.etp} edp {c.edp}" for c in shown]
    if layout.world > _RANKS_SHOWN:
        lines.append(f"  ... ({layout.world} ranks; rank = tp + TP x (dp + DP x pp))")
    return "\n".join(lines)


_RANKS_SHOWN = 16
