"""The rollout-engine contract (miles/rollout/contract.py) on the embedded engine, and its decoders (CPU).

Items: 1 the contract (memory tags, the weight-update session, both update paths), 2 the embedded engine
implements it, 3 the static-cache decoder gives the plain forward's tokens and log-probs.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from miles.models import build_tiny_model, build_tiny_tokenizer
from miles.rollout import SamplingParams
from miles.rollout.contract import KV_CACHE, WEIGHTS, RolloutEngine, check_memory_tags
from miles.rollout.decode import (
    CUDA_CHECK_EVERY,
    DynamicCacheDecoder,
    decode,
    draw_categorical,
    left_pad,
)
from miles.rollout.embedded import EmbeddedRolloutEngine

PROMPTS_TEXT = ["What is 1 + 2?\nA:", "10 + 5 =", "Say hi.\nA:"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t)["input_ids"] for t in PROMPTS_TEXT]


def make_engine(tok, seed=0, **kw):
    kw.setdefault("backup", "cpu")
    return EmbeddedRolloutEngine(model=build_tiny_model(tok, seed=seed), tokenizer=tok, device="cpu", **kw)


@pytest.fixture()
def engine(tok):
    eng = make_engine(tok)
    yield eng
    eng.close()


def shifted(tok, seed=1):
    """Weights of another tiny model: different from the engine's everywhere."""
    return build_tiny_model(tok, seed=seed).state_dict()


# ------------------------------------------------------------------------------ item 1 + 2: the contract


def test_embedded_engine_has_the_contracts_methods_and_signatures(engine):
    assert isinstance(engine, RolloutEngine)
    methods = [n for n, v in vars(RolloutEngine).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert set(methods) >= {"generate", "release_memory_occupation", "resume_memory_occupation",
                            "begin_weight_update", "end_weight_update", "update_weights_from_tensor",
                            "init_weights_update_group", "update_weights_from_distributed",
                            "destroy_weights_update_group", "flush_cache", "get_weight_version", "health", "close"}
    for name in methods:
        want = inspect.signature(getattr(RolloutEngine, name))
        got = inspect.signature(getattr(EmbeddedRolloutEngine, name))
        assert [(p.name, p.default) for p in got.parameters.values()] == \
               [(p.name, p.default) for p in want.parameters.values()], name


def test_check_memory_tags():
    assert check_memory_tags(None) == (WEIGHTS, KV_CACHE)
    assert check_memory_tags([KV_CACHE, WEIGHTS]) == (WEIGHTS, KV_CACHE)
    assert check_memory_tags([]) == ()
    with pytest.raises(ValueError, match="unknown memory tags \\['kv'\\]"):
        check_memory_tags(["kv"])
    with pytest.raises(TypeError, match="\\['weights'\\]"):
        check_memory_tags("weights")


def test_release_and_resume_each_tag_on_its_own(engine, prompts):
    sp = SamplingParams(max_new_tokens=5, seed=2, n=2)
    before_weights = engine.get_weights()
    before = engine.generate(prompts, sp)

    # the dynamic decoder keeps nothing between calls: the report is the largest cache a call built
    assert engine.release_memory_occupation([KV_CACHE])[KV_CACHE] > 0
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] released"):
        engine.generate(prompts, sp)
    assert torch.equal(engine.get_weights()["lm_head.weight"], before_weights["lm_head.weight"])  # still resident

    released = engine.release_memory_occupation([WEIGHTS])
    assert released[WEIGHTS] > 0
    assert engine.release_memory_occupation() == {WEIGHTS: 0, KV_CACHE: 0}  # idempotent per tag
    with pytest.raises(RuntimeError, match=r"\['weights', 'kv_cache'\] released"):
        engine.generate(prompts, sp)

    assert engine.resume_memory_occupation([WEIGHTS]) == {WEIGHTS: released[WEIGHTS]}
    assert all(torch.equal(before_weights[k], v) for k, v in engine.get_weights().items())
    with pytest.raises(RuntimeError, match="resume_memory_occupation\\(\\['kv_cache'\\]\\)"):
        engine.generate(prompts, sp)
    assert engine.resume_memory_occupation([KV_CACHE]) == {KV_CACHE: 0}
    assert engine.resume_memory_occupation() == {WEIGHTS: 0, KV_CACHE: 0}
    assert [s.response_ids for s in engine.generate(prompts, sp)] == [s.response_ids for s in before]


