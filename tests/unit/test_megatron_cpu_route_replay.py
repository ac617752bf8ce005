"""--use-rollout-routing-replay (R3) on the megatron backend, CPU over gloo (megatron-core patched by
tests/megatron_cpu): the product's MegatronTrainer trains one step on samples the embedded engine generated with
routes from the same fp32 tiny Qwen3-MoE, at TP1, EP2, TP2 + sequence parallelism and PP2 (one spawned process per rank).

Asserted on every rank, every MoE layer and every micro-batch forward: the experts megatron's router dispatched
(its routing map) are exactly the replayed targets on every covered token, and the covered tokens are the
samples' routed tokens (the count). That the targets sit in megatron's token order (sequence-first, this TP rank's
slice under SP) shows in the step's routing_replay_mismatch_*: with the engine's own weights the router's natural
choice is the recorded one (a near tie aside), where a misplaced token would differ in most tokens; with the
routers perturbed on the trainer only, the natural choice differs in many tokens while the dispatched experts stay
the recorded ones.
"""

import os
import pickle
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_parallel import Layout, _config  # noqa: E402
from spawned import collect, progress, start  # noqa: E402

TIMEOUT = 300
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17, 18, 19]]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 0.75, -0.75]
NATURAL_MISMATCH_TOL = 0.05  # megatron's fp32 router logits vs transformers': a near tie may flip (seen: 0)


def _watch_dispatch(engine, seen: list):
    """Forward hooks on every TopKRouter: per call, whether its routing map is exactly the one-hot of the
    replay's targets on the covered tokens, and how many tokens were covered."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(module, args, output):
        replay = module.router_replay
        _, routing_map = output
        covered = replay.covered
        expected = torch.zeros_like(routing_map).scatter_(1, replay.target_topk_idx.to(routing_map.device), True)
        seen.append((bool(torch.equal(routing_map[covered], expected[covered])), int(covered.sum())))

    routers = [m for m in engine.gpt.modules() if isinstance(m, TopKRouter)]
    return [r.register_forward_hook(hook) for r in routers], len(routers)


def _rank(rank, layout, model, samples_bytes, repo, megatron_path, rendezvous, perturb, results):
    sys.path[:0] = [megatron_path, repo]
    import dataclasses

    import torch

    from miles.backends.megatron_backend.trainer import MegatronTrainer

    progress(results, f"{layout} rank {rank}", "join")
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                         world_size=layout.world)
    config = _config(os.path.join(os.path.dirname(rendezvous), f"rank{rank}"), layout, model, stream=False,
                     dtype="fp32")
    config = dataclasses.replace(config, training=dataclasses.replace(config.training, micro_batch_size=3,
                                                                      use_rollout_routing_replay=True))
    trainer = MegatronTrainer(config, rank=rank, world_size=layout.world, rank_dir=config.paths.rank_dir(0, rank))
    progress(results, f"{layout} rank {rank}", "init")
    trainer.init("joined: file rendezvous")
    engine = trainer.engine
    if perturb:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in engine.gpt.named_parameters():
                if name.endswith("router.weight"):
                    p.add_(torch.randn(p.shape, generator=g).to(p) * 3 * p.float().std().to(p))
    seen = []
    handles, routers = _watch_dispatch(engine, seen)
    progress(results, f"{layout} rank {rank}", "train")
    metrics = trainer.train(0, pickle.loads(samples_bytes), ADVANTAGES)
    for h in handles:
        h.remove()
    trainer.shutdown()
    return {"rank": rank, "routers": routers, "seen": seen, "metrics": metrics}


@pytest.fixture(scope="module")
def setup(megatron_cpu, tmp_path_factory):
    """``recorded(preset)``: the preset's fp32 model folder and samples with routes (made once per preset)."""
    from miles.models import write_random_model
    from miles.rollout.embedded import EmbeddedRolloutEngine
    from miles.rollout.types import SamplingParams

    root = tmp_path_factory.mktemp("megatron-r3")
    made = {}

    def recorded(preset):
        if preset not in made:
            model = write_random_model(str(root / preset), preset, dtype="fp32")
            config = _config(str(root / f"engine-{preset}"), Layout(1), model, stream=False, dtype="fp32")
            engine = EmbeddedRolloutEngine(config, engine_id=0, backup="none", device="cpu", record_routes=True)
            try:
                made[preset] = model, engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6,
                                                                                  seed=3, n=2))
            finally:
                engine.close()
        return made[preset]

    return megatron_cpu, root, recorded


def _run(setup, preset, layout, perturb):
    import multiprocessing as mp

    megatron_path, root, recorded = setup
    model, samples = recorded(preset)
    where = root / f"{preset}-{str(layout).replace(' ', '-')}-{'perturbed' if perturb else 'plain'}"
    where.mkdir()
    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (layout, model, pickle.dumps(samples), repo, megatron_path, str(where / "rendezvous"), perturb, results)
    got = collect(start(ctx, results, *[(_rank, (r, *args)) for r in range(layout.world)]), results, TIMEOUT)
    return samples, sorted(got, key=lambda g: g["rank"])


CASES = [("qwen3-moe-tiny", Layout(1)), ("qwen3-moe-tiny", Layout(1, ep=2, dp=2)),
         ("qwen3-moe-tiny", Layout(2, sp=True)), ("qwen3-moe-tiny", Layout(1, pp=2)),
         # GLM-5: a dense first layer, then MoE layers with sigmoid routers and an expert bias; PP2's first stage
         # holds the dense layer alone, so the second stage's routers are MoE layers 0 and 1
         ("glm5-tiny", Layout(1)), ("glm5-tiny", Layout(1, pp=2, first_stage_layers=1))]


@pytest.mark.parametrize("preset, layout", CASES, ids=[f"{p}-{str(lay).replace(' ', '-')}" for p, lay in CASES])
@pytest.mark.parametrize("perturb", [False, True], ids=["engine-weights", "perturbed-routers"])
def test_megatron_dispatches_the_recorded_experts(setup, preset, layout, perturb):
    samples, ranks = _run(setup, preset, layout, perturb)
    routed_tokens = sum(s.routes.tokens for s in samples)
    layers = samples[0].routes.shape.layers
    # every rank of a stage holds its MoE layers; the stages together hold them all
    assert sum(g["routers"] for g in ranks) == layers * layout.world // layout.pp
    for got in ranks:
        metrics = got["metrics"]
        assert metrics["step_skipped"] is None
        assert all(equal for equal, _ in got["seen"]), "a router dispatched other experts"
        assert len(got["seen"]) == got["routers"] * 3  # 8 samples in micro-batches of 3: each router ran 3 times
        if got["routers"]:  # each rank trains every sample: its routers see them whole, or this TP rank's slice
            covered = sum(n for _, n in got["seen"]) // got["routers"]
            assert 0 < covered < routed_tokens if layout.sp else covered == routed_tokens
        first, last = metrics["routing_replay_mismatch_first"], metrics["routing_replay_mismatch_last"]
        print(f"\n{layout} rank {got['rank']} {'perturbed' if perturb else 'engine weights'}: natural route "
              f"differs in {100 * first:.1f}% (first MoE layer), {100 * last:.1f}% (last); lp mean |diff| "
              f"{metrics['train_rollout_logprob_abs_diff']:.3g}")
        if perturb:
            assert first > 0.2 and last > 0.2
        else:
            assert first <= NATURAL_MISMATCH_TOL and last <= NATURAL_MISMATCH_TOL
    if layout.sp:  # the TP ranks' slices make up the whole micro-batches
        assert sum(sum(n for _, n in g["seen"]) // g["routers"] for g in ranks) == routed_tokens
