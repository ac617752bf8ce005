"""Validation of ``miles train`` arguments.

:func:`validate_args` is a pure function of the parsed namespace and an :class:`Environment`
(Python version, CUDA, importable packages, files on disk; a ``--prompt-data`` file is parsed here so
that a malformed line is reported before any actor starts). It returns ONE frozen
:class:`~miles.config.run_config.RunConfig` with every tri-state and environment-dependent default
resolved, or raises exactly one :class:`ArgumentError` naming the conflicting flags and the fix. It
starts nothing and creates nothing (writability is probed with an anonymous temporary file).

Besides flag combinations (the rules here) it rejects, before any actor starts (the disk and machine
checks live in :mod:`miles.config.resource_checks`, the probes in :mod:`miles.config.environment`):

- a ``--hf-checkpoint`` folder whose config.json (read bounded) is not a JSON object with a ``model_type`` and
  the model's sizes as integers in range, or that has no tokenizer files (:func:`miles.models.check_hf_config`,
  :func:`miles.models.check_tokenizer_files`): transformers would otherwise allocate its default sizes;
- a flag that would change nothing in the chosen configuration, naming what would make it count
  (:mod:`miles.config.effective_flags`; "given" means "differs from the parser default");
- a directory the run writes (``--offload-train-disk-dir`` when something writes there, ``--save``,
  the metrics file's folder, ``--tensorboard-dir``) that is a file, sits under a file, is not writable,
  or whose parent does not exist (the run creates the directory a flag names, never its parents; the
  defaults it picks may lack parents);
- a root that is ``/``, a system directory (``/proc``, ``/etc``, ``/usr``, ``/var`` but ``/var/tmp``, ...)
  or the home directory itself: the run creates its folders there and removes them at its end;
- a ``--save``, ``--load``, ``--metrics-file`` or ``--tensorboard-dir`` inside a directory the run creates
  and removes (``trainer/``, ``optimizer_state/``, ``rollout/`` under the root, and the root itself when
  it does not exist yet): it would be deleted with them;
- a filesystem with less free space than the run will write there, computed from the model size
  (:mod:`miles.config.disk_budget`: streamed state, trainer offload, and the
  checkpoint copy when ``--save`` is on the same filesystem). When the run joins an existing cluster
  (``RAY_ADDRESS``), the root's filesystem is the driver's node's disk only: it must hold what the ranks
  that can land on that node write; every node's disk is checked once Ray has placed the ranks
  (:mod:`miles.ray.node_disk`);
- what this machine cannot hold: a placement group needing more CPUs (``--num-cpus-per-rank`` per train rank,
  and per rollout engine unless ``--colocate``) than the machine has, when the run starts its own Ray (no
  ``RAY_ADDRESS``, no Ray already running in this process); colocated engines beyond the train ranks; and a
  ``--stream-optimizer-state-host-cache-mb`` that the train ranks on this machine together could not hold in
  its available memory (the ranks that can land here, when joining a cluster).

Resolved values (``None`` after parsing -> concrete in the config):

- ``offload.offload_train``: True under ``--colocate`` or with ``--offload-train-target=disk``, else False.
- ``offload.offload_train_target``: ``"cpu"``.
- ``model.model_dtype``: ``"fp32"`` without CUDA, ``"bf16"`` with CUDA.
- ``optimizer.lr``: 5e-5 for a pretrained model, 1e-2 for the tiny random model.
- ``offload.offload_train_disk_dir``: absolute; default ``$SCRATCH`` (or the system temp dir)
  ``/miles-run-<YYYYmmdd-HHMMSS>-<pid>`` (:func:`miles.config.paths.default_root`).
- ``logging.metrics_file``: absolute; default ``<run dir>/metrics.jsonl``.

Derived: ``model_source`` (``"hf_checkpoint"`` | ``"smollm2"`` | ``"tiny"``), ``paths``
(:class:`~miles.config.paths.RunPaths`: the disk root, whether the run chose it, the run dir) and
``ray_address`` (``RAY_ADDRESS``, or None when the run starts its own Ray).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from miles.config.arguments import CONFIG_GROUPS
from miles.config.effective_flags import PARSER_DEFAULTS, first_ineffective_flag
from miles.config.environment import Environment
from miles.config.errors import ArgumentError
from miles.config.paths import RunPaths, default_root, new_run_id
from miles.config.resource_checks import (check_disk, check_fits_this_machine, check_outputs_outside_scratch,
                                          check_root_is_the_runs_own)
from miles.config.run_config import RunConfig
from miles_plugins.optimizers.streaming.config import StreamConfig
from miles_plugins.optimizers.streaming.errors import StoreConfigError

# ArgumentError and Environment are re-exported: validate_args raises the one and takes the other
__all__ = ["ArgumentError", "Environment", "validate_args", "DEFAULT_LR_PRETRAINED", "DEFAULT_LR_TINY"]

DEFAULT_LR_PRETRAINED = 5e-5
DEFAULT_LR_TINY = 1e-2

_STREAM = "--stream-optimizer-state-to-disk"


# ------------------------------------------------------------------------------------------ rules


def _check_ranges(a: argparse.Namespace) -> None:
    def at_least(name: str, lo: float) -> None:
        v = getattr(a, name)
        if v is not None and v < lo:
            flag = "--" + name.replace("_", "-")
            raise ArgumentError(f"{flag} must be >= {lo:g} (got {v}).", (flag,), f"pass {flag} >= {lo:g}.")

    def positive(name: str) -> None:
        v = getattr(a, name)
        if v is not None and not v > 0:
            flag = "--" + name.replace("_", "-")
            raise ArgumentError(f"{flag} must be > 0 (got {v}).", (flag,), f"pass a positive {flag}.")

    for n in ("num_train_ranks", "num_rollout_engines", "num_cpus_per_rank", "num_rollout",
              "rollout_batch_size", "rollout_max_response_len", "micro_batch_size",
              "offload_train_disk_chunk_mb", "save_interval", "save_keep_latest", "weight_sync_bucket_mb",
              "max_consecutive_skipped_steps"):
        at_least(n, 1)
    if a.n_samples_per_prompt < 2:
        raise ArgumentError(
            f"--n-samples-per-prompt must be >= 2 (got {a.n_samples_per_prompt}): GRPO normalizes rewards "
            "within the group of samples of one prompt.",
            ("--n-samples-per-prompt",), "pass --n-samples-per-prompt 2 or more.",
        )
    for n in ("rollout_temperature", "lr", "adam_eps"):
        positive(n)
    for n in ("weight_decay", "clip_grad", "eps_clip"):
        at_least(n, 0)
    if not 0 < a.rollout_top_p <= 1:
        raise ArgumentError(f"--rollout-top-p must be in (0, 1] (got {a.rollout_top_p}).", ("--rollout-top-p",),
                            "pass a value in (0, 1].")
    for n in ("adam_beta1", "adam_beta2"):
        v = getattr(a, n)
        if not 0 <= v < 1:
            flag = "--" + n.replace("_", "-")
            raise ArgumentError(f"{flag} must be in [0, 1) (got {v}).", (flag,), "pass a value in [0, 1).")
    total = a.rollout_batch_size * a.n_samples_per_prompt
    if total % a.num_train_ranks:
        raise ArgumentError(
            f"--rollout-batch-size x --n-samples-per-prompt = {total} samples do not split evenly over "
            f"--num-train-ranks {a.num_train_ranks}.",
            ("--rollout-batch-size", "--n-samples-per-prompt", "--num-train-ranks"),
            "make rollout-batch-size * n-samples-per-prompt a multiple of num-train-ranks.",
        )


_STREAM_REJECTS = (
    ("reset_optimizer_states", "--reset-optimizer-states",
     "the streamed state lives in bucket files and is not reset in memory"),
    ("save_local_weight_checksum", "--save-local-weight-checksum",
     "local weight checksums are not supported with the streamed state"),
    ("enable_witness", "--enable-witness", "the witness needs the optimizer state in memory"),
    ("fp8_param", "--fp8-param", "streaming publishes fp32 mains into bf16/fp16/fp32 params, not fp8"),
    ("use_precision_aware_optimizer", "--use-precision-aware-optimizer",
     "the precision-aware optimizer keeps its own state layout"),
    ("optimizer_cpu_offload", "--optimizer-cpu-offload",
     "optimizer CPU offload and disk streaming both own the optimizer state"),
)


# Flags that exist so streaming can reject them by name (DESIGN section 4); no backend here implements them.
_NOT_IMPLEMENTED = (("reset_optimizer_states", "--reset-optimizer-states"),
                    ("save_local_weight_checksum", "--save-local-weight-checksum"),
                    ("enable_witness", "--enable-witness"))


# The --stream-optimizer-state-* flags that are StreamConfig fields: the store's own rules check them.
_STORE_FIELD_FLAGS = {"chunk_mb": "stream_optimizer_state_chunk_mb",
                      "moment_dtype": "stream_optimizer_state_moment_dtype",
                      "bucket_numel": "stream_optimizer_state_bucket_numel",
                      "device_budget_mb": "stream_optimizer_state_device_budget_mb",
                      "host_cache_mb": "stream_optimizer_state_host_cache_mb"}


def _check_store_settings(a: argparse.Namespace) -> None:
    """The store's settings by the store's rules (StreamConfig checks itself when built), worded for the flags."""
    fields = {field: getattr(a, name) for field, name in _STORE_FIELD_FLAGS.items()}
    try:
        StreamConfig(dir=".", **fields)  # the directory is checked apart, once the run's paths are known
    except StoreConfigError as e:
        if e.field not in _STORE_FIELD_FLAGS:
            raise
        flag = "--" + _STORE_FIELD_FLAGS[e.field].replace("_", "-")
        raise ArgumentError(f"{flag} must be {e.expected} (got {fields[e.field]!r}).", (flag,),
                            f"change {flag}, or drop it for the default.") from None


def _check_streaming(a: argparse.Namespace) -> None:
    _check_store_settings(a)
    if not a.stream_optimizer_state_to_disk:
        return
    if a.colocate and a.offload_train is False:
        raise ArgumentError(
            f"--colocate with {_STREAM} needs trainer offload, but --no-offload-train turns it off: the "
            "rollout engine would have nowhere to put its KV cache.",
            ("--colocate", _STREAM, "--no-offload-train"),
            "drop --no-offload-train (and pass --offload-train-target=disk).",
        )
    target = a.offload_train_target or "cpu"
    if target != "disk":
        raise ArgumentError(
            f"{_STREAM} requires --offload-train-target=disk (got {target}): the streamed optimizer state "
            "and the trainer's disk offload are deployed together.",
            (_STREAM, "--offload-train-target"),
            "add --offload-train-target=disk.",
        )
    for attr, flag, why in _STREAM_REJECTS:
        if getattr(a, attr):
            raise ArgumentError(f"{_STREAM} cannot be combined with {flag}: {why}.", (_STREAM, flag),
                                f"drop {flag} or {_STREAM}.")
    if a.optimizer != "adam":
        raise ArgumentError(
            f"{_STREAM} supports only --optimizer adam (got {a.optimizer}).",
            (_STREAM, "--optimizer"), f"use --optimizer adam or drop {_STREAM}.",
        )




def _check_flags_take_effect(a: argparse.Namespace, env: Environment) -> None:
    found = first_ineffective_flag(a, has_tensorboard=env.has_module("tensorboard"))
    if found:
        flag, message, fix = found
        raise ArgumentError(message, (flag,), fix)


def _check_model(a: argparse.Namespace, env: Environment) -> None:
    if a.tiny_model and a.hf_checkpoint:
        raise ArgumentError(
            "--tiny-model and --hf-checkpoint choose different models.",
            ("--tiny-model", "--hf-checkpoint"),
            "pass only one of them.")
    if a.hf_checkpoint:
        if not env.path_exists(a.hf_checkpoint):
            raise ArgumentError(f"--hf-checkpoint {a.hf_checkpoint}: no such file or directory.", ("--hf-checkpoint",),
                                "pass the folder of a HuggingFace model (with config.json), or drop the flag to use "
                                "the embedded default model.")
        if not env.is_file(os.path.join(a.hf_checkpoint, "config.json")):
            raise ArgumentError(
                f"--hf-checkpoint {a.hf_checkpoint} is not a HuggingFace model folder (no config.json).",
                ("--hf-checkpoint",),
                "pass the folder that holds config.json and the weights.")
        _check_model_folder(a.hf_checkpoint, env)


def _check_model_folder(folder: str, env: Environment) -> None:
    """config.json and the tokenizer files, before anything allocates the model (miles.models' checks)."""
    from miles.models import ModelFolderError, check_hf_config, check_tokenizer_files

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
    try:
        check_tokenizer_files(folder, env.is_file, env.has_module)
    except ModelFolderError as e:
        raise ArgumentError(f"--hf-checkpoint {e.problem}.", ("--hf-checkpoint",), f"{e.fix}.") from None


def _check_backend(a: argparse.Namespace, env: Environment) -> None:
    for attr, flag in _NOT_IMPLEMENTED:
        if getattr(a, attr):
            raise ArgumentError(
                f"{flag} is accepted for compatibility with miles/Megatron command lines but no backend "
                "here implements it.",
                (flag,),
                f"drop {flag}.")
    ep = a.expert_model_parallel_size
    if ep < 1 or a.num_train_ranks % ep:
        raise ArgumentError(f"--expert-model-parallel-size {ep} must be >= 1 and divide --num-train-ranks "
                            f"{a.num_train_ranks}.", ("--expert-model-parallel-size", "--num-train-ranks"),
                            "pick an expert-parallel size that divides the number of train ranks.")
    if a.train_backend == "megatron":
        _check_megatron(a, env)
        return
    if ep > 1:
        raise ArgumentError(
            f"--expert-model-parallel-size {ep} needs --train-backend megatron: the torch backend "
            "replicates every expert on every rank.",
            ("--expert-model-parallel-size", "--train-backend"),
            "add --train-backend megatron or drop --expert-model-parallel-size.")
    for attr, flag in (("fp8_param", "--fp8-param"),
                       ("use_precision_aware_optimizer", "--use-precision-aware-optimizer"),
                       ("optimizer_cpu_offload", "--optimizer-cpu-offload")):
        if getattr(a, attr):
            raise ArgumentError(
                f"{flag} is a megatron-core feature; --train-backend {a.train_backend} does not "
                "support it.",
                (flag, "--train-backend"),
                f"add --train-backend megatron or drop {flag}.")


def _check_megatron(a: argparse.Namespace, env: Environment) -> None:
    """What the megatron backend needs from the machine, and its own flags judged on their merits."""
    if tuple(env.python_version) < (3, 12):
        v = ".".join(map(str, env.python_version))
        raise ArgumentError(f"--train-backend megatron needs Python >= 3.12 (megatron-core does not install on "
                            f"Python {v}).", ("--train-backend",), "use --train-backend torch, or Python >= 3.12 "
                            "with the megatron extra on a CUDA machine.")
    if not env.cuda_available():
        raise ArgumentError("--train-backend megatron needs CUDA (megatron-core hard-codes CUDA) and none is "
                            "available.", ("--train-backend",), "use --train-backend torch on this machine.")
    if not env.has_module("megatron.core"):
        raise ArgumentError("--train-backend megatron: megatron-core is not installed.", ("--train-backend",),
                            "pip install the megatron extra (pip install 'miles[megatron]').")
    if a.fp8_param:
        raise ArgumentError(
            "--fp8-param: the megatron backend builds bf16 params (fp8 params need Transformer Engine's "
            "fp8 recipe, which it does not set up).",
            ("--fp8-param", "--train-backend"),
            "drop --fp8-param.")
    if a.use_precision_aware_optimizer and not env.has_module("transformer_engine"):
        raise ArgumentError(
            "--use-precision-aware-optimizer needs Transformer Engine's FusedAdam, and transformer_engine "
            "is not importable.",
            ("--use-precision-aware-optimizer",),
            "install Transformer Engine or drop --use-precision-aware-optimizer.")
    if a.model_dtype == "fp32" and a.stream_optimizer_state_to_disk:
        raise ArgumentError(f"{_STREAM} with --train-backend megatron needs bf16 params: the store streams the fp32 "
                            "masters of low-precision params, and fp32 params have none.", (_STREAM, "--model-dtype"),
                            "pass --model-dtype bf16 (the default on CUDA).")


def _sglang_flags_given(a: argparse.Namespace) -> list[str]:
    given = [("--sglang-url", a.sglang_url is not None), ("--sglang-tp-size", a.sglang_tp_size != 1),
             ("--sglang-request-timeout", a.sglang_request_timeout != PARSER_DEFAULTS["sglang_request_timeout"]),
             ("--sglang-mem-fraction-static", a.sglang_mem_fraction_static is not None),
             ("--sglang-server-arg", bool(a.sglang_server_arg))]
    return [flag for flag, is_given in given if is_given]


def _check_sglang(a: argparse.Namespace, env: Environment) -> None:
    """The --sglang-* flags on their own, then what the engine needs (sglang importable, a model folder, the
    weights by reference)."""
    from miles.rollout.sglang import INSTALL_HINT, check_url, parse_server_args

    given = _sglang_flags_given(a)
    if a.rollout_engine != "sglang":
        if given:
            raise ArgumentError(f"{given[0]} has no effect: --rollout-engine is {a.rollout_engine}.", (given[0],),
                                f"add --rollout-engine sglang, or drop {given[0]}.")
        return
    if not env.has_module("sglang"):
        raise ArgumentError("--rollout-engine sglang: sglang is not installed here.", ("--rollout-engine",),
                            f"{INSTALL_HINT}; or use --rollout-engine embedded.")
    if type(a.sglang_tp_size) is not int or a.sglang_tp_size < 1:
        raise ArgumentError(f"--sglang-tp-size must be an int >= 1 (got {a.sglang_tp_size!r}).", ("--sglang-tp-size",),
                            "pass the tensor-parallel size of each sglang engine, e.g. 1.")
    timeout = a.sglang_request_timeout
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ArgumentError(f"--sglang-request-timeout must be a finite number of seconds > 0 (got {timeout!r}).",
                            ("--sglang-request-timeout",), "pass e.g. --sglang-request-timeout 600, or drop the flag.")
    fraction = a.sglang_mem_fraction_static
    if fraction is not None and not 0 < fraction < 1:
        raise ArgumentError(f"--sglang-mem-fraction-static must be in (0, 1) (got {fraction}).",
                            ("--sglang-mem-fraction-static",), "pass a fraction such as 0.5, or drop the flag.")
    try:
        parse_server_args(a.sglang_server_arg or ())
        if a.sglang_url is not None:
            check_url(a.sglang_url)
    except ValueError as e:
        flag = "--sglang-url" if str(e).startswith("--sglang-url") else "--sglang-server-arg"
        raise ArgumentError(f"{e}.", (flag,), f"fix {flag} as the message says.") from None
    if a.sglang_url is not None:
        for flag in ("--sglang-mem-fraction-static", "--sglang-server-arg"):
            if flag in given:
                raise ArgumentError(f"{flag} has no effect with --sglang-url {a.sglang_url}: the server runs with the "
                                    "arguments it was started with.", (flag, "--sglang-url"),
                                    f"pass it to the server when starting it, or drop {flag}.")
        if a.num_rollout_engines != 1:
            raise ArgumentError(
                f"--sglang-url drives one server, and --num-rollout-engines is {a.num_rollout_engines}.",
                ("--sglang-url", "--num-rollout-engines"),
                "pass --num-rollout-engines 1.")
    else:
        if "--sglang-request-timeout" in given:
            raise ArgumentError("--sglang-request-timeout has no effect without --sglang-url: an in-process sglang "
                                "engine is called directly, not over HTTP.", ("--sglang-request-timeout",),
                                "add --sglang-url URL, or drop --sglang-request-timeout.")
        if a.sglang_tp_size > 1:
            raise ArgumentError(
                f"--sglang-tp-size {a.sglang_tp_size}: an in-process sglang engine gets one GPU from Ray.",
                ("--sglang-tp-size",),
                f"start an sglang server with --tp-size {a.sglang_tp_size} and pass "
                "--sglang-url, or use --sglang-tp-size 1.")
        if _resolve_model_source(a, env) == "tiny":
            raise ArgumentError(
                "--rollout-engine sglang loads the model from a HuggingFace folder, and the policy is the "
                "tiny random model, which has none.",
                ("--rollout-engine",),
                "pass --hf-checkpoint DIR (`miles` can write a random model folder: "
                "miles.models.write_random_model).")
    if not a.colocate or a.weight_sync == "distributed":
        why = "--weight-sync distributed" if a.colocate else "without --colocate"
        raise ArgumentError(
            f"--rollout-engine sglang {why}: the weights reach an sglang engine only by reference, from the "
            "train rank it shares a GPU with (broadcasting to sglang is not wired).",
            ("--rollout-engine", "--colocate", "--weight-sync"),
            "add --colocate (and leave --weight-sync at auto or ipc).")


def _check_rollout(a: argparse.Namespace, env: Environment) -> None:
    _check_sglang(a, env)
    if a.weight_sync == "ipc" and env.cuda_available() and not a.colocate:
        raise ArgumentError(
            "--weight-sync ipc on GPUs needs --colocate: a CUDA IPC handle reaches only an engine on the "
            "GPU of the train rank that made it.",
            ("--weight-sync", "--colocate"),
            "add --colocate, or pass --weight-sync distributed (auto chooses it for you).")
    if a.weight_sync == "distributed" and env.cuda_available() and a.colocate:
        raise ArgumentError(
            "--weight-sync distributed with --colocate: NCCL cannot join two processes on one GPU (each "
            "engine shares its GPU with a train rank).",
            ("--weight-sync", "--colocate"),
            "drop --weight-sync (auto hands colocated engines the weights by reference).")
    if a.prompt_data is not None:
        if not env.is_file(a.prompt_data):
            raise ArgumentError(
                f"--prompt-data {a.prompt_data}: no such file.",
                ("--prompt-data",),
                'pass a JSONL file with one {"prompt": ..., "answer": ...} object per line, or drop the '
                "flag to use the built-in arithmetic task.")
        problem = env.check_prompt_data(a.prompt_data)
        if problem:
            raise ArgumentError(
                f"--prompt-data: {problem}.",
                ("--prompt-data",),
                'make every non-blank line a JSON object {"prompt": "<text>", "answer": "<text or number>"}.')


def _check_checkpoint(a: argparse.Namespace, env: Environment) -> None:
    if a.save_interval is not None and not a.save:
        raise ArgumentError("--save-interval needs --save.", ("--save-interval", "--save"), "add --save DIR.")
    if a.save_keep_latest is not None and not a.save:
        raise ArgumentError("--save-keep-latest needs --save.", ("--save-keep-latest", "--save"), "add --save DIR.")
    if a.finetune and not a.load:
        raise ArgumentError("--finetune needs --load (it loads weights from a checkpoint).", ("--finetune", "--load"),
                            "add --load DIR or drop --finetune.")
    if a.no_load_optim and not a.load:
        raise ArgumentError("--no-load-optim needs --load.", ("--no-load-optim", "--load"),
                            "add --load DIR or drop --no-load-optim.")
    if a.load and not env.is_dir(a.load):
        raise ArgumentError(f"--load {a.load}: no such directory.", ("--load",),
                            "pass an existing checkpoint directory, or drop --load to start fresh.")


# ------------------------------------------------------------------------------------------ main


def _resolve_model_source(a: argparse.Namespace, env: Environment) -> str:
    if a.hf_checkpoint:
        return "hf_checkpoint"
    if a.tiny_model:
        return "tiny"
    from miles.models import smollm2_available  # light: find_spec only, no torch/transformers import

    return "smollm2" if smollm2_available(has_module=env.has_module) else "tiny"


def _group(cls: type, a: argparse.Namespace):
    return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls)})


