"""miles train arguments: parser shape, resolution of defaults, and the validation table."""

from __future__ import annotations

import argparse
import os

import pytest

from miles.config import (
    CONFIG_GROUPS,
    ArgumentError,
    Environment,
    build_parser,
    config_from_args,
    parse_args,
    validate_args,
)


@pytest.fixture()
def paths(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "1"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n{"prompt": "no answer"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
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
    (["--stream-optimizer-state-host-cache-mb", "4096"],
     "--stream-optimizer-state-host-cache-mb caches streamed optimizer state, but "
     "--stream-optimizer-state-to-disk is off. Fix: add --stream-optimizer-state-to-disk (with "
     "--offload-train-target=disk) or drop the host cache."),
    ([STREAM, DISK, "--stream-optimizer-state-host-cache-mb", "-1"],
     "--stream-optimizer-state-host-cache-mb must be >= 0 (got -1). Fix: pass 0 (no host cache) or a budget "
     "in MiB."),
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
    ([STREAM, DISK, "--fp8-param"],
     "--stream-optimizer-state-to-disk cannot be combined with --fp8-param: streaming publishes fp32 mains "
     "into bf16/fp16/fp32 params, not fp8. Fix: drop --fp8-param or --stream-optimizer-state-to-disk."),
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
     "--offload-train-target=disk needs trainer offload, but --no-offload-train turns it off. Fix: drop "
     "--no-offload-train or --offload-train-target=disk."),
    ([STREAM, DISK, "--no-offload-train"],
     "--offload-train-target=disk needs trainer offload, but --no-offload-train turns it off. Fix: drop "
     "--no-offload-train or --offload-train-target=disk."),
    # --- backends / engines
    (["--train-backend", "megatron"],
     "--train-backend megatron needs Python >= 3.12 (megatron-core does not install on Python 3.11). Fix: "
     "use --train-backend torch, or Python >= 3.12 with the megatron extra on a CUDA machine."),
    (["--fp8-param"],
     "--fp8-param is a megatron-core feature; --train-backend torch does not support it. Fix: drop "
     "--fp8-param."),
    (["--optimizer-cpu-offload"],
     "--optimizer-cpu-offload is a megatron-core feature; --train-backend torch does not support it. Fix: "
     "drop --optimizer-cpu-offload."),
    (["--reset-optimizer-states"],
     "--reset-optimizer-states is accepted for compatibility with miles/Megatron command lines but is not "
     "implemented by the torch backend. Fix: drop --reset-optimizer-states."),
    (["--rollout-engine", "sglang"],
     "--rollout-engine sglang: sglang is not importable here (it needs a CUDA machine with sglang "
     "installed). Fix: use --rollout-engine embedded."),
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
    (["--lr", "-1"], "--lr must be > 0 (got -1.0). Fix: pass a positive --lr."),
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
        out = validate_args(args, env())
        assert out.validated
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
    with pytest.raises(ArgumentError, match="does not drive megatron-core models yet"):
        validate_args(args, env(python_version=(3, 12), cuda_available=lambda: True, modules={"megatron.core"}))


def test_sglang_rejected_even_when_importable():
    with pytest.raises(ArgumentError, match="not wired into miles train yet"):
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
    assert a.offload_train_disk_chunk_mb == 256 and a.stream_optimizer_state_bucket_numel == 200_000_000
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
    a = validate_args(parse_args([]), e)
    assert a.offload_train is False and a.offload_train_target == "cpu" and a.model_dtype == "fp32"
    assert a.model_source == "tiny" and a.lr == pytest.approx(1e-2)
    assert a.offload_train_disk_dir == os.path.abspath("/scratch/miles-run-RUN")
    assert a.offload_train_disk_dir_is_default is True
    assert a.stream_optimizer_state_dir == os.path.join(a.offload_train_disk_dir, "optimizer_state")
    assert a.offload_train_trainer_dir == os.path.join(a.offload_train_disk_dir, "trainer")
    assert a.rollout_offload_dir == os.path.join(a.offload_train_disk_dir, "rollout")
    # tri-state: on under --colocate, on with disk target, explicit off kept
    assert validate_args(parse_args(["--colocate"]), e).offload_train is True
    assert validate_args(parse_args([DISK]), e).offload_train is True
    assert validate_args(parse_args(["--colocate", "--no-offload-train"]), e).offload_train is False
    # the demo command line
    d = validate_args(parse_args([STREAM, DISK]), e)
    assert d.offload_train is True and d.offload_train_target == "disk" and d.stream_optimizer_state_to_disk
    # explicit values win
    a = validate_args(parse_args(["--lr", "0.5", "--model-dtype", "bf16", "--offload-train-disk-dir", "rel"]), e)
    assert a.lr == 0.5 and a.model_dtype == "bf16"
    assert a.offload_train_disk_dir == os.path.abspath("rel") and a.offload_train_disk_dir_is_default is False


def test_validate_is_pure_and_idempotent():
    raw = parse_args([STREAM, DISK])
    before = dict(vars(raw))
    once = validate_args(raw, env())
    assert vars(raw) == before  # input untouched
    twice = validate_args(once, env(run_id="OTHER"))
    assert vars(twice) == vars(once)


def test_model_source_smollm2_when_available(monkeypatch):
    import miles.models as models

    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: "/x/SmolLM2-135M-Instruct.Q4_1.gguf")
    a = validate_args(parse_args([]), env(modules={"gguf"}))
    assert a.model_source == "smollm2" and a.lr == pytest.approx(5e-5)
    assert validate_args(parse_args([]), env()).model_source == "tiny"  # gguf missing
    assert validate_args(parse_args(["--tiny-model"]), env(modules={"gguf"})).model_source == "tiny"


def test_config_from_args_round_trip():
    a = parse_args(["--lr", "0.1", "--colocate"])
    cfg = config_from_args(a)
    assert cfg.optimizer.lr == 0.1 and cfg.cluster.colocate is True
    assert isinstance(a, argparse.Namespace)


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
