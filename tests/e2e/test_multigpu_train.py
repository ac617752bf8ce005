"""miles train with one train rank per GPU (issue 8): 2 ranks on 2 GPUs, colocated with 2 rollout
engines, streamed optimizer state + trainer offload to disk; per-rank cell0_rank<j> directories during
the run, a checkpoint with every rank's streamed-state manifest, and a resume that reads it all back.

The megatron arm (issue 15): DP=2 dense and EP=2 MoE through the same loop, a save, and a resume onto
one rank. The dense streamed state reshards 2 -> 1. The MoE streamed state does not: the binding names
an expert param by its expert-parallel rank and local expert index, so at EP=1 expert 4 is
``ep0...local_experts.4`` while EP=2 saved it as ``ep1...local_experts.0``, and the load stops with the
store's "differs from this store" error, which names ``--no-load-optim``; that flag resumes the weights (HF layout, all experts).

Skipped unless the host has >= 2 GPUs (run on nvidia-h200-x2 with Ray in the bundle); the megatron
arm also needs megatron-core."""

import importlib.util
import json
import os

import pytest

from test_rl_loop import _DirWatcher, _records

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")]


def _args(tmp, *extra, ranks: int = 2, model=("--tiny-model",)):
    from miles.config import parse_args
    from miles.preflight import validate_args

    return validate_args(parse_args([
        *model, "--num-train-ranks", str(ranks), "--num-rollout-engines", str(ranks), "--colocate",
        "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", str(tmp / "offload"), "--offload-train-disk-chunk-mb", "16",
        "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--micro-batch-size", "2", *extra]))


def _offload_file_seen(info: dict, files: set) -> bool:
    """The trainer's offload files in its rank directory: torch_memory_saver's disk backup writes
    ``tms_XXXXXX`` files (mkstemp names; TmsOffloader, CUDA actors launched with its hook), the storage
    offloader one ``offload.bin``."""
    if info["offload"] == "TmsOffloader":
        return any(f.startswith("tms_") for f in files)
    return "offload.bin" in files


def _check_ranks(summary, rank_dirs, watch) -> list[dict]:
    """One GPU per rank, nccl, offload files seen in every rank directory, the directories gone at exit."""
    ranks = summary.train_ranks
    for info in ranks:
        print("train rank:", json.dumps({k: info[k] for k in ("rank", "device", "backend", "cuda_visible_devices",
                                                              "rank_dir", "offload")}))
    assert [r["backend"] for r in ranks] == ["nccl"] * len(rank_dirs)
    assert all(r["device"].startswith("cuda") for r in ranks)
    visible = [r["cuda_visible_devices"] for r in ranks]
    assert None not in visible and len(set(visible)) == len(rank_dirs), visible  # one GPU each
    print("files seen per rank directory:", {os.path.basename(d): sorted(f) for d, f in watch.files_seen.items()})
    assert all(watch.seen.values()), watch.seen
    assert all(_offload_file_seen(info, watch.files_seen[rank_dirs[info["rank"]]]) for info in ranks), watch.files_seen
    assert not any(os.path.exists(d) for d in rank_dirs)
    return ranks


def test_one_train_rank_per_gpu_save_resume(ray_cluster, tmp_path):
    from miles.train import run

    save = tmp_path / "ckpt"
    args = _args(tmp_path, "--save", str(save), "--save-interval", "2", "--metrics-file", str(tmp_path / "m1.jsonl"))
    rank_dirs = [args.paths.rank_dir(0, r) for r in range(2)]
    with _DirWatcher(rank_dirs) as watch:
        summary = run(args)
    _check_ranks(summary, rank_dirs, watch)

    ck2 = save / "rollout_000002"
    manifests = sorted(os.path.relpath(os.path.join(d, f), ck2)
                       for d, _, files in os.walk(ck2 / "nvme_opt_state") for f in files if "manifest" in f)
    print("checkpoint manifests:", manifests)
    assert any(m.startswith(os.path.join("nvme_opt_state", "rank00000")) for m in manifests), manifests
    assert any(m.startswith(os.path.join("nvme_opt_state", "rank00001")) for m in manifests), manifests
    recs = _records(tmp_path / "m1.jsonl")
    assert [r["rollout_id"] for r in recs] == [0, 1, 2]

    args2 = _args(tmp_path, "--load", str(ck2), "--metrics-file", str(tmp_path / "m2.jsonl"))
    summary2 = run(args2)
    assert summary2.start_rollout == 2
    assert [i["optimizer"] for i in summary2.load_info] == ["streamed", "streamed"], summary2.load_info
    recs2 = _records(tmp_path / "m2.jsonl")
    # every rank read its whole streamed state (mains + both moments) back from the checkpoint
    assert recs2[0]["stream_bytes_read_per_rank"] == recs[1]["stream_bytes_read_per_rank"]
    assert recs2[0]["loss"] == pytest.approx(recs[2]["loss"], rel=1e-3, abs=1e-6)
    print(f"resumed at rollout 2: loss {recs2[0]['loss']:.6f} vs first run {recs[2]['loss']:.6f}; streamed bytes "
          f"read per rank {recs2[0]['stream_bytes_read_per_rank']}")


needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="needs megatron-core (Python >= 3.12, the megatron extra)")


@needs_megatron
@pytest.mark.parametrize("arm", ["dense_dp2", "moe_ep2"])
def test_megatron_two_ranks_save_resume_onto_one(ray_cluster, tmp_path, arm):
    from miles.models import write_random_model
    from miles.train import run

    if arm == "dense_dp2":
        model, parallel = ("--tiny-model",), ()
    else:
        model = ("--hf-checkpoint", write_random_model(str(tmp_path / "qwen3-moe-tiny"), "qwen3-moe-tiny"))
        parallel = ("--expert-model-parallel-size", "2")
    megatron = ("--train-backend", "megatron")
    save = tmp_path / "ckpt"
    args = _args(tmp_path, *megatron, *parallel, "--save", str(save), "--save-interval", "2",
                 "--metrics-file", str(tmp_path / "m1.jsonl"), model=model)
    rank_dirs = [args.paths.rank_dir(0, r) for r in range(2)]
    with _DirWatcher(rank_dirs) as watch:
        summary = run(args)
    ranks = _check_ranks(summary, rank_dirs, watch)
    assert all(r["train_backend"] == "megatron" for r in ranks)
    assert all(r["expert_model_parallel_size"] == (2 if parallel else 1) for r in ranks)
    assert [r["rollout_id"] for r in _records(tmp_path / "m1.jsonl")] == [0, 1, 2]
    ck2 = save / "rollout_000002"
    assert os.path.exists(ck2 / "model" / "config.json")

    def resume(*extra):
        return run(_args(tmp_path, *megatron, "--load", str(ck2), "--metrics-file", str(tmp_path / "m2.jsonl"),
                         *extra, ranks=1, model=model))

    if arm == "dense_dp2":
        summary2 = resume()
        assert summary2.start_rollout == 2
        assert [i["optimizer"] for i in summary2.load_info] == ["streamed"], summary2.load_info
        return
    with pytest.raises(Exception, match="differs from this store.*--no-load-optim"):
        resume()
    summary2 = resume("--no-load-optim")  # the weights resume onto one rank; the optimizer starts fresh
    assert summary2.start_rollout == 2