def test_weight_update_session_state_machine(engine, prompts, tok):
    new = shifted(tok)
    name = "model.embed_tokens.weight"
    with pytest.raises(RuntimeError, match="begin_weight_update"):
        engine.update_weights_from_tensor([(name, new[name])], load_format=None)
    with pytest.raises(RuntimeError, match="begin_weight_update"):
        engine.end_weight_update(1)
    with pytest.raises(ValueError, match="int >= 0"):
        engine.begin_weight_update(-1)

    engine.release_memory_occupation()
    with pytest.raises(RuntimeError, match=r"resume_memory_occupation\(\['weights'\]\)"):
        engine.begin_weight_update(1)
    engine.resume_memory_occupation([WEIGHTS])

    engine.begin_weight_update(3)
    with pytest.raises(RuntimeError, match="already open"):
        engine.begin_weight_update(4)
    with pytest.raises(RuntimeError, match="end it first"):
        engine.release_memory_occupation([WEIGHTS])
    engine.resume_memory_occupation([KV_CACHE])
    with pytest.raises(RuntimeError, match="end_weight_update"):
        engine.generate(prompts, {"max_new_tokens": 2})
    stats = engine.update_weights_from_tensor([(name, new[name])], load_format=None, flush_cache=True)
    assert stats == {"tensors": 1, "bytes": new[name].numel() * 4}
    assert engine.get_weight_version() == 0  # not before the session ends
    with pytest.raises(RuntimeError, match="version 3"):
        engine.end_weight_update(4)
    assert engine.end_weight_update(3) == {"version": 3, "tensors": 1, "bytes": stats["bytes"]}
    assert engine.get_weight_version() == 3
    assert {s.weight_version for s in engine.generate(prompts, {"max_new_tokens": 2, "seed": 0})} == {3}
    assert torch.equal(engine.get_weights()[name], new[name])


def test_weights_released_without_a_backup_need_a_complete_update_before_generate(tok, prompts):
    """backup="none" (the RL loop's engines): release copies nothing, and generate is refused until a
    weight update has rewritten every parameter; then it generates with exactly the pushed weights."""
    sp = SamplingParams(max_new_tokens=4, seed=2)
    engine, reference = make_engine(tok, backup="none"), make_engine(tok, seed=1)
    new = shifted(tok)
    try:
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        with pytest.raises(RuntimeError, match="released without a backup"):
            engine.generate(prompts, sp)
        names = [n for n, _ in engine.model.named_parameters()]
        engine.begin_weight_update(1)
        engine.update_weights_from_tensor([(n, new[n]) for n in names[:-1]], load_format=None)
        engine.end_weight_update(1)
        with pytest.raises(RuntimeError, match="released without a backup"):  # one parameter still undefined
            engine.generate(prompts, sp)
        engine.begin_weight_update(2)
        engine.update_weights_from_tensor([(names[-1], new[names[-1]])], load_format=None)
        engine.end_weight_update(2)
        assert all(torch.equal(v, new[k]) for k, v in engine.get_weights().items())
        assert [s.response_ids for s in engine.generate(prompts, sp)] == \
               [s.response_ids for s in reference.generate(prompts, sp)]
        # buffers are not released without a backup (an update does not send them)
        assert all(b.untyped_storage().nbytes() for b in engine.model.buffers())
    finally:
        engine.close()
        reference.close()


