"""--use-rollout-routing-replay (R3) end to end on the torch backend, CPU, a tiny random Qwen3-MoE: the embedded
engine records each sample's routes, the samples travel to the train rank (pickled, as Ray sends them), and the
train step's forward runs on them. Asserted directly: every MoE layer's experts in the trainer's forward equal the
recorded ones on every token a route covers, also when the trainer's routers are perturbed so that their own
choice differs (a forced mismatch, which the step's routing_replay_mismatch_* metrics then report). In bf16 the
train/rollout log-prob mean |diff| with and without R3 is printed, not asserted (its direction on a 2-layer random
model is not a property of R3). The flag's validation is at the end."""

import contextlib
import functools
import pickle

import pytest
import torch

from miles.backends.torch_backend.trainer import TorchTrainer
from miles.config import ArgumentError, parse_args
from miles.metrics import format_rollout_line, rollout_record
from miles.models import write_random_model
from miles.preflight import validate_args
from miles.rollout.embedded import EmbeddedRolloutEngine
from miles.rollout.types import SamplingParams
from miles.routing.record import RouteRecorder
from miles.routing.replay import route_grid
from miles.routing.routers import find_routers
from test_trainer_checkpoint import _rendezvous, trainers  # noqa: F401  (trainers: a fixture)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17, 18, 19]]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 0.75, -0.75]


@functools.lru_cache(maxsize=None)
def _model_folder(root: str, dtype: str) -> str:
    return write_random_model(f"{root}/qwen3-moe-{dtype}", "qwen3-moe-tiny", dtype=dtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("r3"))
    return lambda dtype: _model_folder(root, dtype)


def _config(tmp_path, folder, *flags):
    return validate_args(parse_args(["--hf-checkpoint", folder, "--model-dtype", "fp32", "--micro-batch-size", "3",
                                     "--offload-train-disk-dir", str(tmp_path / "offload"),
                                     "--metrics-file", str(tmp_path / "metrics.jsonl"), *flags]))


def _recorded_samples(config):
    """Two samples per prompt with routes, as the run's engine makes them, through pickle (Ray's way)."""
    engine = EmbeddedRolloutEngine(config, engine_id=0, backup="none", device="cpu",
                                   record_routes=config.training.use_rollout_routing_replay)
    try:
        samples = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, n=2))
    finally:
        engine.close()
    return pickle.loads(pickle.dumps(samples))


def _trainer(config, trainers):
    trainer = TorchTrainer(config, rank=0, world_size=1)
    trainers.append(trainer)
    trainer.init(_rendezvous())
    return trainer


def _watch_chosen_experts(engine):
    """Wrap ``engine.route_replay``: inside each replay a recorder registered after the replay's hooks sees the
    experts the forward ran (the forced ones); returns the list of ``(chosen, recorded, covered)`` per micro-batch,
    ``[B * T, layers, top_k]`` sorted per token, and ``covered`` ``[B * T]``."""
    seen = []
    real = engine.route_replay

    @contextlib.contextmanager
    def watched(routes, batch):
        with real(routes, batch) as replay:
            recorder = RouteRecorder(engine.model)
            try:
                yield replay
                chosen = recorder.take().long().sort(dim=-1).values
            finally:
                recorder.close()
        recorded, covered = route_grid(routes, batch["attention_mask"].bool(), routes[0].shape)
        seen.append((chosen, recorded.sort(dim=-1).values, covered))

    engine.route_replay = watched
    return seen


def _assert_recorded_experts_ran(seen, samples):
    assert seen, "no micro-batch ran under the replay"
    covered_tokens = 0
    for chosen, recorded, covered in seen:
        assert torch.equal(chosen[covered], recorded[covered])
        covered_tokens += int(covered.sum())
    assert covered_tokens == sum(s.routes.tokens for s in samples)


