"""Validation of ``miles train`` arguments.

:func:`validate_args` is a pure function of the parsed namespace and an :class:`Environment`
(Python version, CUDA, importable packages, files on disk; a ``--prompt-data`` file is parsed here so
that a malformed line is reported before any actor starts). It returns ONE frozen
:class:`~miles.config.run_config.RunConfig` with every tri-state and environment-dependent default
resolved, or raises exactly one :class:`ArgumentError` naming the conflicting flags and the fix. It
starts nothing and creates nothing (writability is probed with an anonymous temporary file).

Besides flag combinations it rejects, before any actor starts:

- a flag that would change nothing in the chosen configuration, naming what would make it count
  (:mod:`miles.config.effective_flags`; "given" means "differs from the parser default");
- a directory the run writes (``--offload-train-disk-dir`` when something writes there, ``--save``,
  the metrics file's folder, ``--tensorboard-dir``) that is a file, sits under a file, or is not
  writable;
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
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Optional

from miles.config.arguments import CONFIG_GROUPS
from miles.config.disk_budget import GIB, disk_budget, model_tensors_of_run, ranks_on_driver_node
from miles.config.effective_flags import first_ineffective_flag
from miles.config.paths import RunPaths, default_root, new_run_id
from miles.config.run_config import RunConfig
from miles_plugins.optimizers.streaming.config import HOST_CACHE_AUTO, StreamConfig
from miles_plugins.optimizers.streaming.errors import StoreConfigError
from miles_plugins.optimizers.streaming.io.ownership import path_within, system_directory_reason
from miles_plugins.optimizers.streaming.units import MiB

logger = logging.getLogger(__name__)

__all__ = ["ArgumentError", "Environment", "validate_args", "DEFAULT_LR_PRETRAINED", "DEFAULT_LR_TINY"]

DEFAULT_LR_PRETRAINED = 5e-5
DEFAULT_LR_TINY = 1e-2

_STREAM = "--stream-optimizer-state-to-disk"


class ArgumentError(ValueError):
    """One invalid argument combination: ``flags`` (the flags involved) and ``fix`` (what to do)."""

    def __init__(self, message: str, flags: tuple[str, ...] = (), fix: str = ""):
        self.flags = tuple(flags)
        self.fix = fix
        full = f"{message} Fix: {fix}" if fix else message
        super().__init__(full)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _cpu_count() -> int:
    return os.cpu_count() or 1


def _check_prompt_data(path: str) -> Optional[str]:
    """Parse the JSONL prompt file now (so a bad line fails before any actor starts); the problem or None."""
    from miles.rl.data import PromptDataError, load_prompt_data

    try:
        load_prompt_data(path)
    except PromptDataError as e:
        return str(e)
    return None


def _dir_writable(directory: str) -> bool:
    """Can this process create files in the existing ``directory``? Probed with an anonymous temporary
    file (gone when closed), because permission bits lie for root and for /proc or /sys."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _disk_free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def _filesystem_id(path: str) -> int:
    return os.stat(path).st_dev


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _ray_running_here() -> bool:
    """Ray is initialized in this process: the run uses that cluster (miles.train starts none)."""
    ray = sys.modules.get("ray")  # never imported: not running, and validation does not import it
    return ray is not None and ray.is_initialized()


def _host_memory_available() -> Optional[int]:
    # the store's own reading, so validation and the store judge a host tier by the same number; imported
    # here because the stager brings torch, which validation loads only when it must
    from miles_plugins.optimizers.streaming.io.stager import available_host_memory

    return available_host_memory()