def test_update_from_named_tensors_checks_everything_before_copying(engine, tok):
    before = engine.get_weights()
    new = shifted(tok)
    engine.begin_weight_update(1)
    unknown = [(f"nope{i}.weight", torch.zeros(1)) for i in range(7)]
    with pytest.raises(KeyError, match=r"unknown parameter names \['nope0.weight'.*and 2 more"):
        engine.update_weights_from_tensor(list(new.items()) + unknown, load_format=None)
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(3,\)"):
        engine.update_weights_from_tensor(list(new.items()) + [("lm_head.weight", torch.zeros(3))], load_format=None)
    with pytest.raises(ValueError, match="load_format"):
        engine.update_weights_from_tensor(list(new.items()), load_format="direct")
    assert all(torch.equal(before[k], v) for k, v in engine.get_weights().items())  # nothing was copied
    # dtype converted with copy_, DDP's module. prefix stripped
    bf16 = [("module." + k, v.to(torch.bfloat16)) for k, v in new.items()]
    stats = engine.update_weights_from_tensor(bf16, load_format=None)
    assert stats == {"tensors": len(new), "bytes": sum(v.numel() * 2 for v in new.values())}
    engine.end_weight_update(1)
    got = engine.get_weights()
    assert all(torch.equal(got[k], v.to(torch.bfloat16).float()) for k, v in new.items())


def test_update_from_flattened_buckets(engine, tok, prompts, tmp_path):
    from miles.weights import iter_buckets, share_bucket

    new = shifted(tok)
    engine.begin_weight_update(5)
    total = {"tensors": 0, "bytes": 0}
    for spec, flat in iter_buckets(new.items(), max_bytes=64 * 1024):
        shared = share_bucket(spec, flat, shm_dir=str(tmp_path))
        with pytest.raises(ValueError, match="one payload"):
            engine.update_weights_from_tensor([shared, shared])
        stats = engine.update_weights_from_tensor([shared])
        shared.release()
        assert stats["tensors"] == len(spec.tensors)
        total = {k: total[k] + stats[k] for k in total}
    with pytest.raises(TypeError, match="SharedBucket"):
        engine.update_weights_from_tensor([list(new.items())])
    assert engine.end_weight_update(5) == {"version": 5, **total}
    assert total["tensors"] == len(new)
    assert list(tmp_path.iterdir()) == []
    got = engine.get_weights()
    assert all(torch.equal(got[k], v) for k, v in new.items())
    reference = make_engine(tok, seed=1)
    sp = SamplingParams(max_new_tokens=6, seed=4, n=2)
    assert [s.response_ids for s in engine.generate(prompts, sp)] == \
           [s.response_ids for s in reference.generate(prompts, sp)]
    reference.close()


def _gloo_trainer(port, buckets, errors):
    """Train rank 0 in its own process (a process holds one end of a named group: torch's registry)."""
    import torch

    from miles.weights import BucketSpec, WeightUpdateGroup, send_buckets

    try:
        group = WeightUpdateGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                  backend="gloo", group_name="weights-test", timeout_s=60)
        send_buckets(group, [(BucketSpec.from_dict(d), torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                             for d, raw in buckets], src=0)
        group.destroy()
    except BaseException as e:  # noqa: BLE001 - reported by the assertion below
        errors.put(repr(e))


def test_update_from_distributed_over_gloo(engine, tok):
    import multiprocessing

    from miles.weights import free_port, iter_buckets

    new = shifted(tok)
    buckets = list(iter_buckets(new.items(), max_bytes=32 * 1024))
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    trainer = ctx.Process(target=_gloo_trainer,
                          args=(port, [(spec.to_dict(), flat.numpy().tobytes()) for spec, flat in buckets], errors))
    trainer.start()
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, "weights-test", "gloo")
    with pytest.raises(ValueError, match="already joined"):
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, "weights-test", "gloo")
    engine.begin_weight_update(2)
    stats = engine.update_weights_from_distributed([spec.to_dict() for spec, _ in buckets], "weights-test", src=0)
    engine.end_weight_update(2)
    trainer.join(60)
    assert trainer.exitcode == 0 and errors.empty(), errors.get() if not errors.empty() else trainer.exitcode
    assert stats == {"tensors": len(new), "bytes": sum(v.numel() * v.element_size() for v in new.values())}
    got = engine.get_weights()
    assert all(torch.equal(got[k], v) for k, v in new.items())
    engine.destroy_weights_update_group("weights-test")
    with pytest.raises(KeyError, match="has not joined"):
        engine.destroy_weights_update_group("weights-test")
    with pytest.raises(ValueError, match="nccl"):
        engine.init_weights_update_group("127.0.0.1", port, 1, 2, "other", "nccl")