def _perturb_routers(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for site in find_routers(model):
            weight = site.module.weight
            weight.add_(torch.randn(weight.shape, generator=g).to(weight) * 3 * weight.float().std().to(weight))


def test_replay_runs_the_recorded_experts_in_every_layer(tmp_path, models, trainers):
    config = _config(tmp_path, models("fp32"), "--use-rollout-routing-replay")
    samples = _recorded_samples(config)
    assert all(s.routes is not None and s.routes.tokens == len(s.prompt_ids) + len(s.response_ids) - 1
               for s in samples)
    trainer = _trainer(config, trainers)
    seen = _watch_chosen_experts(trainer.engine)
    metrics = trainer.train(0, samples, ADVANTAGES)
    assert metrics["step_skipped"] is None
    _assert_recorded_experts_ran(seen, samples)
    # same fp32 weights: the trainer's natural routing is the engine's, up to a near tie's rounding
    assert metrics["routing_replay_mismatch_first"] <= 0.02
    assert metrics["routing_replay_mismatch_last"] <= 0.05


def test_replay_undoes_a_perturbed_routers_choice(tmp_path, models, trainers):
    config = _config(tmp_path, models("fp32"), "--use-rollout-routing-replay")
    samples = _recorded_samples(config)
    trainer = _trainer(config, trainers)
    _perturb_routers(trainer.engine.model)
    seen = _watch_chosen_experts(trainer.engine)
    metrics = trainer.train(0, samples, ADVANTAGES)
    _assert_recorded_experts_ran(seen, samples)
    # the perturbed routers would choose otherwise: the step reports it, per first and last MoE layer
    assert metrics["routing_replay_mismatch_first"] > 0.2
    assert metrics["routing_replay_mismatch_last"] > 0.2
    timings = {"generate_seconds": 1.0, "train_seconds": 1.0, "sleep_seconds": 0.0, "wake_seconds": 0.0,
               "step_seconds": 2.0}
    record = rollout_record(0, [1.0] * len(samples), samples, [metrics], [], [], timings, None)
    for key in ("routing_replay_mismatch_first", "routing_replay_mismatch_last"):
        assert record[key] == metrics[key], key
    first, last = (100 * metrics[f"routing_replay_mismatch_{k}"] for k in ("first", "last"))
    assert f" r3 {first:.1f}%..{last:.1f}%" in format_rollout_line(record, 1)


def test_bf16_logprob_mismatch_with_and_without_replay(tmp_path, models, trainers):
    """Printed: the bf16 engine's and trainer's log-prob mean |diff| and route mismatch, with R3 and without."""
    folder = models("bf16")
    with_r3 = _config(tmp_path / "r3", folder, "--use-rollout-routing-replay", "--model-dtype", "bf16")
    without = _config(tmp_path / "plain", folder, "--model-dtype", "bf16")
    samples = _recorded_samples(with_r3)
    plain_samples = [s.__class__(**{**s.__dict__, "routes": None}) for s in samples]
    replayed = _trainer(with_r3, trainers).train(0, samples, ADVANTAGES)
    natural = _trainer(without, trainers).train(0, plain_samples, ADVANTAGES)
    print(f"\nbf16 qwen3-moe-tiny, {len(samples)} samples: train/rollout log-prob mean |diff| with R3 "
          f"{replayed['train_rollout_logprob_abs_diff']:.4g} (max {replayed['train_rollout_logprob_abs_diff_max']:.3g}), "
          f"without {natural['train_rollout_logprob_abs_diff']:.4g} (max "
          f"{natural['train_rollout_logprob_abs_diff_max']:.3g}); natural route differs from the recorded one in "
          f"{100 * replayed['routing_replay_mismatch_first']:.1f}% (first MoE layer) and "
          f"{100 * replayed['routing_replay_mismatch_last']:.1f}% (last) of the tokens")
    assert "routing_replay_mismatch_first" not in natural
    for metrics in (replayed, natural):
        assert metrics["step_skipped"] is None


def test_samples_without_routes_are_refused_under_the_flag(tmp_path, models, trainers):
    config = _config(tmp_path, models("fp32"), "--use-rollout-routing-replay")
    samples = [s.__class__(**{**s.__dict__, "routes": None}) for s in _recorded_samples(config)]
    with pytest.raises(ValueError, match="carry no routes"):
        _trainer(config, trainers).train(0, samples, ADVANTAGES)


@pytest.mark.parametrize("flags, refusal", [
    ((), "the default model is dense"),
    (("--hf-checkpoint", "LLAMA"), "has no MoE layer"),
])
def test_validation_refuses_what_cannot_replay(tmp_path, models, flags, refusal):
    llama = write_random_model(str(tmp_path / "llama"), "llama-tiny", dtype="fp32")
    flags = [{"LLAMA": llama, "MOE": models("fp32")}.get(f, f) for f in flags]
    with pytest.raises(ArgumentError, match=refusal):
        validate_args(parse_args(["--use-rollout-routing-replay", "--offload-train-disk-dir", str(tmp_path / "o"),
                                  "--metrics-file", str(tmp_path / "m.jsonl"), *flags]))


# ---- sglang's routed experts (meta_info.routed_experts) as routes ------------------------------------------------


def _sglang_payload(ids):
    """sglang's encoding: base64 of little-endian int32 [tokens, num_hidden_layers, top_k]."""
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode("ascii")


def _glm5_tiny_config():
    from miles.models import RANDOM_MODEL_PRESETS

    return dict(RANDOM_MODEL_PRESETS["glm5-tiny"], vocab_size=128)


def test_sglang_routed_experts_keep_the_moe_layers_rows():
    """GLM-5 tiny: decoder layer 0 is dense (sglang's row of zeros), layers 1 and 2 route; 4 tokens recorded for a
    sequence of 5 (sglang records all but the last)."""
    from miles.rollout.sglang.routes import RoutedExpertsLayout
    from miles.routing import RoutesError

    layout = RoutedExpertsLayout.of_config(_glm5_tiny_config())
    assert (layout.decoder_layers, layout.moe_layers, layout.shape.layers, layout.shape.top_k) == (3, (1, 2), 2, 2)
    g = torch.Generator().manual_seed(0)
    moe = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(4 * 2)]).view(4, 2, 2)
    record = torch.cat([torch.zeros(4, 1, 2, dtype=torch.long), moe], dim=1)  # [tokens, decoder layers, top_k]
    routes = layout.routes(_sglang_payload(record), sequence_tokens=5)
    assert torch.equal(routes.expert_ids(), moe)
    with pytest.raises(RoutesError, match="cover all its tokens or all but the last"):
        layout.routes(_sglang_payload(record), sequence_tokens=9)
    with pytest.raises(RoutesError, match="no whole number of tokens"):
        layout.routes(_sglang_payload(record.flatten()[:-1]), sequence_tokens=5)
    with pytest.raises(RoutesError, match="outside 0..7"):
        layout.routes(_sglang_payload(record + 8), sequence_tokens=5)
    with pytest.raises(RoutesError, match="at most"):
        layout.routes(_sglang_payload(record), sequence_tokens=2)


