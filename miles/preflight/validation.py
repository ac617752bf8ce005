"""Validation of ``miles train`` arguments.

:func:`validate_args` is a pure function of the parsed namespace and an :class:`Environment`
(Python version, CUDA, importable packages, files on disk; a ``--prompt-data`` file is parsed here so
that a malformed line is reported before any actor starts). It reads the namespace once, into the draft
:class:`~miles.config.run_config.RunConfig` of :func:`draft_config` (tri-states unresolved), runs every rule
on that draft (each field's declared range first, in one loop), resolves it and runs the disk and machine
checks on the resolved config. It returns ONE frozen
:class:`~miles.config.run_config.RunConfig` with every tri-state and environment-dependent default
resolved, or raises exactly one :class:`ArgumentError` naming the conflicting flags and the fix. It
starts nothing and creates nothing (writability is probed with an anonymous temporary file).

Besides flag combinations (the rules here) it rejects, before any actor starts (the disk and machine
checks live in :mod:`miles.preflight.resource_checks`, the probes in :mod:`miles.preflight.environment`):

- a ``--hf-checkpoint`` folder whose config.json (read bounded) is not a JSON object with a ``model_type`` the
  backend builds and the model's sizes as integers in range (each family's rules: a MoE's top-k, a Gated
  DeltaNet's heads), whose tokenizer files are missing or not loadable, or whose weights hold an integer
  parameter (:mod:`miles.preflight.model_checks`): transformers would otherwise allocate its default sizes, fail
  in an actor, or train integers cast to floats;
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
  (:mod:`miles.preflight.disk_budget`: streamed state, trainer offload, and the
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
import os

from miles.config.arguments import CONFIG_GROUPS, STREAM_FLAG, ModelConfig, flag_name, range_problem
from miles.config.effective_flags import first_ineffective_flag, is_given
from miles.config.errors import ArgumentError
from miles.config.paths import ROLLOUT_ID_PLACEHOLDER, RunPaths, default_root, new_run_id, rollout_data_path
from miles.config.run_config import STORE_FIELD_FLAGS, RunConfig, field_value, store_config
from miles.preflight.environment import Environment
from miles.preflight.model_checks import check_model_folder
from miles.preflight.parallel_checks import check_parallel
from miles.preflight.resource_checks import (check_disk, check_fits_this_machine, check_outputs_outside_scratch,
                                             check_root_is_the_runs_own)
from miles_plugins.optimizers.streaming.errors import StoreConfigError

# ArgumentError and Environment are re-exported: validate_args raises the one and takes the other
__all__ = ["ArgumentError", "Environment", "validate_args", "draft_config", "DEFAULT_LR_PRETRAINED",
           "DEFAULT_LR_TINY"]

DEFAULT_LR_PRETRAINED = 5e-5
DEFAULT_LR_TINY = 1e-2


# ------------------------------------------------------------------------------------------ rules
# Each rule reads the draft RunConfig (draft_config): the typed groups as given, tri-states unresolved.


def _check_ranges(d: RunConfig) -> None:
    """Every field's declared :class:`~miles.config.arguments.Range` (the rollout batch's split over the ranks
    is parallel_checks': it splits over data parallelism)."""
    for title, cls in CONFIG_GROUPS:
        group = getattr(d, title)
        for f in dataclasses.fields(cls):
            bounds = f.metadata.get("range")
            problem = bounds and range_problem(f.name, getattr(group, f.name), bounds)
            if problem:
                message, fix = problem
                raise ArgumentError(message, (flag_name(f.name),), fix)


_STREAM_REJECTS = (
    ("reset_optimizer_states", "the streamed state lives in bucket files and is not reset in memory"),
    ("save_local_weight_checksum", "local weight checksums are not supported with the streamed state"),
    ("enable_witness", "the witness needs the optimizer state in memory"),
    ("use_precision_aware_optimizer", "the precision-aware optimizer keeps its own state layout"),
    ("optimizer_cpu_offload", "optimizer CPU offload and disk streaming both own the optimizer state"),
)


# Flags that exist so streaming can reject them by name (DESIGN section 4); no backend here implements them.
_NOT_IMPLEMENTED = ("reset_optimizer_states", "save_local_weight_checksum", "enable_witness")


