"""R3 on tiny random transformers MoE models (fp32, CPU): the embedded engine records every MoE layer's experts
in the prefill and each decode step, and a training-style forward (right-padded rows, miles.rl.loss) replays
them, with the gate weights recomputed from the trainer's own router logits so gradients reach the router.

What the forced-mismatch tests assert, precisely: replay always restores the recorded experts in every layer
(engine-recorded routes, a batch of every sample). The log-probs equal the unperturbed model's only where the
perturbation leaves the recorded experts' gate weights unchanged; these tests replay the routes the unperturbed
model chose in a forward over one sample (no padding, every token covered, so nothing routes naturally): bitwise
for the sigmoid routers (GLM-5, DeepSeek-V3) under a perturbed selection bias (it only chooses; the weights are
the sigmoids of the logits); up to fp32 rounding for the softmax routers, whose renormalised weights depend only
on the chosen experts' logits, when the router rows perturbed are of experts those routes never chose in that
layer (the softmax's denominator changes). With padding or an uncovered last token, tokens routed naturally
change which rows each expert's matmul takes, which may move results by an ulp. A perturbation of every router
row changes the recomputed weights too: then replay only brings the log-probs closer to the unperturbed ones
than the perturbed model's own routing does.
"""

import copy
import functools
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tiny_models import TOKENIZER, tiny_model  # noqa: E402
from miles.rl.loss import collate_samples, forward_logprobs
from miles.rollout.embedded import EmbeddedRolloutEngine
from miles.rollout.types import SamplingParams
from miles.routing import Routes
from miles.routing.record import RouteRecorder
from miles.routing.replay import RouteReplay
from miles.routing.routers import find_routers, route_shape, route_shape_of_config

SOFTMAX_PRESETS = ("qwen3-moe-tiny", "qwen3.5-moe-tiny", "mixtral-tiny")
SIGMOID_PRESETS = ("glm5-tiny", "deepseek-v3-tiny")
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17, 18, 19]]
MAX_NEW_TOKENS = 6




@functools.lru_cache(maxsize=None)
def _recorded_samples(model, static_cache=False):
    """Greedy samples of PROMPTS with routes, generated three at a time (a static decoder runs 4 rows, one of them
    spare, then 1); the stop id is the third token the model generates for the second prompt, so that row ends
    early and the others (most likely) do not."""
    engine = EmbeddedRolloutEngine(model=copy.deepcopy(model), tokenizer=TOKENIZER, device="cpu",
                                   static_cache=static_cache, record_routes=True, max_batch_size=3)
    try:
        free = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS,
                                                       stop_token_ids=()))
        stop = free[1].response_ids[2]
        return tuple(engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS,
                                                             stop_token_ids=(stop,))))
    finally:
        engine.close()


def _natural_routes(model, input_ids, attention_mask=None):
    """[rows, T, layers, top_k] int64 experts of a plain forward, each token's top-k sorted."""
    recorder = RouteRecorder(model)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=attention_mask)
        ids = recorder.take().long()
    finally:
        recorder.close()
    return ids.view(*input_ids.shape, *ids.shape[1:]).sort(dim=-1).values


def _batch(samples):
    return collate_samples(samples, TOKENIZER.pad_token_id, advantages=[0.0] * len(samples))


def _logprobs(model, batch, samples=None, force=True):
    """Log-probs of the batch's targets, replaying the samples' routes when given; and the replay."""
    if samples is None:
        with torch.no_grad():
            return forward_logprobs(model, batch["input_ids"], batch["attention_mask"]), None
    with RouteReplay(model, [s.routes for s in samples], batch["attention_mask"], force=force) as replay, \
            torch.no_grad():
        return forward_logprobs(model, batch["input_ids"], batch["attention_mask"]), replay


def _response_logprobs(logprobs, batch):
    return logprobs[batch["loss_mask"].bool()]


@pytest.mark.parametrize("preset, static_cache", [*[(p, False) for p in SOFTMAX_PRESETS + SIGMOID_PRESETS],
                                                  ("qwen3-moe-tiny", True), ("mixtral-tiny", True),
                                                  ("deepseek-v3-tiny", True)])
def test_generate_records_the_experts_a_full_forward_chooses(preset, static_cache):
    model = tiny_model(preset)
    samples = _recorded_samples(model, static_cache)
    shape = route_shape(model)
    assert len({len(s.response_ids) for s in samples}) > 1, "rows of different lengths: padding and early stops"
    for s in samples:
        sequence = s.prompt_ids + s.response_ids
        assert s.routes.shape == shape and s.routes.tokens == len(sequence) - 1
        natural = _natural_routes(model, torch.tensor([sequence]))[0, :-1]
        assert torch.equal(s.routes.expert_ids().sort(dim=-1).values, natural), f"sample {s.index}"