def test_generate_checks_its_inputs(engine, prompts):
    out = engine.generate(prompts, {"max_new_tokens": 3, "seed": 0}, return_logprob=False)
    assert all(s.response_logprobs == [] and s.response_ids for s in out)
    with pytest.raises(TypeError, match="tokenize"):
        engine.generate(["a prompt"])
    with pytest.raises(ValueError, match=r"input_ids\[1\] has token ids \[100, -1\] outside"):
        engine.generate([prompts[0], [5, 100, -1]])
    with pytest.raises(ValueError, match=r"input_ids\[0\] is empty"):
        engine.generate([[]])
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate(prompts, {"top_p": 0.0})
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate(prompts, {"temperature": -1.0})


def test_health_and_close(tok):
    eng = make_engine(tok)
    assert eng.health()
    eng.close()
    assert not eng.health()


def test_contract_docs_name_every_method():
    """docs/dev/contracts.md documents the contract: every method is named in its Rollout engine section."""
    import pathlib

    text = (pathlib.Path(__file__).parents[2] / "docs/dev/contracts.md").read_text()
    section = text.split("## Rollout engine", 1)[1].split("\n## ", 1)[0]
    for name, value in vars(RolloutEngine).items():
        if inspect.isfunction(value) and not name.startswith("_"):
            assert name in section, name


# ------------------------------------------------------------------------------ item 3: the decoders


