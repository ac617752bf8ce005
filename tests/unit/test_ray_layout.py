"""Pure Ray-layout helpers (miles.ray.layout): directory names, per-rank environments, bundle specs.
No Ray cluster needed."""

import os

import pytest

from miles.config import RunPaths, parse_args
from miles.preflight import Environment, validate_args
from miles.config.paths import default_root, rank_dir_name
from miles.ray import layout

STREAM_DISK = ("--stream-optimizer-state-to-disk", "--offload-train-target", "disk")

# the root's parent /scratch exists on the pretended machine (validation refuses a root whose parent is missing)
SCRATCH_EXISTS = dict(path_exists=lambda p: p == "/scratch" or os.path.exists(p),
                      is_dir=lambda p: p == "/scratch" or os.path.isdir(p), dir_writable=lambda p: True,
                      disk_free_bytes=lambda p: 1 << 50)


def _cfg(*argv, colocate=True):
    disk_chunk = ["--offload-train-disk-chunk-mb", "64"] if "disk" in argv else []  # rejected where it changes nothing
    base = ["--num-train-ranks", "2", "--offload-train-disk-dir", "/scratch/run",
            *disk_chunk, "--metrics-file", "/scratch/m.jsonl"] + ["--colocate"] * colocate
    return validate_args(parse_args(base + list(argv)), Environment(**SCRATCH_EXISTS, has_module=lambda m: False,
                                                                     cuda_available=lambda: False,
                                                                     cpu_count=lambda: 64))


def test_rank_dir_names():
    assert rank_dir_name(0, 0) == "cell0_rank0"
    assert rank_dir_name(2, 13) == "cell2_rank13"
    with pytest.raises(ValueError):
        rank_dir_name(-1, 0)


def test_directories_follow_the_shared_root():
    paths = RunPaths(root="/scratch/run", run_dir="/out")
    assert paths.trainer == "/scratch/run/trainer"
    assert paths.optimizer_state == "/scratch/run/optimizer_state"
    assert paths.rollout == "/scratch/run/rollout"
    assert paths.rank_dir(0, 1) == "/scratch/run/trainer/cell0_rank1"
    assert paths.engine_dir(2) == "/scratch/run/rollout/engine2"
    assert layout.rank_dir(_cfg(*STREAM_DISK), 1, 0) == "/scratch/run/trainer/cell1_rank0"
    assert layout.rank_dir(_cfg("--offload-train-target", "cpu"), 1, 0) is None  # no disk mechanism


def test_one_default_root(monkeypatch):
    monkeypatch.delenv("SCRATCH", raising=False)
    assert os.path.isabs(default_root("RUN")) and default_root("RUN").endswith("miles-run-RUN")
    monkeypatch.setenv("SCRATCH", "/nvme")
    assert default_root("RUN") == "/nvme/miles-run-RUN"
    assert default_root("RUN", scratch_root="/mine") == "/mine/miles-run-RUN"


def test_rank_env_cpu_disk():
    env = layout.rank_env(_cfg(*STREAM_DISK), 0, 1, use_gpu=False)
    assert not [k for k in env if k.startswith("MILES_")]  # the actor gets its cell and rank as arguments
    assert env["TMS_DISK_BACKUP_DIR"] == "/scratch/run/trainer/cell0_rank1"
    assert "MILES_RANK_DIR" not in env  # the actor gets its directory as a constructor argument
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    across = layout.rank_env(_cfg(*STREAM_DISK), 0, 1, use_gpu=False, single_node=False)
    assert "GLOO_SOCKET_IFNAME" not in across and "NCCL_SOCKET_IFNAME" not in across
    assert not any(k.startswith("TMS_INIT") for k in env) and "LD_PRELOAD" not in env  # no GPU: no tms


def test_rank_env_each_rank_differs():
    dirs = {layout.rank_env(_cfg(*STREAM_DISK, "--num-train-ranks", "4"), 0, r, use_gpu=False)["TMS_DISK_BACKUP_DIR"] for r in range(4)}
    assert len(dirs) == 4


def test_rank_env_gpu_disk_and_cpu_targets():
    lib = "/site/torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    env = layout.rank_env(_cfg(*STREAM_DISK), 0, 0, use_gpu=True, tms_library=lib)
    assert env["LD_PRELOAD"] == lib and env["TMS_INIT_ENABLE"] == "1"
    assert env["TMS_INIT_ENABLE_DISK_BACKUP"] == "1" and env["TMS_DISK_BACKUP_CHUNK_MB"] == "64"
    assert env["TMS_DISK_BACKUP_DIR"] == "/scratch/run/trainer/cell0_rank0"
    cpu = layout.rank_env(_cfg("--offload-train-target", "cpu"), 0, 0, use_gpu=True, tms_library=lib)
    assert cpu["TMS_INIT_ENABLE_CPU_BACKUP"] == "1" and "TMS_INIT_ENABLE_DISK_BACKUP" not in cpu
    assert "TMS_DISK_BACKUP_DIR" not in cpu  # no disk mechanism: no directory
    off = layout.rank_env(_cfg("--no-offload-train"), 0, 0, use_gpu=True, tms_library=lib)
    assert "LD_PRELOAD" not in off and "TMS_INIT_ENABLE" not in off


def test_bundles_cpu_gpu_colocate():
    assert layout.bundle_specs(_cfg(), use_gpu=False) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert layout.bundle_specs(_cfg("--num-cpus-per-rank", "4"), use_gpu=True) == [{"CPU": 4.0, "GPU": 1.0}] * 2
    apart = _cfg("--num-rollout-engines", "2", colocate=False)
    assert len(layout.bundle_specs(apart, use_gpu=False)) == 4
    assert [layout.rollout_engine_placement(apart, i) for i in range(2)] == [2, 3]
    assert [layout.rollout_engine_placement(_cfg(), i) for i in range(1)] == [0]
    with pytest.raises(ValueError, match="num-rollout-engines"):
        layout.bundle_specs(_cfg("--num-rollout-engines", "3"), use_gpu=False)


def test_colocated_actors_fit_one_bundle():
    for use_gpu in (False, True):
        a = _cfg("--num-cpus-per-rank", "2")
        t, r = layout.train_actor_resources(a, use_gpu), layout.rollout_engine_resources(a, use_gpu)
        assert t["num_cpus"] + r["num_cpus"] <= 2
        assert t["num_gpus"] + r["num_gpus"] <= (1 if use_gpu else 0)
    apart = _cfg(colocate=False)
    assert layout.train_actor_resources(apart, True) == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_uses_rank_dirs():
    assert _cfg(*STREAM_DISK).uses_rank_dirs
    assert _cfg("--offload-train-target", "disk").uses_rank_dirs
    assert not _cfg("--offload-train-target", "cpu").uses_rank_dirs



@pytest.mark.parametrize("argv, first", [
    ((*STREAM_DISK, "--stream-optimizer-state-host-cache-mb", "auto"), True),  # the tier is sized from free memory
    ((*STREAM_DISK, "--stream-optimizer-state-host-cache-mb", "1024"), False),  # a fixed tier: both load at once
    (STREAM_DISK, False),
    (("--offload-train-target", "disk"), False),
])
def test_embedded_engines_load_before_an_auto_host_tier_is_sized(argv, first):
    assert layout.engines_load_first(_cfg(*argv)) is first