def test_the_engine_records_nothing_unless_asked_and_refuses_a_dense_model():
    engine = EmbeddedRolloutEngine(model=copy.deepcopy(tiny_model("qwen3-moe-tiny")), tokenizer=TOKENIZER, device="cpu")
    assert all(s.routes is None for s in engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW_TOKENS)))
    engine.close()
    with pytest.raises(ValueError, match="recording routes needs an MoE model; LlamaForCausalLM has no MoE router"):
        EmbeddedRolloutEngine(model=copy.deepcopy(tiny_model("llama-tiny")), tokenizer=TOKENIZER, device="cpu",
                              record_routes=True)


def test_route_shapes_of_a_config_and_of_its_model_agree():
    for preset in SOFTMAX_PRESETS + SIGMOID_PRESETS:
        model = tiny_model(preset)
        assert route_shape_of_config(model.config.to_dict()) == route_shape(model) is not None, preset
    assert route_shape_of_config(tiny_model("llama-tiny").config.to_dict()) is None


def _with_own_routes(model, samples):
    """The samples with the routes ``model`` chooses in a forward over their batch (every token covered), that
    batch and the forward's log-probs."""
    batch = _batch(samples)
    recorder = RouteRecorder(model)
    natural, _ = _logprobs(model, batch)
    ids = recorder.take().view(*batch["input_ids"].shape, recorder.shape.layers, recorder.shape.top_k)
    recorder.close()
    rows = [copy.copy(s) for s in samples]
    for row, s in enumerate(rows):
        s.routes = Routes.from_expert_ids(ids[row, :len(s.prompt_ids) + len(s.response_ids)], recorder.shape)
    return rows, batch, natural


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", SOFTMAX_PRESETS + SIGMOID_PRESETS)
def test_replaying_a_forward_s_own_routes_changes_nothing(preset, dtype):
    """Bitwise: the family's gate weights recomputed over its own choice, in its order, are the router's."""
    model = copy.deepcopy(tiny_model(preset)).to(dtype)
    samples, batch, natural = _with_own_routes(model, _recorded_samples(tiny_model(preset)))
    replayed, replay = _logprobs(model, batch, samples)
    assert torch.equal(replayed, natural)
    assert replay.mismatch_shares() == [0.0] * len(find_routers(model))


def _perturb_all_routers(model, seed=1):
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for site in find_routers(model):
            site.module.weight.add_(torch.randn_like(site.module.weight) * 4 * site.module.weight.std())


@pytest.mark.parametrize("preset", SOFTMAX_PRESETS + SIGMOID_PRESETS)
def test_replay_gives_the_trainer_the_recorded_experts_in_every_layer(preset):
    model = tiny_model(preset)
    samples = _recorded_samples(model)
    batch = _batch(samples)
    perturbed = copy.deepcopy(model)
    _perturb_all_routers(perturbed)

    _, compared = _logprobs(perturbed, batch, samples, force=False)
    assert compared.mismatch_shares()[0] > 0, "the perturbed router routes some tokens elsewhere"

    with RouteReplay(perturbed, [s.routes for s in samples], batch["attention_mask"]):
        seen = _natural_routes(perturbed, batch["input_ids"], batch["attention_mask"])  # hooked after the replay's
    for row, s in enumerate(samples):
        recorded = s.routes.expert_ids().sort(dim=-1).values
        assert torch.equal(seen[row, :s.routes.tokens], recorded), f"sample {s.index}"

    unperturbed = _response_logprobs(_logprobs(model, batch)[0], batch)
    natural = _response_logprobs(_logprobs(perturbed, batch)[0], batch)
    replayed = _response_logprobs(_logprobs(perturbed, batch, samples)[0], batch)
    assert (replayed - unperturbed).abs().mean() < (natural - unperturbed).abs().mean()


@pytest.mark.parametrize("preset", SIGMOID_PRESETS)
def test_replay_undoes_a_perturbed_selection_bias_exactly(preset):
    model = tiny_model(preset)
    samples, batch, unperturbed = _with_own_routes(model, _recorded_samples(model)[:1])
    perturbed = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(2)
        for site in find_routers(perturbed):
            site.module.e_score_correction_bias.copy_(torch.randn(site.num_experts))

    natural, compared = _logprobs(perturbed, batch, samples, force=False)
    assert min(compared.mismatch_shares()) > 0
    assert not torch.allclose(natural, unperturbed, atol=1e-4)
    assert torch.equal(_logprobs(perturbed, batch, samples)[0], unperturbed)