def full_forward_logprobs(model, prompt, response, temperature):
    """log_softmax(logits / T) of each response token, from one forward over prompt + response (no padding,
    no cache), and the argmax at each response position."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) + len(response) - 1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1), logits.argmax(-1)


@pytest.mark.parametrize("static_cache", [True, False])
def test_greedy_tokens_and_logprobs_match_the_full_forward(tok, prompts, static_cache):
    eng = make_engine(tok, static_cache=static_cache)
    assert eng.static_cache is static_cache and not eng.cuda_graphs
    stop = (10**6,)  # never generated: every row runs the whole length
    out = eng.generate(prompts, {"temperature": 0.0, "max_new_tokens": 12, "stop_token_ids": stop})
    for s in out:
        lp, argmax = full_forward_logprobs(eng.model, s.prompt_ids, s.response_ids, 0.0)
        assert s.response_ids == argmax.tolist()
        assert torch.allclose(torch.tensor(s.response_logprobs), lp, atol=1e-5, rtol=0)
    # batching (left padding, spare rows of the batch bucket) changes nothing
    solo = eng.generate([prompts[1]], {"temperature": 0.0, "max_new_tokens": 12, "stop_token_ids": stop})
    assert solo[0].response_ids == out[1].response_ids
    eng.close()


def test_static_and_dynamic_sample_the_same_tokens(tok, prompts):
    sp = SamplingParams(temperature=0.8, max_new_tokens=10, seed=9, n=3)
    static, dynamic = make_engine(tok, static_cache=True), make_engine(tok, static_cache=False)
    a, b = static.generate(prompts, sp), dynamic.generate(prompts, sp)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for s in a:
        lp, _ = full_forward_logprobs(static.model, s.prompt_ids, s.response_ids, sp.temperature)
        assert torch.allclose(torch.tensor(s.response_logprobs), lp, atol=1e-5, rtol=0)
    static.close()
    dynamic.close()


def test_top_p_sampled_logprobs_are_the_unfiltered_softmax(tok, prompts):
    eng = make_engine(tok, static_cache=True)
    out = eng.generate(prompts, SamplingParams(temperature=0.7, top_p=0.5, max_new_tokens=8, seed=1, n=2))
    for s in out:
        lp, _ = full_forward_logprobs(eng.model, s.prompt_ids, s.response_ids, 0.7)
        assert torch.allclose(torch.tensor(s.response_logprobs), lp, atol=1e-5, rtol=0)
    eng.close()


def test_static_decoders_are_kept_and_released_as_kv_cache(tok, prompts):
    eng = make_engine(tok, static_cache=True)
    sp = SamplingParams(max_new_tokens=6, seed=3, n=2)
    first = eng.generate(prompts, sp)
    again = eng.generate(prompts, sp)  # the same shape bucket: the decoder is reused, reset in between
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    freed = eng.release_memory_occupation([KV_CACHE])[KV_CACHE]
    # one bucket: batch 6 -> 8 rows, cache length -> 128 slots, 2 layers x (K, V) x 2 heads x 16 dims fp32
    assert freed >= 8 * 128 * 2 * 2 * 2 * 16 * 4
    assert eng.release_memory_occupation([KV_CACHE])[KV_CACHE] == 0
    eng.resume_memory_occupation([KV_CACHE])
    assert [s.response_ids for s in eng.generate(prompts, sp)] == [s.response_ids for s in first]
    eng.close()


def test_static_cache_refuses_sliding_window_models(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0, layer_types=["sliding_attention"] * 2)
    model = Qwen2ForCausalLM(config)
    with pytest.raises(ValueError, match="sliding-window"):
        EmbeddedRolloutEngine(model=model, tokenizer=tok, device="cpu", backup="cpu", static_cache=True)
    eng = EmbeddedRolloutEngine(model=model, tokenizer=tok, device="cpu", backup="cpu")
    assert not eng.static_cache
    eng.close()
    with pytest.raises(ValueError, match="cuda_graphs=True needs a static cache on CUDA"):
        make_engine(tok, cuda_graphs=True)


def test_draws_are_multinomials():
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(32, 100, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    probs[:, 7] = 0.0
    for _ in range(4):
        assert torch.equal(draw_categorical(probs, gen_a), torch.multinomial(probs, 1, generator=gen_b).squeeze(-1))


def test_checking_for_the_end_every_k_tokens_gives_the_same_result(tok, prompts):
    """On CUDA the all-finished check runs every CUDA_CHECK_EVERY tokens; rows that stopped only get padding."""
    model = build_tiny_model(tok).eval()
    ids, valid = left_pad(prompts, tok.pad_token_id, torch.device("cpu"))
    # stop at the first greedy token of row 0: that row stops at once, the others run on
    with torch.no_grad():
        first = model(input_ids=ids[:1, valid[0]]).logits[0, -1].argmax().item()
    results = []
    for every in (1, CUDA_CHECK_EVERY):
        results.append(decode(DynamicCacheDecoder(model, 40), ids, valid, max_new_tokens=40, temperature=0.0, top_p=1.0,
                              stop_ids=(first,), pad_id=tok.pad_token_id, generator=torch.Generator(),
                              check_every=every))
    (tok1, lp1), (tok16, lp16) = results
    width = min(tok1.shape[1], tok16.shape[1])
    assert torch.equal(tok1[:, :width], tok16[:, :width]) and torch.equal(lp1[:, :width], lp16[:, :width])
    assert (tok16[:, width:] == tok.pad_token_id).all()  # the extra steps only padded finished rows
    assert tok1[0, 0] == first and (tok1[0, 1:] == tok.pad_token_id).all()