def _check_store_settings(d: RunConfig) -> None:
    """The store's settings by the store's rules (its StreamConfig checks itself when built), worded for the flags."""
    try:
        store_config(d, rank=0, ranks_on_node=1, directory=".")  # the directory is checked apart, with the paths
    except StoreConfigError as e:
        if e.field not in STORE_FIELD_FLAGS:
            raise
        name = STORE_FIELD_FLAGS[e.field]
        flag = flag_name(name)
        raise ArgumentError(f"{flag} must be {e.expected} (got {field_value(d, name)!r}).", (flag,),
                            f"change {flag}, or drop it for the default.") from None


def _check_streaming(d: RunConfig) -> None:
    _check_store_settings(d)
    if not d.optimizer.stream_optimizer_state_to_disk:
        return
    if d.cluster.colocate and d.offload.offload_train is False:
        raise ArgumentError(
            f"--colocate with {STREAM_FLAG} needs trainer offload, but --no-offload-train turns it off: the "
            "rollout engine would have nowhere to put its KV cache.",
            ("--colocate", STREAM_FLAG, "--no-offload-train"),
            "drop --no-offload-train (and pass --offload-train-target=disk).",
        )
    if not d.offload.target_is_disk:
        raise ArgumentError(
            f"{STREAM_FLAG} requires --offload-train-target=disk (got {d.offload.target}): the streamed optimizer "
            "state and the trainer's disk offload are deployed together.",
            (STREAM_FLAG, "--offload-train-target"),
            "add --offload-train-target=disk.",
        )
    for name, why in _STREAM_REJECTS:
        if field_value(d, name):
            flag = flag_name(name)
            raise ArgumentError(f"{STREAM_FLAG} cannot be combined with {flag}: {why}.", (STREAM_FLAG, flag),
                                f"drop {flag} or {STREAM_FLAG}.")
    if d.optimizer.optimizer != "adam":
        raise ArgumentError(
            f"{STREAM_FLAG} supports only --optimizer adam (got {d.optimizer.optimizer}).",
            (STREAM_FLAG, "--optimizer"), f"use --optimizer adam or drop {STREAM_FLAG}.",
        )


def _check_batching(d: RunConfig) -> None:
    training = d.training
    if training.use_dynamic_batch_size and training.max_tokens_per_gpu is None:
        raise ArgumentError(
            "--use-dynamic-batch-size needs --max-tokens-per-gpu: the token budget is what fills each micro-batch.",
            ("--use-dynamic-batch-size", "--max-tokens-per-gpu"),
            "add --max-tokens-per-gpu N (e.g. 16384), or drop --use-dynamic-batch-size.")


def _check_importance_sampling(d: RunConfig) -> None:
    training = d.training
    if training.tis_clip_low >= training.tis_clip:
        raise ArgumentError(
            f"--tis-clip-low ({training.tis_clip_low}) must be below --tis-clip ({training.tis_clip}): they bound "
            "each token's importance weight from below and above.", ("--tis-clip-low", "--tis-clip"),
            "lower --tis-clip-low or raise --tis-clip (upstream's defaults: 0 and 2).")


def _check_routing_replay(d: RunConfig, env: Environment) -> None:
    """--use-rollout-routing-replay: a policy with MoE routers miles records and replays (read from the
    ``--hf-checkpoint`` config.json, which _check_model has checked; the default models are dense). Both engines
    record routes (sglang through its routed-experts capture); both backends replay them at every layout."""
    if not d.training.use_rollout_routing_replay:
        return
    flag = "--use-rollout-routing-replay"
    if not d.model.hf_checkpoint:
        raise ArgumentError(f"{flag} needs a mixture-of-experts policy; the default model is dense.", (flag,),
                            "pass --hf-checkpoint with a MoE model (e.g. Qwen3-30B-A3B), or drop the flag.")
    from miles.routing.routers import route_shape_of_config
    from miles.routing.routes import UnsupportedRouterError

    config = env.read_json(os.path.join(d.model.hf_checkpoint, "config.json"))
    try:
        shape = route_shape_of_config(config)
    except UnsupportedRouterError as e:
        raise ArgumentError(f"{flag}: {e}.", (flag, "--hf-checkpoint"), "drop the flag for this model.") from None
    if shape is None:
        raise ArgumentError(f"{flag}: --hf-checkpoint {d.model.hf_checkpoint} (model_type "
                            f"{config.get('model_type')!r}) has no MoE layer: there are no routes to replay.",
                            (flag, "--hf-checkpoint"), "drop the flag for dense models.")


