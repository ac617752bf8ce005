"""The RL loop on a GPU: 1 train rank + 1 rollout engine colocated on one GPU, streamed optimizer state +
trainer offload to disk through torch_memory_saver (LD_PRELOAD hook, TMS_INIT_ENABLE=1,
TMS_INIT_ENABLE_DISK_BACKUP=1, TMS_DISK_BACKUP_DIR = the rank's cell0_rank0 directory).
Skipped without CUDA (CI); run on a GPU host with Ray and torch_memory_saver installed."""

import json
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_colocated_gpu_run_with_tms_disk_offload(ray_cluster, tmp_path):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.ray import layout
    from miles.train import run

    has_tms = layout.tms_preload_library() is not None
    save = tmp_path / "ckpt"
    args = validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "1", "--num-rollout-engines", "1", "--colocate",
        "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", str(tmp_path / "offload"), "--offload-train-disk-chunk-mb", "16",
        "--offload-train-plan", "offload-all",  # torch_memory_saver itself (the sleep plan: test_sleep_plan_gpu)
        "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--save", str(save), "--save-interval", "2",
        "--metrics-file", str(tmp_path / "gpu.jsonl")]))
    rank_dir = args.paths.rank_dir(0, 0)
    seen = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if os.path.isdir(rank_dir):
                seen.add("dir")
                try:
                    seen.update(os.listdir(rank_dir))
                except FileNotFoundError:
                    pass
            time.sleep(0.02)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        summary = run(args)
    finally:
        stop.set()
        th.join()
    info = summary.train_ranks[0]
    print("\ntrain rank:", json.dumps(info, default=str))
    assert info["device"].startswith("cuda") and info["backend"] == "nccl"
    assert info["offload"] == ("TmsOffloader" if has_tms else "StorageOffloader")
    recs = [json.loads(line) for line in open(tmp_path / "gpu.jsonl")]
    for r in recs:
        print({k: r[k] for k in ("rollout_id", "reward_mean", "loss", "sleep_seconds", "wake_seconds",
                                  "offload_bytes", "stream_read_gb", "stream_written_gb")})
    assert [r["rollout_id"] for r in recs] == [0, 1, 2]
    assert recs[1]["stream_bytes_read_per_rank"][0] == 3 * recs[0]["stream_bytes_read_per_rank"][0]
    assert all(r["offload_bytes"] > 0 for r in recs)
    assert "dir" in seen and not os.path.exists(rank_dir)
    print("files seen in the rank directory:", sorted(seen))
    # resume: the streamed state comes back through load_from on the GPU too
    args2 = validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "1", "--colocate", "--stream-optimizer-state-to-disk",
        "--offload-train-target", "disk", "--offload-train-disk-dir", str(tmp_path / "offload"),
        "--offload-train-plan", "offload-all", "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "8", "--load", str(save / "rollout_000002"),
        "--metrics-file", str(tmp_path / "gpu2.jsonl")]))
    summary2 = run(args2)
    assert summary2.start_rollout == 2
    rec2 = [json.loads(line) for line in open(tmp_path / "gpu2.jsonl")]
    assert rec2[0]["stream_bytes_read_per_rank"][0] == 3 * recs[0]["stream_bytes_read_per_rank"][0]
    assert rec2[0]["loss"] == pytest.approx(recs[2]["loss"], rel=1e-3, abs=1e-6)
