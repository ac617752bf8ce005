"""miles train with one train rank per GPU (issue 8): 2 ranks on 2 GPUs, colocated with 2 rollout
engines, streamed optimizer state + trainer offload to disk; per-rank cell0_rank<j> directories during
the run, a checkpoint with every rank's streamed-state manifest, and a resume that reads it all back.
Skipped unless the host has >= 2 GPUs (run on nvidia-h200-x2 with Ray in the bundle)."""

import json
import os

import pytest

from test_rl_loop import _DirWatcher, _records

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")]


def _args(tmp, *extra):
    from miles.config import parse_args, validate_args

    return validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "2", "--num-rollout-engines", "2", "--colocate",
        "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", str(tmp / "offload"), "--offload-train-disk-chunk-mb", "16",
        "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--micro-batch-size", "2", *extra]))


def test_one_train_rank_per_gpu_save_resume(ray_cluster, tmp_path):
    from miles.train import run

    save = tmp_path / "ckpt"
    args = _args(tmp_path, "--save", str(save), "--save-interval", "2", "--metrics-file", str(tmp_path / "m1.jsonl"))
    rank_dirs = [args.paths.rank_dir(0, r) for r in range(2)]
    with _DirWatcher(rank_dirs) as watch:
        summary = run(args)
    ranks = summary["train_ranks"]
    for info in ranks:
        print("train rank:", json.dumps({k: info[k] for k in ("rank", "device", "backend", "cuda_visible_devices",
                                                              "rank_dir", "offload")}))
    assert [r["backend"] for r in ranks] == ["nccl", "nccl"]
    assert all(r["device"].startswith("cuda") for r in ranks)
    visible = [r["cuda_visible_devices"] for r in ranks]
    assert None not in visible and len(set(visible)) == 2, visible  # one GPU each
    print("files seen per rank directory:", {os.path.basename(d): sorted(f) for d, f in watch.files_seen.items()})
    assert all(watch.seen.values()) and all("offload.bin" in f for f in watch.files_seen.values()), watch.files_seen
    assert not any(os.path.exists(d) for d in rank_dirs)

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
    assert summary2["start_rollout"] == 2
    assert [i["optimizer"] for i in summary2["load_info"]] == ["streamed", "streamed"], summary2["load_info"]
    recs2 = _records(tmp_path / "m2.jsonl")
    # every rank read its whole streamed state (mains + both moments) back from the checkpoint
    assert recs2[0]["stream_bytes_read_per_rank"] == recs[1]["stream_bytes_read_per_rank"]
    assert recs2[0]["loss"] == pytest.approx(recs[2]["loss"], rel=1e-3, abs=1e-6)
    print(f"resumed at rollout 2: loss {recs2[0]['loss']:.6f} vs first run {recs[2]['loss']:.6f}; streamed bytes "
          f"read per rank {recs2[0]['stream_bytes_read_per_rank']}")