def _check_flags_take_effect(d: RunConfig, env: Environment) -> None:
    found = first_ineffective_flag(d, has_tensorboard=env.has_module("tensorboard"))
    if found:
        flag, message, fix = found
        raise ArgumentError(message, (flag,), fix)


def _check_model(d: RunConfig, env: Environment) -> None:
    model = d.model
    if model.tiny_model and model.hf_checkpoint:
        raise ArgumentError(
            "--tiny-model and --hf-checkpoint choose different models.",
            ("--tiny-model", "--hf-checkpoint"),
            "pass only one of them.")
    if model.hf_checkpoint:
        if not env.path_exists(model.hf_checkpoint):
            raise ArgumentError(f"--hf-checkpoint {model.hf_checkpoint}: no such file or directory.",
                                ("--hf-checkpoint",), "pass the folder of a HuggingFace model (with config.json), "
                                "or drop the flag to use the embedded default model.")
        if not env.is_file(os.path.join(model.hf_checkpoint, "config.json")):
            raise ArgumentError(
                f"--hf-checkpoint {model.hf_checkpoint} is not a HuggingFace model folder (no config.json).",
                ("--hf-checkpoint",),
                "pass the folder that holds config.json and the weights.")
        check_model_folder(d, env)


def _check_backend(d: RunConfig, env: Environment) -> None:
    for name in _NOT_IMPLEMENTED:
        if field_value(d, name):
            flag = flag_name(name)
            raise ArgumentError(
                f"{flag} is accepted for compatibility with miles/Megatron command lines but no backend "
                "here implements it.",
                (flag,),
                f"drop {flag}.")
    if d.model.fp8_param:  # the one refusal of --fp8-param, whatever the backend and the optimizer state
        raise ArgumentError(
            "--fp8-param: no backend here keeps fp8 params (the megatron backend builds bf16 params, since fp8 "
            "params need Transformer Engine's fp8 recipe, which it does not set up; the streamed optimizer state "
            "publishes its fp32 mains into bf16/fp16/fp32 params).",
            ("--fp8-param",),
            "drop --fp8-param.")
    check_parallel(d, env)  # the backend's model parallelism, Megatron's layout rules, the batch over data parallelism
    backend = d.training.train_backend
    if backend == "megatron":
        _check_megatron(d, env)
        return
    for name in ("use_precision_aware_optimizer", "optimizer_cpu_offload"):
        if field_value(d, name):
            flag = flag_name(name)
            raise ArgumentError(
                f"{flag} is a megatron-core feature; --train-backend {backend} does not support it.",
                (flag, "--train-backend"),
                f"add --train-backend megatron or drop {flag}.")


def _check_megatron(d: RunConfig, env: Environment) -> None:
    """The megatron backend's own flags judged on their merits, then, for a real start only, what it needs from
    the machine: a dry run (validation, layout, plan) needs neither megatron-core nor CUDA."""
    if d.model.model_dtype == "fp32" and d.optimizer.stream_optimizer_state_to_disk:
        raise ArgumentError(f"{STREAM_FLAG} with --train-backend megatron needs bf16 params: the store streams the "
                            "fp32 masters of low-precision params, and fp32 params have none.",
                            (STREAM_FLAG, "--model-dtype"), "pass --model-dtype bf16 (the default on CUDA).")
    if not d.cluster.dry_run:
        _check_megatron_machine(d, env)


def _check_megatron_machine(d: RunConfig, env: Environment) -> None:
    from miles.backends.megatron_backend.machine import DISTRIBUTION, needs_cuda_message, runs_without_cuda

    installed = env.has_module("megatron.core")
    if not installed and tuple(env.python_version) < (3, 12):
        v = ".".join(map(str, env.python_version))
        raise ArgumentError(f"--train-backend megatron needs Python >= 3.12 (megatron-core does not install on "
                            f"Python {v}).", ("--train-backend",), "use --train-backend torch, or Python >= 3.12 "
                            "with the megatron extra on a CUDA machine.")
    if not env.cuda_available():
        version = env.package_version(DISTRIBUTION) if installed else None
        if not runs_without_cuda(version):
            raise ArgumentError(f"{needs_cuda_message(version)}.", ("--train-backend",),
                                "use --train-backend torch on this machine, or run on a CUDA machine.")
    if not installed:
        raise ArgumentError("--train-backend megatron: megatron-core is not installed.", ("--train-backend",),
                            "pip install the megatron extra (pip install 'miles[megatron]').")
    if d.optimizer.use_precision_aware_optimizer and not env.has_module("transformer_engine"):
        raise ArgumentError(
            "--use-precision-aware-optimizer needs Transformer Engine's FusedAdam, and transformer_engine "
            "is not importable.",
            ("--use-precision-aware-optimizer",),
            "install Transformer Engine or drop --use-precision-aware-optimizer.")