@dataclass
class Environment:
    """What validation may look at besides the args. Tests pass a fixed one.

    Attributes are callables/values so that probing is lazy (CUDA is probed only when needed).
    """

    python_version: tuple[int, int] = field(default_factory=lambda: tuple(sys.version_info[:2]))
    cuda_available: Callable[[], bool] = _cuda_available
    has_module: Callable[[str], bool] = _has_module
    path_exists: Callable[[str], bool] = os.path.exists
    is_dir: Callable[[str], bool] = os.path.isdir
    is_file: Callable[[str], bool] = os.path.isfile
    check_prompt_data: Callable[[str], Optional[str]] = _check_prompt_data  # None if the file parses
    # the three below are asked only about paths that exist (the nearest existing parent of a directory)
    dir_writable: Callable[[str], bool] = _dir_writable
    disk_free_bytes: Callable[[str], int] = _disk_free_bytes
    filesystem_id: Callable[[str], int] = _filesystem_id  # equal ids: the same filesystem
    read_json: Callable[[str], dict] = _read_json  # --hf-checkpoint's config.json, for the model size
    scratch_root: Optional[str] = None  # None: $SCRATCH or the system temp dir
    # the cluster to join; None: the run starts its own single-node Ray (miles.train)
    ray_address: Optional[str] = field(default_factory=lambda: os.environ.get("RAY_ADDRESS") or None)
    ray_running: Callable[[], bool] = _ray_running_here  # True: the run uses it, whatever ray_address says
    # this machine's GPUs (when CUDA is available) and CPUs: the Ray cluster a run starts itself has these,
    # and joining a cluster, this node's bundle slots
    gpu_count: Callable[[], int] = _gpu_count
    cpu_count: Callable[[], int] = _cpu_count
    host_memory_available: Callable[[], Optional[int]] = _host_memory_available  # bytes; None: unknown
    run_id: Optional[str] = None  # None: "<YYYYmmdd-HHMMSS>-<pid>" (miles.config.paths.new_run_id)
    real_path: Callable[[str], str] = os.path.realpath  # symbolic links resolved, for the overlap checks
    home: str = field(default_factory=lambda: os.path.expanduser("~"))  # refused as the root itself


def _err(message: str, flags: tuple[str, ...], fix: str) -> ArgumentError:
    return ArgumentError(message, flags, fix)


# ------------------------------------------------------------------------------------------ rules


