"""A ``--hf-checkpoint`` folder judged before anything allocates the model: its config.json (read bounded; the
sizes and each family's rules: :func:`miles.models.check_hf_config`), a ``model_type`` the chosen backend builds
(the megatron backend's: read by its family as the trainer reads it),
the kernels a Gated DeltaNet model needs on GPUs, the tokenizer files (:func:`miles.models.check_tokenizer_files`)
and the weights' dtypes and vocabulary rows (:func:`miles.models.check_weights`). Each problem is one :class:`ArgumentError`
naming the file, the value and the fix.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any

from miles.config.errors import ArgumentError
from miles.config.run_config import RunConfig
from miles.preflight.environment import Environment

__all__ = ["check_model_folder", "LINEAR_ATTENTION_INSTALL"]

logger = logging.getLogger(__name__)

# flash-linear-attention: the Gated DeltaNet's Triton kernels (megatron-core imports them; transformers falls back
# to a slow torch loop without them). The versions docs/dev/validation/megatron-architectures.md ran.
LINEAR_ATTENTION_INSTALL = ("pip install flash-linear-attention==0.6.0 fla-core==0.6.0 (the extra: pip install "
                            "'miles[fla]')")
_SHOWN_MODEL_TYPES = 8


def check_model_folder(d: RunConfig, env: Environment) -> None:
    """config.json, the model type, the GPU kernels, the tokenizer files and the weights of the draft's
    ``--hf-checkpoint`` folder."""
    from miles.models import (ModelFolderError, check_hf_config, check_tokenizer_files, check_weights,
                              config_vocab_size)

    folder, backend = d.model.hf_checkpoint, d.training.train_backend
    config_path = os.path.join(folder, "config.json")
    try:
        config = env.read_json(config_path)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]  # one line, short: the file is untrusted
        raise ArgumentError(f"--hf-checkpoint {config_path} cannot be read as JSON: {reason}.",
                            ("--hf-checkpoint",), "pass a folder whose config.json is the model's transformers "
                            "config (a JSON object).") from None
    try:
        check_hf_config(config)
    except ModelFolderError as e:
        raise ArgumentError(f"--hf-checkpoint {config_path}: {e.problem}.", ("--hf-checkpoint",), f"{e.fix}.") from None
    _check_model_type(config_path, config["model_type"], backend)
    if backend == "megatron":
        _check_megatron_reads(config_path, config)
    _check_linear_attention_kernels(config, backend, d.cluster.dry_run, env)
    try:
        check_tokenizer_files(folder, env.is_file, env.has_module)
        check_weights(folder, env.is_file, config_vocab_size(config))
    except ModelFolderError as e:
        raise ArgumentError(f"--hf-checkpoint {e.problem}.", ("--hf-checkpoint",), f"{e.fix}.") from None


def _check_model_type(config_path: str, model_type: str, backend: str) -> None:
    """The megatron backend builds the families of its registry (its ``families`` package); the torch backend
    any causal LM transformers builds (its AutoModelForCausalLM table)."""
    if backend == "megatron":
        from miles.backends.megatron_backend.families import SUPPORTED_MODEL_TYPES

        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ArgumentError(f"--hf-checkpoint {config_path}: model_type {model_type[:80]!r} is not built by "
                                f"--train-backend megatron, which builds {', '.join(SUPPORTED_MODEL_TYPES)}.",
                                ("--hf-checkpoint", "--train-backend"), "pass a model of those families, or use "
                                "--train-backend torch (it trains any causal LM transformers builds).")
        return
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = tuple(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=_SHOWN_MODEL_TYPES) or known[:_SHOWN_MODEL_TYPES]
        raise ArgumentError(f"--hf-checkpoint {config_path}: model_type {model_type[:80]!r} is not a causal LM "
                            f"transformers {transformers.__version__} builds (it builds {len(known)} model types, "
                            f"among them {', '.join(close)}, ...).", ("--hf-checkpoint",),
                            "pass the folder of a model transformers supports (its config.json's model_type), or "
                            "upgrade transformers if the model is newer than it.")


def _check_megatron_reads(config_path: str, config: dict[str, Any]) -> None:
    """The config read as the trainer will read it (its family's reading): what the backend cannot build
    exactly is refused now, in the trainer's words, instead of on every rank after Ray started."""
    from miles.backends.megatron_backend.families import UnsupportedModelError, read_config
    from miles.sizing.tensors import ModelConfigError

    try:
        read_config(config, config_path)
    except UnsupportedModelError as e:
        raise ArgumentError(f"--hf-checkpoint {config_path}: {e}.", ("--hf-checkpoint", "--train-backend"),
                            "change that field if the model really has that value, or use --train-backend torch "
                            "(it trains what transformers builds).") from None
    except ModelConfigError as e:
        raise ArgumentError(f"--hf-checkpoint {e}.", ("--hf-checkpoint",), "pass a folder whose config.json is the "
                            "model's own transformers config.") from None


def _check_linear_attention_kernels(config: dict[str, Any], backend: str, dry_run: bool, env: Environment) -> None:
    """Qwen3.5-MoE's Gated DeltaNet layers on GPUs: megatron-core's need flash-linear-attention (module ``fla``;
    a dry run, which starts no backend, only says so), transformers' run a slow torch loop without it."""
    from miles.backends.megatron_backend.families import LINEAR_ATTENTION_MODEL_TYPES

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    model_type = (config["model_type"] if config["model_type"] in LINEAR_ATTENTION_MODEL_TYPES
                  else text.get("model_type"))
    if model_type not in LINEAR_ATTENTION_MODEL_TYPES or not env.cuda_available() or env.has_module("fla"):
        return
    if backend == "megatron" and not dry_run:
        raise ArgumentError(f"--hf-checkpoint is a {model_type} model, whose Gated DeltaNet layers megatron-core "
                            "builds with flash-linear-attention's kernels, and the fla module is not installed.",
                            ("--hf-checkpoint", "--train-backend"), f"{LINEAR_ATTENTION_INSTALL}.")
    without = ("--train-backend megatron cannot build its Gated DeltaNet layers" if backend == "megatron" else
               "transformers runs its Gated DeltaNet layers as a slow torch loop on the GPU")
    logger.warning("--hf-checkpoint is a %s model and flash-linear-attention (module fla) is not installed: %s; %s",
                   model_type, without, LINEAR_ATTENTION_INSTALL)
