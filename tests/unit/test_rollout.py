"""EmbeddedRolloutEngine on the tiny random model."""

from __future__ import annotations

import os

import pytest
import torch

from miles.config import parse_args
from miles.preflight import Environment, validate_args
from miles.models import load_policy
from miles.rl import collate_samples, encode_prompts, forward_logprobs
from miles.rollout import Sample, SamplingParams
from miles.rollout.contract import KV_CACHE, WEIGHTS
from miles.rollout.embedded import EmbeddedRolloutEngine


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    a = parse_args(["--tiny-model", "--offload-train-disk-dir", str(root), "--metrics-file", str(root / "m.jsonl")])
    return validate_args(a, Environment(has_module=lambda m: False))


@pytest.fixture()
def engine(args):
    eng = EmbeddedRolloutEngine(args, device="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(args):
    model, tok, _ = load_policy(args, log=False)
    return encode_prompts(tok, ["What is 1 + 2? Answer with just the number.", "What is 10 + 5?"])


def test_generate_shapes_and_logprobs(engine, prompts, args):
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0, n=3)
    samples = engine.generate(prompts, sp)
    assert len(samples) == 6 and all(isinstance(s, Sample) for s in samples)
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.index for s in samples] == list(range(6))
    eos = engine.tokenizer.eos_token_id
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert 1 <= len(s.response_ids) <= 8 and len(s.response_logprobs) == len(s.response_ids)
        assert all(lp <= 0 for lp in s.response_logprobs)
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == eos and eos not in s.response_ids[:-1]
        else:
            assert len(s.response_ids) == 8 and eos not in s.response_ids
        assert s.response_text == engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)
    # the engine's log-probs are what the trainer recomputes with the same weights (no padding effects)
    model, tok, _ = load_policy(args, log=False)
    b = collate_samples(samples, tok.pad_token_id, [0.0] * len(samples))
    with torch.no_grad():
        lp = forward_logprobs(model, b["input_ids"], b["attention_mask"], temperature=sp.temperature)
    diff = ((lp - b["rollout_logprobs"]).abs() * b["loss_mask"]).max().item()
    assert diff < 1e-4


def test_temperature_scaled_logprobs(engine, prompts, args):
    sp = SamplingParams(temperature=0.7, max_new_tokens=5, seed=3, n=2)
    samples = engine.generate(prompts, sp)
    model, tok, _ = load_policy(args, log=False)
    b = collate_samples(samples, tok.pad_token_id, [0.0] * len(samples))
    with torch.no_grad():
        lp = forward_logprobs(model, b["input_ids"], b["attention_mask"], temperature=0.7)
    assert ((lp - b["rollout_logprobs"]).abs() * b["loss_mask"]).max().item() < 1e-4


def test_seed_reproducible_and_greedy(engine, prompts):
    sp = SamplingParams(max_new_tokens=6, seed=11, n=2)
    a = engine.generate(prompts, sp)
    b = engine.generate(prompts, sp)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    c = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=12, n=2))
    assert [s.response_ids for s in a] != [s.response_ids for s in c]
    g = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 6, "n": 2})
    assert g[0].response_ids == g[1].response_ids  # greedy: identical samples
    # batching does not change greedy results (left padding + position ids)
    solo = engine.generate([prompts[1]], {"temperature": 0.0, "max_new_tokens": 6})
    assert solo[0].response_ids == g[2].response_ids


def test_top_p_tiny_keeps_argmax(engine, prompts):
    g = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": 4})
    t = engine.generate(prompts, {"temperature": 1.0, "top_p": 1e-6, "max_new_tokens": 4, "seed": 5})
    assert [s.response_ids for s in g] == [s.response_ids for s in t]


def test_release_resume_bit_exact(engine, prompts, args):
    before = engine.get_weights()
    sp = SamplingParams(max_new_tokens=5, seed=1, n=2)
    out_before = engine.generate(prompts, sp)
    info = engine.release_memory_occupation()
    assert info[WEIGHTS] > 0 and set(info) == {WEIGHTS, KV_CACHE}
    assert engine.release_memory_occupation() == {WEIGHTS: 0, KV_CACHE: 0}  # idempotent
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    assert os.path.isfile(os.path.join(args.paths.engine_dir(0), "offload.bin"))
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        engine.generate(prompts, sp)
    assert engine.resume_memory_occupation()[WEIGHTS] == info[WEIGHTS]
    assert engine.resume_memory_occupation()[WEIGHTS] == 0  # idempotent
    after = engine.get_weights()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    out_after = engine.generate(prompts, sp)
    assert [s.response_ids for s in out_before] == [s.response_ids for s in out_after]
    # a second cycle works too
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert all(torch.equal(before[k], v) for k, v in engine.get_weights().items())