def _check_ranges(a: argparse.Namespace) -> None:
    def at_least(name: str, lo: float) -> None:
        v = getattr(a, name)
        if v is not None and v < lo:
            flag = "--" + name.replace("_", "-")
            raise _err(f"{flag} must be >= {lo:g} (got {v}).", (flag,), f"pass {flag} >= {lo:g}.")

    def positive(name: str) -> None:
        v = getattr(a, name)
        if v is not None and not v > 0:
            flag = "--" + name.replace("_", "-")
            raise _err(f"{flag} must be > 0 (got {v}).", (flag,), f"pass a positive {flag}.")

    for n in ("num_train_ranks", "num_rollout_engines", "num_cpus_per_rank", "num_rollout",
              "rollout_batch_size", "rollout_max_response_len", "micro_batch_size",
              "offload_train_disk_chunk_mb", "save_interval", "save_keep_latest", "weight_sync_bucket_mb"):
        at_least(n, 1)
    if a.n_samples_per_prompt < 2:
        raise _err(
            f"--n-samples-per-prompt must be >= 2 (got {a.n_samples_per_prompt}): GRPO normalizes rewards "
            "within the group of samples of one prompt.",
            ("--n-samples-per-prompt",), "pass --n-samples-per-prompt 2 or more.",
        )
    for n in ("rollout_temperature", "lr", "adam_eps"):
        positive(n)
    for n in ("weight_decay", "clip_grad", "eps_clip"):
        at_least(n, 0)
    if not 0 < a.rollout_top_p <= 1:
        raise _err(f"--rollout-top-p must be in (0, 1] (got {a.rollout_top_p}).", ("--rollout-top-p",),
                   "pass a value in (0, 1].")
    for n in ("adam_beta1", "adam_beta2"):
        v = getattr(a, n)
        if not 0 <= v < 1:
            flag = "--" + n.replace("_", "-")
            raise _err(f"{flag} must be in [0, 1) (got {v}).", (flag,), "pass a value in [0, 1).")
    total = a.rollout_batch_size * a.n_samples_per_prompt
    if total % a.num_train_ranks:
        raise _err(
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
        raise _err(f"{flag} must be {e.expected} (got {fields[e.field]!r}).", (flag,),
                   f"change {flag}, or drop it for the default.") from None


def _check_streaming(a: argparse.Namespace) -> None:
    _check_store_settings(a)
    if not a.stream_optimizer_state_to_disk:
        return
    if a.colocate and a.offload_train is False:
        raise _err(
            f"--colocate with {_STREAM} needs trainer offload, but --no-offload-train turns it off: the "
            "rollout engine would have nowhere to put its KV cache.",
            ("--colocate", _STREAM, "--no-offload-train"),
            "drop --no-offload-train (and pass --offload-train-target=disk).",
        )
    target = a.offload_train_target or "cpu"
    if target != "disk":
        raise _err(
            f"{_STREAM} requires --offload-train-target=disk (got {target}): the streamed optimizer state "
            "and the trainer's disk offload are deployed together.",
            (_STREAM, "--offload-train-target"),
            "add --offload-train-target=disk.",
        )
    for attr, flag, why in _STREAM_REJECTS:
        if getattr(a, attr):
            raise _err(f"{_STREAM} cannot be combined with {flag}: {why}.", (_STREAM, flag),
                       f"drop {flag} or {_STREAM}.")
    if a.optimizer != "adam":
        raise _err(
            f"{_STREAM} supports only --optimizer adam (got {a.optimizer}).",
            (_STREAM, "--optimizer"), f"use --optimizer adam or drop {_STREAM}.",
        )




def _check_flags_take_effect(a: argparse.Namespace, env: Environment) -> None:
    found = first_ineffective_flag(a, has_tensorboard=env.has_module("tensorboard"))
    if found:
        flag, message, fix = found
        raise _err(message, (flag,), fix)


def _check_model(a: argparse.Namespace, env: Environment) -> None:
    if a.tiny_model and a.hf_checkpoint:
        raise _err("--tiny-model and --hf-checkpoint choose different models.", ("--tiny-model", "--hf-checkpoint"),
                   "pass only one of them.")
    if a.hf_checkpoint:
        if not env.path_exists(a.hf_checkpoint):
            raise _err(f"--hf-checkpoint {a.hf_checkpoint}: no such file or directory.", ("--hf-checkpoint",),
                       "pass the folder of a HuggingFace model (with config.json), or drop the flag to use "
                       "the embedded default model.")
        if not env.is_file(os.path.join(a.hf_checkpoint, "config.json")):
            raise _err(f"--hf-checkpoint {a.hf_checkpoint} is not a HuggingFace model folder (no config.json).",
                       ("--hf-checkpoint",), "pass the folder that holds config.json and the weights.")


def _check_backend(a: argparse.Namespace, env: Environment) -> None:
    for attr, flag in _NOT_IMPLEMENTED:
        if getattr(a, attr):
            raise _err(f"{flag} is accepted for compatibility with miles/Megatron command lines but no backend "
                       "here implements it.", (flag,), f"drop {flag}.")
    ep = a.expert_model_parallel_size
    if ep < 1 or a.num_train_ranks % ep:
        raise _err(f"--expert-model-parallel-size {ep} must be >= 1 and divide --num-train-ranks "
                   f"{a.num_train_ranks}.", ("--expert-model-parallel-size", "--num-train-ranks"),
                   "pick an expert-parallel size that divides the number of train ranks.")
    if a.train_backend == "megatron":
        _check_megatron(a, env)
        return
    if ep > 1:
        raise _err(f"--expert-model-parallel-size {ep} needs --train-backend megatron: the torch backend "
                   "replicates every expert on every rank.", ("--expert-model-parallel-size", "--train-backend"),
                   "add --train-backend megatron or drop --expert-model-parallel-size.")
    for attr, flag in (("fp8_param", "--fp8-param"),
                       ("use_precision_aware_optimizer", "--use-precision-aware-optimizer"),
                       ("optimizer_cpu_offload", "--optimizer-cpu-offload")):
        if getattr(a, attr):
            raise _err(f"{flag} is a megatron-core feature; --train-backend {a.train_backend} does not "
                       "support it.", (flag, "--train-backend"), f"add --train-backend megatron or drop {flag}.")


def _check_megatron(a: argparse.Namespace, env: Environment) -> None:
    """What the megatron backend needs from the machine, and its own flags judged on their merits."""
    if tuple(env.python_version) < (3, 12):
        v = ".".join(map(str, env.python_version))
        raise _err(f"--train-backend megatron needs Python >= 3.12 (megatron-core does not install on "
                   f"Python {v}).", ("--train-backend",), "use --train-backend torch, or Python >= 3.12 "
                   "with the megatron extra on a CUDA machine.")
    if not env.cuda_available():
        raise _err("--train-backend megatron needs CUDA (megatron-core hard-codes CUDA) and none is "
                   "available.", ("--train-backend",), "use --train-backend torch on this machine.")
    if not env.has_module("megatron.core"):
        raise _err("--train-backend megatron: megatron-core is not installed.", ("--train-backend",),
                   "pip install the megatron extra (pip install 'miles[megatron]').")
    if a.fp8_param:
        raise _err("--fp8-param: the megatron backend builds bf16 params (fp8 params need Transformer Engine's "
                   "fp8 recipe, which it does not set up).", ("--fp8-param", "--train-backend"), "drop --fp8-param.")
    if a.use_precision_aware_optimizer and not env.has_module("transformer_engine"):
        raise _err("--use-precision-aware-optimizer needs Transformer Engine's FusedAdam, and transformer_engine "
                   "is not importable.", ("--use-precision-aware-optimizer",),
                   "install Transformer Engine or drop --use-precision-aware-optimizer.")
    if a.model_dtype == "fp32" and a.stream_optimizer_state_to_disk:
        raise _err(f"{_STREAM} with --train-backend megatron needs bf16 params: the store streams the fp32 "
                   "masters of low-precision params, and fp32 params have none.", (_STREAM, "--model-dtype"),
                   "pass --model-dtype bf16 (the default on CUDA).")


def _sglang_flags_given(a: argparse.Namespace) -> list[str]:
    given = [("--sglang-url", a.sglang_url is not None), ("--sglang-tp-size", a.sglang_tp_size != 1),
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
            raise _err(f"{given[0]} has no effect: --rollout-engine is {a.rollout_engine}.", (given[0],),
                       f"add --rollout-engine sglang, or drop {given[0]}.")
        return
    if not env.has_module("sglang"):
        raise _err("--rollout-engine sglang: sglang is not installed here.", ("--rollout-engine",),
                   f"{INSTALL_HINT}; or use --rollout-engine embedded.")
    if type(a.sglang_tp_size) is not int or a.sglang_tp_size < 1:
        raise _err(f"--sglang-tp-size must be an int >= 1 (got {a.sglang_tp_size!r}).", ("--sglang-tp-size",),
                   "pass the tensor-parallel size of each sglang engine, e.g. 1.")
    fraction = a.sglang_mem_fraction_static
    if fraction is not None and not 0 < fraction < 1:
        raise _err(f"--sglang-mem-fraction-static must be in (0, 1) (got {fraction}).",
                   ("--sglang-mem-fraction-static",), "pass a fraction such as 0.5, or drop the flag.")
    try:
        parse_server_args(a.sglang_server_arg or ())
        if a.sglang_url is not None:
            check_url(a.sglang_url)
    except ValueError as e:
        flag = "--sglang-url" if str(e).startswith("--sglang-url") else "--sglang-server-arg"
        raise _err(f"{e}.", (flag,), f"fix {flag} as the message says.") from None
    if a.sglang_url is not None:
        for flag in ("--sglang-mem-fraction-static", "--sglang-server-arg"):
            if flag in given:
                raise _err(f"{flag} has no effect with --sglang-url {a.sglang_url}: the server runs with the "
                           "arguments it was started with.", (flag, "--sglang-url"),
                           f"pass it to the server when starting it, or drop {flag}.")
        if a.num_rollout_engines != 1:
            raise _err(f"--sglang-url drives one server, and --num-rollout-engines is {a.num_rollout_engines}.",
                       ("--sglang-url", "--num-rollout-engines"), "pass --num-rollout-engines 1.")
    else:
        if a.sglang_tp_size > 1:
            raise _err(f"--sglang-tp-size {a.sglang_tp_size}: an in-process sglang engine gets one GPU from Ray.",
                       ("--sglang-tp-size",), f"start an sglang server with --tp-size {a.sglang_tp_size} and pass "
                       "--sglang-url, or use --sglang-tp-size 1.")
        if _resolve_model_source(a, env) == "tiny":
            raise _err("--rollout-engine sglang loads the model from a HuggingFace folder, and the policy is the "
                       "tiny random model, which has none.", ("--rollout-engine",),
                       "pass --hf-checkpoint DIR (`miles` can write a random model folder: "
                       "miles.models.write_random_model).")
    if not a.colocate or a.weight_sync == "distributed":
        why = "--weight-sync distributed" if a.colocate else "without --colocate"
        raise _err(f"--rollout-engine sglang {why}: the weights reach an sglang engine only by reference, from the "
                   "train rank it shares a GPU with (broadcasting to sglang is not wired).",
                   ("--rollout-engine", "--colocate", "--weight-sync"),
                   "add --colocate (and leave --weight-sync at auto or ipc).")


def _check_rollout(a: argparse.Namespace, env: Environment) -> None:
    _check_sglang(a, env)
    if a.weight_sync == "ipc" and env.cuda_available() and not a.colocate:
        raise _err("--weight-sync ipc on GPUs needs --colocate: a CUDA IPC handle reaches only an engine on the "
                   "GPU of the train rank that made it.", ("--weight-sync", "--colocate"),
                   "add --colocate, or pass --weight-sync distributed (auto chooses it for you).")
    if a.weight_sync == "distributed" and env.cuda_available() and a.colocate:
        raise _err("--weight-sync distributed with --colocate: NCCL cannot join two processes on one GPU (each "
                   "engine shares its GPU with a train rank).", ("--weight-sync", "--colocate"),
                   "drop --weight-sync (auto hands colocated engines the weights by reference).")
    if a.prompt_data is not None:
        if not env.is_file(a.prompt_data):
            raise _err(f"--prompt-data {a.prompt_data}: no such file.", ("--prompt-data",),
                       'pass a JSONL file with one {"prompt": ..., "answer": ...} object per line, or drop the '
                       "flag to use the built-in arithmetic task.")
        problem = env.check_prompt_data(a.prompt_data)
        if problem:
            raise _err(f"--prompt-data: {problem}.", ("--prompt-data",),
                       'make every non-blank line a JSON object {"prompt": "<text>", "answer": "<text or number>"}.')


def _check_checkpoint(a: argparse.Namespace, env: Environment) -> None:
    if a.save_interval is not None and not a.save:
        raise _err("--save-interval needs --save.", ("--save-interval", "--save"), "add --save DIR.")
    if a.save_keep_latest is not None and not a.save:
        raise _err("--save-keep-latest needs --save.", ("--save-keep-latest", "--save"), "add --save DIR.")
    if a.finetune and not a.load:
        raise _err("--finetune needs --load (it loads weights from a checkpoint).", ("--finetune", "--load"),
                   "add --load DIR or drop --finetune.")
    if a.no_load_optim and not a.load:
        raise _err("--no-load-optim needs --load.", ("--no-load-optim", "--load"),
                   "add --load DIR or drop --no-load-optim.")
    if a.load and not env.is_dir(a.load):
        raise _err(f"--load {a.load}: no such directory.", ("--load",),
                   "pass an existing checkpoint directory, or drop --load to start fresh.")


# ------------------------------------------------------------------------------------------ disk


def _nearest_existing(path: str, env: Environment) -> str:
    while not env.path_exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _label(flag: str, path: str, is_default: bool) -> str:
    return f"{path} (the default of {flag})" if is_default else f"{flag} {path}"


def _check_directory(flag: str, path: str, env: Environment, is_default: bool = False) -> str:
    """``path`` is a writable directory or can be created as one; returns its nearest existing part."""
    where = _label(flag, path, is_default)
    if env.path_exists(path) and not env.is_dir(path):
        raise _err(f"{where} is a file, not a directory.", (flag,),
                   f"pass a directory for {flag} (it is created when missing).")
    existing = _nearest_existing(path, env)
    if not env.is_dir(existing):
        raise _err(f"{where} cannot be created: {existing} is a file.", (flag,),
                   f"pass a directory for {flag} whose parents are directories.")
    if not env.dir_writable(existing):
        raise _err(f"{where} is not writable: files cannot be created in {existing}.", (flag,),
                   f"pass a directory on a writable local disk for {flag} (e.g. under $SCRATCH or /tmp).")
    return existing


def _check_free(flag: str, where: str, existing: str, need: int, what: str, params: int, env: Environment,
                scope: str = "") -> None:
    """``scope``: which ranks the need counts, when not all of them (a cluster's driver node)."""
    free = env.disk_free_bytes(existing)
    if need > free:
        raise _err(f"{where}: the run needs about {need / GIB:.2f} GiB there ({what}, for {params / 1e6:.1f}M "
                   f"params{scope}) and its filesystem has {free / GIB:.2f} GiB free.", (flag,),
                   f"free space, pass {flag} on a larger disk, or shrink the run (e.g. "
                   "--stream-optimizer-state-moment-dtype fp8e4m3); `miles plan` sizes a run.")


def _driver_node_slots(a: argparse.Namespace, env: Environment) -> int:
    """Bundles the driver's machine can hold: one per GPU, or per --num-cpus-per-rank CPUs without CUDA."""
    return env.gpu_count() if env.cuda_available() else env.cpu_count() // a.num_cpus_per_rank


def _ranks_checked_here(a: argparse.Namespace, env: Environment) -> tuple[Optional[int], str]:
    """The train ranks whose scratch the root's filesystem must hold (None: all, the run's own single-node
    Ray) and how the error message says so. Joining a cluster, only the driver's node's share lands on this
    disk; the other nodes' disks are checked by the per-node probe once Ray has placed the ranks."""
    if env.ray_address is None:
        return None, ""
    ranks = ranks_on_driver_node(a.num_train_ranks, _driver_node_slots(a, env))
    return ranks, (f"; at most {ranks} of the {a.num_train_ranks} train ranks can run on this node of the "
                   f"cluster at {env.ray_address}, each other node's disk is checked when Ray places the ranks")


def _model_tensors(a: argparse.Namespace, env: Environment, model_source: str):
    """The policy's tensors as `miles plan` counts them; None when they cannot be known here."""
    hf_config = None
    if model_source == "hf_checkpoint":
        try:
            hf_config = env.read_json(os.path.join(a.hf_checkpoint, "config.json"))
        except (OSError, ValueError):
            return None  # the model loader reports an unreadable config.json with its own words
    return model_tensors_of_run(model_source, hf_config)


def _check_disk(a: argparse.Namespace, env: Environment, model_source: str, root_is_default: bool) -> None:
    """Every directory the run writes is usable, and its filesystem holds what the run will write there
    (:mod:`miles.config.disk_budget`); ``a`` is resolved (absolute paths, offload_train set)."""
    root_flag = "--offload-train-disk-dir"
    writes_root = (a.stream_optimizer_state_to_disk or a.colocate
                   or (a.offload_train and a.offload_train_target == "disk"))
    root = _check_directory(root_flag, a.offload_train_disk_dir, env, root_is_default) if writes_root else None
    save = _check_directory("--save", os.path.abspath(a.save), env) if a.save else None
    _check_directory("--metrics-file", os.path.dirname(a.metrics_file), env)
    if a.tensorboard_dir:
        _check_directory("--tensorboard-dir", os.path.abspath(a.tensorboard_dir), env)

    model = _model_tensors(a, env, model_source)
    if model is None:
        return
    from miles.sizing.estimate import SizingError
    from miles.sizing.sharding import LayoutError

    ranks_here, scope = _ranks_checked_here(a, env) if root else (None, "")
    memory = env.host_memory_available() if a.stream_optimizer_state_host_cache_mb == HOST_CACHE_AUTO else None
    try:
        budget = disk_budget(a, model, ranks_here=ranks_here, memory_available=memory)
    except (SizingError, LayoutError) as exc:  # the layout's own checks (here and in the backend) name it
        logger.warning("free-space check skipped: `miles plan` cannot size this run (%s)", exc)
        return
    params = model.total()
    save_with_root = bool(root and save) and env.filesystem_id(save) == env.filesystem_id(root)
    if root:
        need = budget.scratch + (budget.checkpoint if save_with_root else 0)
        _check_free(root_flag, _label(root_flag, a.offload_train_disk_dir, root_is_default), root, need,
                    budget.describe(save_with_root), params, env, scope)
    if save and not save_with_root:
        _check_free("--save", f"--save {a.save}", save, budget.checkpoint, "one checkpoint", params, env)


_ROOT_FLAG = "--offload-train-disk-dir"
# what each output flag would lose if the run's teardown removed the directory it lies in
_OUTPUTS = (("save", "--save", "its checkpoints and metrics"), ("load", "--load", "the checkpoint to resume from"),
            ("metrics_file", "--metrics-file", "the metrics"), ("tensorboard_dir", "--tensorboard-dir",
                                                                  "the TensorBoard logs"))


def _check_root_is_the_runs_own(a: argparse.Namespace, env: Environment, root_is_default: bool) -> None:
    """The root is not ``/``, a system directory or the home directory itself (as given and resolved)."""
    root = a.offload_train_disk_dir
    for candidate in dict.fromkeys((root, env.real_path(root))):
        why = system_directory_reason(candidate, env.home)
        if why is not None:
            raise _err(f"{_label(_ROOT_FLAG, root, root_is_default)} cannot be the run's root: {why}, and the run "
                       "creates its folders there and removes them when it ends.", (_ROOT_FLAG,),
                       f"pass a directory of its own for {_ROOT_FLAG}, on a node-local disk (e.g. under $SCRATCH "
                       "or /tmp).")


def _check_outputs_outside_scratch(a: argparse.Namespace, env: Environment, paths: RunPaths,
                                   metrics_is_default: bool) -> None:
    """No output of the run lies inside (or is) a directory its teardown removes."""
    root = paths.root
    removed = paths.removed_at_exit(root_exists=env.path_exists(root))
    for attr, flag, loses in _OUTPUTS:
        given = getattr(a, attr)
        if not given:
            continue
        path = os.path.abspath(given)
        for directory in removed:
            if path_within(path, directory) or path_within(env.real_path(path), env.real_path(directory)):
                created = " (it does not exist yet, so the run creates it)" if directory == root else ""
                where = _label(flag, given, attr == "metrics_file" and metrics_is_default)
                raise _err(f"{where} lies inside {directory}{created}, which this run makes under {_ROOT_FLAG} "
                           f"and removes, with everything in it, when it ends: {loses} would be deleted.",
                           (flag, _ROOT_FLAG), f"pass a {flag} outside {root} (e.g. next to it), or a {_ROOT_FLAG} "
                           f"that does not contain {given}.")


# ------------------------------------------------------------------------------------------ machine

_HOST_CACHE_FLAG = "--stream-optimizer-state-host-cache-mb"


def _bundles(a: argparse.Namespace) -> int:
    """The placement group's bundles (miles.ray.layout.bundle_specs): one per train rank, and one per
    rollout engine unless the engines share the train ranks' bundles (--colocate)."""
    return a.num_train_ranks + (0 if a.colocate else a.num_rollout_engines)


def _starts_own_ray(env: Environment) -> bool:
    """The run starts a single-node Ray cluster on this machine (miles.train), rather than joining one."""
    return env.ray_address is None and not env.ray_running()


def _check_fits_this_machine(a: argparse.Namespace, env: Environment) -> None:
    """What Ray would only find out after its placement group timed out, or the store once the actors are
    up: checked here against this machine's CPUs and available memory."""
    if a.colocate and a.num_rollout_engines > a.num_train_ranks:
        raise _err(f"--colocate places each rollout engine on a train rank's bundle, and --num-rollout-engines "
                   f"{a.num_rollout_engines} is more than --num-train-ranks {a.num_train_ranks}.",
                   ("--colocate", "--num-rollout-engines", "--num-train-ranks"),
                   f"pass --num-rollout-engines {a.num_train_ranks} or fewer, or drop --colocate.")
    if _starts_own_ray(env):
        _check_fits_own_ray(a, env)
    _check_host_tier_fits(a, env)


def _check_fits_own_ray(a: argparse.Namespace, env: Environment) -> None:
    """The placement group fits the CPUs of the single-node Ray cluster the run starts (Ray gives it the
    machine's CPUs); otherwise Ray would wait for it until its timeout."""
    bundles = _bundles(a)
    spelled = (f"--num-train-ranks {a.num_train_ranks}" if a.colocate else
               f"--num-train-ranks {a.num_train_ranks} + --num-rollout-engines {a.num_rollout_engines} (not colocated)")
    fix = ("lower --num-train-ranks, --num-rollout-engines or --num-cpus-per-rank"
           + ("" if a.colocate else ", add --colocate (the engines then share the train ranks' bundles)")
           + ", or run on a larger machine (RAY_ADDRESS joins an existing cluster).")
    cpus, need = env.cpu_count(), bundles * a.num_cpus_per_rank
    if need > cpus:
        raise _err(f"{spelled} = {bundles} bundles x --num-cpus-per-rank {a.num_cpus_per_rank} = {need} CPUs, and "
                   f"this machine has {cpus} for the Ray cluster the run starts.",
                   ("--num-train-ranks", "--num-rollout-engines", "--num-cpus-per-rank"), fix)


def _check_host_tier_fits(a: argparse.Namespace, env: Environment) -> None:
    """Every train rank on this machine takes a host tier of its own, and together they must fit the memory
    the host has available (the store refuses one rank's tier larger than that, once the actors are up)."""
    per_rank = a.stream_optimizer_state_host_cache_mb
    if not a.stream_optimizer_state_to_disk or per_rank == HOST_CACHE_AUTO or not per_rank:
        return
    ranks = a.num_train_ranks if _starts_own_ray(env) else ranks_on_driver_node(
        a.num_train_ranks, _driver_node_slots(a, env))
    available = env.host_memory_available()
    if available is None or not ranks or ranks * per_rank * MiB <= available:
        return
    raise _err(f"{_HOST_CACHE_FLAG} {per_rank} asks {per_rank * MiB / GIB:.2f} GiB of host RAM for the host tier of "
               f"each of the {ranks} train ranks on this machine ({ranks * per_rank * MiB / GIB:.2f} GiB in all), "
               f"and it has {available / GIB:.2f} GiB available.", (_HOST_CACHE_FLAG,),
               f"pass at most {available // ranks // MiB} MiB ({available / GIB:.2f} GiB over {ranks} ranks), or "
               f"{HOST_CACHE_AUTO} (fit to the free memory when the store is built).")


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
    _check_disk(a, env, model_source, root_is_default)
    _check_root_is_the_runs_own(a, env, root_is_default)
    paths = RunPaths(root=a.offload_train_disk_dir, run_dir=run_dir, root_is_default=root_is_default)
    _check_outputs_outside_scratch(a, env, paths, metrics_is_default)
    _check_fits_this_machine(a, env)
    groups = {title: _group(cls, a) for title, cls in CONFIG_GROUPS}
    return RunConfig(**groups, paths=paths, model_source=model_source, run_id=run_id, ray_address=env.ray_address)
