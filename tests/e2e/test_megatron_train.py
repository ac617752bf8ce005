"""`miles train --train-backend megatron` end to end on one GPU: colocated with the rollout engine, the
optimizer state streamed through disk, the trainer offloaded to disk while the engine generates.

Skipped without CUDA or megatron-core (CI); run on a GPU host with Ray, megatron-core and
torch_memory_saver installed."""

import glob
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    from miles.models import write_random_model

    root = tmp_path_factory.mktemp("models")
    return {p: write_random_model(str(root / p), p, seed=3) for p in ("llama-tiny", "qwen3-moe-tiny")}


def _run(tmp_path, name, model, *flags):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    metrics = tmp_path / f"{name}.jsonl"
    config = validate_args(parse_args([
        "--train-backend", "megatron", "--hf-checkpoint", model, "--colocate",
        "--offload-train-target", "disk", "--offload-train-disk-dir", str(tmp_path / f"{name}-disk"),
        "--offload-train-plan", "offload-all",  # the disk offload itself (the plan: tests/gpu/test_sleep_plan_gpu.py)
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--metrics-file", str(metrics), *flags]))
    summary = run(config)
    return config, summary, [json.loads(line) for line in open(metrics)]


def _saved_weights(save_dir):
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(save_dir, "**", "model", "*.safetensors"), recursive=True))
    assert files, f"no model weights under {save_dir}"
    return load_file(files[-1])


def test_streamed_matches_resident_bit_for_bit(random_models, tmp_path, ray_cluster):
    weights = {}
    for arm, extra in (("resident", []), ("streamed", ["--stream-optimizer-state-to-disk"])):
        _, _, recs = _run(tmp_path, arm, random_models["llama-tiny"], "--num-rollout", "3",
                          "--save", str(tmp_path / f"{arm}-ckpt"), *extra)
        print(arm, [(r["rollout_id"], r["reward_mean"], r["loss"]) for r in recs])
        weights[arm] = _saved_weights(str(tmp_path / f"{arm}-ckpt"))
    assert weights["resident"].keys() == weights["streamed"].keys()
    differing = [k for k in weights["resident"] if not torch.equal(weights["resident"][k], weights["streamed"][k])]
    assert not differing, f"streamed weights differ from resident ones in {differing[:5]}"


def test_moe_colocated_streamed_save_and_resume(random_models, tmp_path, ray_cluster):
    save = tmp_path / "ckpt"
    config, summary, recs = _run(tmp_path, "moe", random_models["qwen3-moe-tiny"], "--num-rollout", "3",
                                 "--stream-optimizer-state-to-disk", "--save", str(save), "--save-interval", "2")
    info = summary.train_ranks[0]
    print("\ntrain rank:", json.dumps(info, default=str))
    for r in recs:
        print({k: r.get(k) for k in ("rollout_id", "reward_mean", "loss", "sleep_seconds", "wake_seconds",
                                      "offload_bytes", "stream_read_gb", "stream_written_gb")})
    assert info["train_backend"] == "megatron" and info["store"] is not None
    assert [r["rollout_id"] for r in recs] == [0, 1, 2]
    assert all(r["offload_bytes"] > 0 for r in recs)
    assert not os.path.exists(config.paths.rank_dir(0, 0)), "the per-rank directory outlived the run"
    _, summary2, recs2 = _run(tmp_path, "moe-resume", random_models["qwen3-moe-tiny"], "--num-rollout", "3",
                              "--stream-optimizer-state-to-disk", "--load", str(save / "rollout_000002"))
    assert summary2.start_rollout == 2
    assert recs2[0]["loss"] == pytest.approx(recs[2]["loss"], rel=1e-3, abs=1e-6)