@pytest.mark.parametrize("preset", SOFTMAX_PRESETS)
def test_replay_undoes_perturbed_rows_of_unchosen_experts_up_to_rounding(preset):
    model = tiny_model(preset)
    samples, batch, unperturbed = _with_own_routes(model, _recorded_samples(model)[:1])
    recorded = samples[0].routes.expert_ids()
    perturbed = copy.deepcopy(model)
    layers = 0
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(3)
        for site in find_routers(perturbed):
            unchosen = sorted(set(range(site.num_experts)) - set(recorded[:, site.layer].flatten().tolist()))
            # a direction and its opposite: whichever way the tokens' hidden states lean, one of the two unchosen
            # experts' logits rises far above the others' (not so far that the chosen experts' softmax underflows:
            # their renormalised weights would be 0 / 0)
            direction = torch.randn_like(site.module.weight[0]).sign()
            for expert, sign in zip(unchosen, (1, -1)):
                site.module.weight[expert] += sign * direction
            layers += bool(unchosen)
    assert layers > 0

    natural, compared = _logprobs(perturbed, batch, samples, force=False)
    assert max(compared.mismatch_shares()) > 0
    assert not torch.allclose(natural, unperturbed, atol=1e-4)
    torch.testing.assert_close(_logprobs(perturbed, batch, samples)[0], unperturbed, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", SOFTMAX_PRESETS + SIGMOID_PRESETS)
def test_gradients_reach_the_routers_under_replay(preset):
    model = tiny_model(preset)
    samples, batch, _ = _with_own_routes(model, _recorded_samples(model))
    routers = [site.module.weight for site in find_routers(model)]

    def router_grads(perturb_routes):
        model.zero_grad(set_to_none=True)
        replayed = [copy.deepcopy(s) for s in samples]
        if perturb_routes:  # every token of every layer on other experts: a forced mismatch
            for s in replayed:
                shape = s.routes.shape
                s.routes = Routes.from_expert_ids((s.routes.expert_ids() + 3) % shape.num_experts, shape)
        with RouteReplay(model, [s.routes for s in replayed], batch["attention_mask"]):
            logprobs = forward_logprobs(model, batch["input_ids"], batch["attention_mask"])
            (logprobs * batch["loss_mask"]).sum().backward()
        return [w.grad.clone() for w in routers]

    model.zero_grad(set_to_none=True)
    (forward_logprobs(model, batch["input_ids"], batch["attention_mask"]) * batch["loss_mask"]).sum().backward()
    plain = [w.grad.clone() for w in routers]
    same = router_grads(perturb_routes=False)
    other = router_grads(perturb_routes=True)
    for layer, (p, s, o) in enumerate(zip(plain, same, other)):
        assert torch.equal(s, p), f"layer {layer}: the replay of the model's own routes has its router gradient"
        assert o.abs().sum() > 0 and torch.isfinite(o).all() and not torch.equal(o, p), f"layer {layer}"


def test_a_replay_refuses_routes_of_another_length_and_a_forward_of_another_grid():
    model = tiny_model("qwen3-moe-tiny")
    samples = _recorded_samples(model)
    batch = _batch(samples)
    short = batch["attention_mask"].clone()
    short[0, 2:] = 0  # row 0 cut to 2 tokens
    with pytest.raises(ValueError, match=r"routes of \d+ tokens for a sequence of 2 tokens"):
        RouteReplay(model, [s.routes for s in samples], short)
    bad = bytearray(samples[1].routes.ids)
    bad[5] = 200
    with pytest.raises(ValueError, match="expert id 200 is outside 0..7"):
        RouteReplay(model, [samples[0].routes, Routes(samples[1].routes.shape, bytes(bad)),
                            *[s.routes for s in samples[2:]]], batch["attention_mask"])
    with pytest.raises(ValueError, match="4 routes for a batch of 2 rows"):
        RouteReplay(model, [s.routes for s in samples], batch["attention_mask"][:2])
    with RouteReplay(model, [s.routes for s in samples], batch["attention_mask"]), \
            pytest.raises(RuntimeError, match=r"routed \d+ tokens; the replay was prepared for a \[B, T\] grid"):
        forward_logprobs(model, batch["input_ids"][:2], batch["attention_mask"][:2])


def test_an_moe_family_without_a_known_router_is_refused_by_name():
    from transformers import AutoConfig

    from miles.routing import UnsupportedRouterError

    config = AutoConfig.for_model("qwen2_moe", vocab_size=100, hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedRouterError, match=r"model.layers.0.mlp \(Qwen2MoeSparseMoeBlock\)"):
        RouteRecorder(model)
    with pytest.raises(UnsupportedRouterError, match="supported routers: .*Qwen3MoeTopKRouter"):
        route_shape_of_config(config.to_dict())