def _update(engine, named, version):
    """One versioned update from (name, tensor) pairs, as the loop's session does it."""
    engine.begin_weight_update(version)
    try:
        stats = engine.update_weights_from_tensor(list(named), load_format=None)
    finally:
        engine.end_weight_update(version)
    return stats["tensors"]


def test_update_weights_in_a_session(engine, prompts):
    """Named-tensor updates inside a session: partial updates, DDP prefixes, versions, refusals."""
    sd = {k: v + 0.01 for k, v in engine.get_weights().items()}
    n = _update(engine, sd.items(), 1)
    assert n == len(sd) and engine.get_weight_version() == 1
    got = engine.get_weights()
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    name = "model.embed_tokens.weight"
    _update(engine, [("module." + name, torch.zeros_like(sd[name]))], 7)
    assert engine.get_weight_version() == 7 and torch.count_nonzero(engine.get_weights()[name]) == 0
    s = engine.generate(prompts, {"max_new_tokens": 2, "seed": 0})
    assert s[0].weight_version == 7
    with pytest.raises(KeyError, match="unknown parameter names"):
        _update(engine, [("nope.weight", torch.zeros(1))], 8)
    with pytest.raises(ValueError, match="shape"):
        _update(engine, [(name, torch.zeros(3))], 8)
    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        _update(engine, sd.items(), 8)
    engine.resume_memory_occupation()
    assert _update(engine, sd.items(), 8) == len(sd)  # a refused update left no session open


def test_string_prompts_and_sampling_from_config(engine, args):
    sp = SamplingParams.from_config(args, rollout_id=3)
    r = args.rollout
    assert (sp.temperature, sp.top_p, sp.max_new_tokens, sp.n, sp.seed) == (
        r.rollout_temperature, r.rollout_top_p, r.rollout_max_response_len, r.n_samples_per_prompt, r.rollout_seed + 3,
    )
    ids = engine.tokenizer("1 + 1 =\nA:")["input_ids"]
    out = engine.generate([ids], SamplingParams(max_new_tokens=3, n=2))
    assert len(out) == 2 and out[0].prompt_ids == ids
    with pytest.raises(TypeError, match="tokenize"):
        engine.generate(["1 + 1 =\nA:"], SamplingParams(max_new_tokens=3))


def test_close_removes_backup(args, prompts):
    eng = EmbeddedRolloutEngine(args, device="cpu", engine_id=5)
    eng.release_memory_occupation()
    d = args.paths.engine_dir(5)
    assert os.path.isdir(d)
    eng.resume_memory_occupation()
    eng.close()
    assert not os.path.exists(d)


def test_release_resume_with_the_default_models_storage_layout(tmp_path):
    """The GGUF-loaded default model has non-resizable storages and tied embeddings; release_memory used
    to fail on it with "Trying to resize storage that is not resizable"."""
    from miles.models import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "hf")  # safetensors: loading mmaps them, like the converted GGUF
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert not loaded.model.embed_tokens.weight.untyped_storage().resizable()
    assert loaded.lm_head.weight.untyped_storage()._cdata == loaded.model.embed_tokens.weight.untyped_storage()._cdata
    for backup in ("disk", "cpu"):
        eng = EmbeddedRolloutEngine(model=loaded, tokenizer=tok, device="cpu", backup=backup,
                                    backup_dir=str(tmp_path / backup))
        before = eng.get_weights()
        sp = SamplingParams(max_new_tokens=4, seed=3, n=2)
        prompt = tok("1 + 2 =\nA:")["input_ids"]
        out = eng.generate([prompt], sp)
        assert eng.release_memory_occupation()[WEIGHTS] > 0
        eng.resume_memory_occupation()
        assert all(torch.equal(before[k], v) for k, v in eng.get_weights().items())
        assert [s.response_ids for s in eng.generate([prompt], sp)] == [s.response_ids for s in out]
        tied = eng.model.lm_head.weight.untyped_storage()._cdata == eng.model.model.embed_tokens.weight.untyped_storage()._cdata
        assert tied
        eng.close()
