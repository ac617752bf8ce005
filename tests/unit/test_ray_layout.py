"""Pure Ray-layout helpers (miles.ray.layout): directory names, per-rank environments, bundle specs.
No Ray cluster needed."""

import argparse
import os

import pytest

from miles.ray import layout


def _args(**kw):
    base = dict(num_train_ranks=2, num_rollout_engines=1, colocate=True, num_cpus_per_rank=1,
                offload_train=True, offload_train_target="disk", offload_train_disk_dir="/scratch/run",
                offload_train_disk_chunk_mb=64, stream_optimizer_state_to_disk=True)
    base.update(kw)
    return argparse.Namespace(**base)


def test_rank_dir_names():
    assert layout.rank_dir_name(0, 0) == "cell0_rank0"
    assert layout.rank_dir_name(2, 13) == "cell2_rank13"
    with pytest.raises(ValueError):
        layout.rank_dir_name(-1, 0)


def test_directories_follow_the_shared_root():
    a = _args()
    assert layout.offload_root(a) == "/scratch/run"
    assert layout.trainer_root(a) == "/scratch/run/trainer"
    assert layout.optimizer_state_root(a) == "/scratch/run/optimizer_state"
    assert layout.rank_dir(a, 0, 1) == "/scratch/run/trainer/cell0_rank1"
    # validate_args' derived attributes win when present
    a.offload_train_trainer_dir = "/elsewhere/t"
    a.stream_optimizer_state_dir = "/elsewhere/o"
    assert layout.rank_dir(a, 1, 0) == "/elsewhere/t/cell1_rank0"
    assert layout.optimizer_state_root(a) == "/elsewhere/o"


def test_default_root_when_unset():
    a = _args(offload_train_disk_dir=None)
    assert os.path.isabs(layout.offload_root(a))
    assert "miles-offload-" in layout.offload_root(a)


def test_rank_env_cpu_disk():
    env = layout.rank_env(_args(), 0, 1, use_gpu=False)
    assert env["MILES_RANK"] == "1" and env["MILES_CELL"] == "0"
    assert env["MILES_RANK_DIR"] == env["TMS_DISK_BACKUP_DIR"] == "/scratch/run/trainer/cell0_rank1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert not any(k.startswith("TMS_INIT") for k in env) and "LD_PRELOAD" not in env  # no GPU: no tms


def test_rank_env_each_rank_differs():
    dirs = {layout.rank_env(_args(num_train_ranks=4), 0, r, use_gpu=False)["TMS_DISK_BACKUP_DIR"] for r in range(4)}
    assert len(dirs) == 4


def test_rank_env_gpu_disk_and_cpu_targets():
    lib = "/site/torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    env = layout.rank_env(_args(), 0, 0, use_gpu=True, tms_library=lib)
    assert env["LD_PRELOAD"] == lib and env["TMS_INIT_ENABLE"] == "1"
    assert env["TMS_INIT_ENABLE_DISK_BACKUP"] == "1" and env["TMS_DISK_BACKUP_CHUNK_MB"] == "64"
    assert env["TMS_DISK_BACKUP_DIR"] == "/scratch/run/trainer/cell0_rank0"
    cpu = layout.rank_env(_args(offload_train_target="cpu", stream_optimizer_state_to_disk=False), 0, 0,
                          use_gpu=True, tms_library=lib)
    assert cpu["TMS_INIT_ENABLE_CPU_BACKUP"] == "1" and "TMS_INIT_ENABLE_DISK_BACKUP" not in cpu
    assert "TMS_DISK_BACKUP_DIR" not in cpu  # no disk mechanism: no directory
    off = layout.rank_env(_args(offload_train=False, offload_train_target="cpu", stream_optimizer_state_to_disk=False),
                          0, 0, use_gpu=True, tms_library=lib)
    assert "LD_PRELOAD" not in off and "TMS_INIT_ENABLE" not in off


def test_bundles_cpu_gpu_colocate():
    assert layout.bundle_specs(_args(), use_gpu=False) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert layout.bundle_specs(_args(num_cpus_per_rank=4), use_gpu=True) == [{"CPU": 4.0, "GPU": 1.0}] * 2
    apart = _args(colocate=False, num_rollout_engines=2)
    assert len(layout.bundle_specs(apart, use_gpu=False)) == 4
    assert [layout.rollout_engine_placement(apart, i) for i in range(2)] == [2, 3]
    assert [layout.rollout_engine_placement(_args(), i) for i in range(1)] == [0]
    with pytest.raises(ValueError, match="num-rollout-engines"):
        layout.bundle_specs(_args(num_rollout_engines=3), use_gpu=False)


def test_colocated_actors_fit_one_bundle():
    for use_gpu in (False, True):
        a = _args(num_cpus_per_rank=2)
        t, r = layout.train_actor_resources(a, use_gpu), layout.rollout_engine_resources(a, use_gpu)
        assert t["num_cpus"] + r["num_cpus"] <= 2
        assert t["num_gpus"] + r["num_gpus"] <= (1 if use_gpu else 0)
    apart = _args(colocate=False)
    assert layout.train_actor_resources(apart, True) == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_uses_rank_dirs():
    assert layout.uses_rank_dirs(_args())
    assert layout.uses_rank_dirs(_args(stream_optimizer_state_to_disk=False))
    assert not layout.uses_rank_dirs(_args(offload_train_target="cpu", stream_optimizer_state_to_disk=False))