_SGLANG_FIELDS = ("sglang_url", "sglang_tp_size", "sglang_request_timeout", "sglang_mem_fraction_static",
                  "sglang_server_arg")


def _check_sglang(d: RunConfig, env: Environment) -> None:
    """The --sglang-* flags on their own (their ranges are on the fields), then what the engine needs (sglang
    importable, a model folder, the weights by reference)."""
    from miles.rollout.sglang import INSTALL_HINT, parse_server_args, server_address

    r = d.rollout
    given = [flag_name(name) for name in _SGLANG_FIELDS if is_given(d, name)]
    if r.rollout_engine != "sglang":
        if given:
            raise ArgumentError(f"{given[0]} has no effect: --rollout-engine is {r.rollout_engine}.", (given[0],),
                                f"add --rollout-engine sglang, or drop {given[0]}.")
        return
    if not env.has_module("sglang"):
        raise ArgumentError("--rollout-engine sglang: sglang is not installed here.", ("--rollout-engine",),
                            f"{INSTALL_HINT}; or use --rollout-engine embedded.")
    try:
        parse_server_args(r.sglang_server_arg)
    except ValueError as e:
        raise ArgumentError(f"{e}.", ("--sglang-server-arg",), "fix --sglang-server-arg as the message says.") from None
    try:
        servers = [server_address(url) for url in r.sglang_url]
    except ValueError as e:
        raise ArgumentError(f"{e}.", ("--sglang-url",), "fix --sglang-url as the message says.") from None
    if r.sglang_url:
        urls = " ".join(r.sglang_url)
        for flag in ("--sglang-mem-fraction-static", "--sglang-server-arg"):
            if flag in given:
                raise ArgumentError(f"{flag} has no effect with --sglang-url {urls}: the servers run with the "
                                    "arguments they were started with.", (flag, "--sglang-url"),
                                    f"pass it to the servers when starting them, or drop {flag}.")
        if len(r.sglang_url) != d.cluster.num_rollout_engines:
            raise ArgumentError(
                f"--sglang-url names {len(r.sglang_url)} server(s) ({urls}), and --num-rollout-engines is "
                f"{d.cluster.num_rollout_engines}: each rollout engine drives one server.",
                ("--sglang-url", "--num-rollout-engines"),
                f"pass --num-rollout-engines {len(r.sglang_url)}, or one --sglang-url per rollout engine.")
        same = [url for url, server in zip(r.sglang_url, servers) if servers.count(server) > 1]
        if same:
            raise ArgumentError(f"--sglang-url names the server {same[0]} more than once ({', '.join(same)}): two "
                                "rollout engines would drive one server.", ("--sglang-url",), "name each server once.")
    else:
        if "--sglang-request-timeout" in given:
            raise ArgumentError("--sglang-request-timeout has no effect without --sglang-url: an in-process sglang "
                                "engine is called directly, not over HTTP.", ("--sglang-request-timeout",),
                                "add --sglang-url URL, or drop --sglang-request-timeout.")
        if r.sglang_tp_size > 1:
            raise ArgumentError(
                f"--sglang-tp-size {r.sglang_tp_size}: an in-process sglang engine gets one GPU from Ray.",
                ("--sglang-tp-size",),
                f"start an sglang server with --tp-size {r.sglang_tp_size} and pass "
                "--sglang-url, or use --sglang-tp-size 1.")
        if d.model_source == "tiny":
            raise ArgumentError(
                "--rollout-engine sglang loads the model from a HuggingFace folder, and the policy is the "
                "tiny random model, which has none.",
                ("--rollout-engine",),
                "pass --hf-checkpoint DIR (`miles` can write a random model folder: "
                "miles.models.write_random_model).")