def validate_args(args: argparse.Namespace, env: Environment | None = None) -> RunConfig:
    """Check ``args`` and return the run's frozen :class:`RunConfig` (see the module docstring).

    Raises :class:`ArgumentError` (a ``ValueError``) for the first violated rule; its message names the
    flags involved and ends with ``Fix: ...``. The input namespace is not modified.
    """
    env = env or Environment()
    a = argparse.Namespace(**vars(args))

    _check_ranges(a)
    _check_model(a, env)
    _check_streaming(a)
    _check_flags_take_effect(a, env)
    _check_backend(a, env)
    _check_rollout(a, env)
    _check_checkpoint(a, env)

    # ---- resolve
    a.sglang_server_arg = tuple(a.sglang_server_arg or ())  # a repeatable flag parses as None or a list
    if a.offload_train is None:
        a.offload_train = bool(a.colocate or a.offload_train_target == "disk")
    if a.offload_train_target is None:
        a.offload_train_target = "cpu"
    if a.model_dtype is None:
        a.model_dtype = "bf16" if env.cuda_available() else "fp32"
    model_source = _resolve_model_source(a, env)
    if a.lr is None:
        a.lr = DEFAULT_LR_TINY if model_source == "tiny" else DEFAULT_LR_PRETRAINED
    run_id = env.run_id or new_run_id()
    root_is_default = a.offload_train_disk_dir is None
    a.offload_train_disk_dir = default_root(run_id, env.scratch_root) if root_is_default else os.path.abspath(
        a.offload_train_disk_dir)
    run_dir = os.path.abspath(a.save or os.path.join("runs", run_id))
    metrics_is_default = a.metrics_file is None
    a.metrics_file = os.path.abspath(a.metrics_file or os.path.join(run_dir, "metrics.jsonl"))
    paths = RunPaths(root=a.offload_train_disk_dir, run_dir=run_dir, root_is_default=root_is_default)
    check_outputs_outside_scratch(a, env, paths, metrics_is_default)  # before the parent rule: the graver fault
    creates = check_disk(a, env, model_source, root_is_default, metrics_is_default)
    check_root_is_the_runs_own(a, env, root_is_default)
    check_fits_this_machine(a, env)
    groups = {title: _group(cls, a) for title, cls in CONFIG_GROUPS}
    return RunConfig(**groups, paths=paths, model_source=model_source, run_id=run_id, ray_address=env.ray_address,
                     creates=creates)