def test_sglang_samples_carry_routes_and_a_server_without_them_is_named():
    from miles.rollout.sglang.engine import samples_from_outputs
    from miles.rollout.sglang.routes import RoutedExpertsLayout
    from miles.rollout.sglang.transport import SglangCallError

    layout = RoutedExpertsLayout.of_config(_glm5_tiny_config())
    record = [[[0, 0], [1, 2], [3, 4]]] * 3  # prompt of 2 + response of 2 = 4 tokens: 3 recorded
    meta = {"finish_reason": {"type": "length", "length": 2}, "output_token_logprobs": [[-0.5, 3, None],
                                                                                        [-0.1, 4, None]]}
    out = {"output_ids": [3, 4], "meta_info": {**meta, "routed_experts": _sglang_payload(record)}}
    (sample,) = samples_from_outputs([out], [[1, 2]], 1, True, 0, layout)
    assert sample.routes.array().tolist() == [[[1, 2], [3, 4]]] * 3
    with pytest.raises(SglangCallError, match="--enable-return-routed-experts"):
        samples_from_outputs([{**out, "meta_info": meta}], [[1, 2]], 1, True, 0, layout)
    (plain,) = samples_from_outputs([out], [[1, 2]], 1, True, 0)
    assert plain.routes is None


def test_sglang_server_args_capture_routed_experts_under_the_flag(tmp_path, models):
    from miles.preflight import Environment
    from miles.rollout.sglang.engine import server_args

    env = Environment(python_version=(3, 11), cuda_available=lambda: False, has_module=lambda m: m == "sglang",
                      scratch_root=str(tmp_path), run_id="RUN", cpu_count=lambda: 64,
                      host_memory_available=lambda: 1 << 40)
    argv = ["--rollout-engine", "sglang", "--hf-checkpoint", models("fp32"), "--colocate",
            "--metrics-file", str(tmp_path / "m.jsonl")]
    with_r3 = validate_args(parse_args([*argv, "--use-rollout-routing-replay"]), env)
    assert server_args(with_r3, "/m", 0)["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in server_args(validate_args(parse_args(argv), env), "/m", 0)


def test_route_counts_fold_into_the_step_metrics():
    """Micro-batches' route counts add up over micro-batches and pipeline stages (each stage counts its own MoE
    layers, zeros elsewhere); the shares divide by the replayed tokens. Hand-computed: 3 + 7 replayed tokens, 1 + 0
    differing in the first MoE layer, 2 + 3 in the last."""
    from miles.backends.step import LOSS_MAXIMA, LOSS_SUMS, PolicyLoss, route_counts

    loss = PolicyLoss(eps_clip=0.2, temperature=1.0, num_tokens=10.0, advantage_estimator="grpo", tis=None,
                      routing_replay=True)
    first_stage = route_counts(torch.tensor([1, 0]), torch.tensor([3, 0]))  # [differ], [seen] per MoE layer
    last_stage = route_counts(torch.tensor([0, 2]), torch.tensor([0, 3]))
    other_batch = route_counts(torch.tensor([0, 3]), torch.tensor([7, 7]))
    stats = loss.no_stats("cpu")
    for counts in (first_stage, last_stage, other_batch):
        stats = loss.combine(stats, loss.route_stats(counts))
    assert len(stats) == len(LOSS_SUMS) + len(LOSS_MAXIMA)
    metrics = loss.metrics(stats.tolist(), tokens=10.0, world_size=1)
    assert metrics["routing_replay_mismatch_first"] == 1 / 10
    assert metrics["routing_replay_mismatch_last"] == 5 / 10
    plain = PolicyLoss(eps_clip=0.2, temperature=1.0, num_tokens=10.0, advantage_estimator="grpo", tis=None)
    assert "routing_replay_mismatch_first" not in plain.metrics(stats.tolist(), tokens=10.0, world_size=1)