def _check_recorded_rollouts(d: RunConfig, env: Environment) -> None:
    """--save/--load-debug-rollout-data: path templates with {rollout_id}; a recording never lands on a file
    that exists (checked here for rollouts 0 .. --num-rollout - 1; a --load resume starts later, so its
    files are checked as they are written)."""
    r = d.rollout
    for flag, template in (("--save-debug-rollout-data", r.save_debug_rollout_data),
                           ("--load-debug-rollout-data", r.load_debug_rollout_data)):
        if template is not None and ROLLOUT_ID_PLACEHOLDER not in template:
            raise ArgumentError(
                f"{flag} {template}: no {ROLLOUT_ID_PLACEHOLDER} in the path: every rollout has its own file.", (flag,),
                f"pass a template such as {flag} /data/rollouts/rollout_{ROLLOUT_ID_PLACEHOLDER}.json")
    if r.save_debug_rollout_data is not None and r.save_debug_rollout_data == r.load_debug_rollout_data:
        raise ArgumentError("--save-debug-rollout-data and --load-debug-rollout-data are the same template: the "
                            "replayed files would be written again.",
                            ("--save-debug-rollout-data", "--load-debug-rollout-data"),
                            "drop --save-debug-rollout-data.")
    if r.save_debug_rollout_data is not None and not d.checkpoint.load:
        taken = [p for p in (rollout_data_path(r.save_debug_rollout_data, i) for i in range(r.num_rollout))
                 if env.path_exists(p)]
        if taken:
            raise ArgumentError(f"--save-debug-rollout-data: {taken[0]} exists ({len(taken)} of the run's "
                                f"{r.num_rollout} rollout files do): a recording never overwrites one.",
                                ("--save-debug-rollout-data",),
                                "pass a template under a new folder, or move the files.")


def _check_rollout(d: RunConfig, env: Environment) -> None:
    _check_sglang(d, env)
    _check_recorded_rollouts(d, env)
    weight_sync, colocate, prompt_data = d.rollout.weight_sync, d.cluster.colocate, d.rollout.prompt_data
    if weight_sync == "ipc" and env.cuda_available() and not colocate:
        raise ArgumentError(
            "--weight-sync ipc on GPUs needs --colocate: a CUDA IPC handle reaches only an engine on the "
            "GPU of the train rank that made it.",
            ("--weight-sync", "--colocate"),
            "add --colocate, or pass --weight-sync distributed (auto chooses it for you).")
    if weight_sync == "distributed" and env.cuda_available() and colocate:
        raise ArgumentError(
            "--weight-sync distributed with --colocate: NCCL cannot join two processes on one GPU (each "
            "engine shares its GPU with a train rank).",
            ("--weight-sync", "--colocate"),
            "drop --weight-sync (auto hands colocated engines the weights by reference).")
    if prompt_data is not None:
        if not env.is_file(prompt_data):
            raise ArgumentError(
                f"--prompt-data {prompt_data}: no such file.",
                ("--prompt-data",),
                'pass a JSONL file with one {"prompt": ..., "answer": ...} object per line, or drop the '
                "flag to use the built-in arithmetic task.")
        problem = env.check_prompt_data(prompt_data)
        if problem:
            raise ArgumentError(
                f"--prompt-data: {problem}.",
                ("--prompt-data",),
                'make every non-blank line a JSON object {"prompt": "<text>", "answer": "<text or number>"}.')


def _check_checkpoint(d: RunConfig, env: Environment) -> None:
    c = d.checkpoint
    if c.save_interval is not None and not c.save:
        raise ArgumentError("--save-interval needs --save.", ("--save-interval", "--save"), "add --save DIR.")
    if c.save_keep_latest is not None and not c.save:
        raise ArgumentError("--save-keep-latest needs --save.", ("--save-keep-latest", "--save"), "add --save DIR.")
    if c.finetune and not c.load:
        raise ArgumentError("--finetune needs --load (it loads weights from a checkpoint).", ("--finetune", "--load"),
                            "add --load DIR or drop --finetune.")
    if c.no_load_optim and not c.load:
        raise ArgumentError("--no-load-optim needs --load.", ("--no-load-optim", "--load"),
                            "add --load DIR or drop --no-load-optim.")
    # --load naming --save's folder resumes whatever that folder holds and starts fresh while it holds nothing
    # (Megatron's convention: one command starts the run and resumes it): miles.checkpoint.checked_resume_target
    own_folder = bool(c.save) and env.real_path(c.load or "") == env.real_path(c.save)
    if c.load and not env.is_dir(c.load) and not own_folder:
        raise ArgumentError(f"--load {c.load}: no such directory.", ("--load",),
                            "pass an existing checkpoint directory, or drop --load to start fresh.")


def _check_metrics_file(cfg: RunConfig, metrics_is_default: bool) -> None:
    """The metrics file, when it exists, is a regular text file the run can append its records to (a symbolic
    link is written through): :func:`miles.untrusted_json.text_file_problem`."""
    from miles.untrusted_json import text_file_problem

    path = cfg.logging.metrics_file
    problem = text_file_problem(path)
    if problem:
        where = f"the metrics file {path} (the default of --metrics-file)" if metrics_is_default else \
            f"--metrics-file {path}"
        raise ArgumentError(f"{where} {problem}: the run appends one JSON line per rollout to it.", ("--metrics-file",),
                            "pass --metrics-file with a new file, or the metrics file of an earlier run.")


# ------------------------------------------------------------------------------------------ main


def _model_source(model: ModelConfig, env: Environment) -> str:
    if model.hf_checkpoint:
        return "hf_checkpoint"
    if model.tiny_model:
        return "tiny"
    from miles.models import smollm2_available  # light: find_spec only, no torch/transformers import

    return "smollm2" if smollm2_available(has_module=env.has_module) else "tiny"


def draft_config(args: argparse.Namespace, env: Environment) -> RunConfig:
    """The flags once, as the typed groups of a :class:`RunConfig`: every value as given (tri-states and
    environment-dependent defaults still None, so a rule can tell "not given"), with what the run derives
    from them without looking at any disk (the model source, the run id, the run's paths; ``creates`` empty).
    The rules check this draft; :func:`validate_args` resolves it."""
    repeatable = [f.name for _, cls in CONFIG_GROUPS for f in dataclasses.fields(cls) if f.metadata.get("repeatable")]
    values = {**vars(args), **{name: tuple(getattr(args, name) or ()) for name in repeatable}}  # None or a list
    groups = {title: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)}) for title, cls in CONFIG_GROUPS}
    run_id = env.run_id or new_run_id()
    root = groups["offload"].offload_train_disk_dir
    paths = RunPaths(root=default_root(run_id, env.scratch_root) if root is None else os.path.abspath(root),
                     run_dir=os.path.abspath(groups["checkpoint"].save or os.path.join("runs", run_id)),
                     root_is_default=root is None)
    return RunConfig(**groups, paths=paths, model_source=_model_source(groups["model"], env), run_id=run_id,
                     ray_address=env.ray_address, creates=())


def _resolved(d: RunConfig, env: Environment) -> RunConfig:
    """The draft with every tri-state and environment-dependent default resolved (the module doc)."""
    lr = d.optimizer.lr
    if lr is None:
        lr = DEFAULT_LR_TINY if d.model_source == "tiny" else DEFAULT_LR_PRETRAINED
    metrics_file = d.logging.metrics_file or os.path.join(d.paths.run_dir, "metrics.jsonl")
    return dataclasses.replace(
        d,
        model=dataclasses.replace(d.model, model_dtype=d.model.model_dtype or (
            "bf16" if env.cuda_available() else "fp32")),
        optimizer=dataclasses.replace(d.optimizer, lr=lr),
        offload=dataclasses.replace(d.offload, offload_train=d.trainer_offload, offload_train_target=d.offload.target,
                                    offload_train_disk_dir=d.paths.root),
        logging=dataclasses.replace(d.logging, metrics_file=os.path.abspath(metrics_file)))


def validate_args(args: argparse.Namespace, env: Environment | None = None) -> RunConfig:
    """Check ``args`` and return the run's frozen :class:`RunConfig` (see the module docstring).

    Raises :class:`ArgumentError` (a ``ValueError``) for the first violated rule; its message names the
    flags involved and ends with ``Fix: ...``. The input namespace is not modified.
    """
    env = env or Environment()
    draft = draft_config(args, env)
    _check_ranges(draft)
    _check_model(draft, env)
    _check_streaming(draft)
    _check_batching(draft)
    _check_importance_sampling(draft)
    _check_routing_replay(draft, env)
    _check_flags_take_effect(draft, env)
    _check_backend(draft, env)
    _check_rollout(draft, env)
    _check_checkpoint(draft, env)
    cfg = _resolved(draft, env)
    metrics_is_default = draft.logging.metrics_file is None
    check_outputs_outside_scratch(cfg, env, metrics_is_default)  # before the parent rule: the graver fault
    creates = check_disk(cfg, env, metrics_is_default)
    _check_metrics_file(cfg, metrics_is_default)
    check_root_is_the_runs_own(cfg, env)
    check_fits_this_machine(cfg, env)
    return dataclasses.replace(cfg, creates=creates)
