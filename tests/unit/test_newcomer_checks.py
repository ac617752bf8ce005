"""What the machine cannot hold is refused at validation, before Ray starts, in one line naming the numbers:
the placement group of a run that starts its own Ray, and the host tier of the streamed state."""

from __future__ import annotations

import pytest

from miles.config import ArgumentError, parse_args
from miles.preflight import Environment, validate_args

GIB = 1 << 30
STREAM = ["--stream-optimizer-state-to-disk", "--offload-train-target=disk"]


def machine(tmp_path, cpus=2, available_memory=64 * GIB, ray_address=None, **kw) -> Environment:
    kw.setdefault("ray_running", lambda: False)  # a Ray another test of this process started is not this run's
    return Environment(cuda_available=lambda: False, has_module=lambda m: False,
                       scratch_root=str(tmp_path / "scratch"), run_id="test", ray_address=ray_address,
                       cpu_count=lambda: cpus, host_memory_available=lambda: available_memory, **kw)


def check(tmp_path, env, *argv):
    argv = [*argv, "--tiny-model", "--metrics-file", str(tmp_path / "metrics.jsonl")]
    return validate_args(parse_args(argv), env)


def refusal(tmp_path, env, *argv) -> str:
    with pytest.raises(ArgumentError) as info:
        check(tmp_path, env, *argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_two_train_ranks_and_an_engine_do_not_fit_two_cpus(tmp_path):
    message = refusal(tmp_path, machine(tmp_path, cpus=2), "--num-train-ranks", "2")
    assert message == (
        "--num-train-ranks 2 + --num-rollout-engines 1 (not colocated) = 3 bundles x --num-cpus-per-rank 1 = 3 "
        "CPUs, and this machine has 2 for the Ray cluster the run starts. Fix: lower --num-train-ranks, "
        "--num-rollout-engines or --num-cpus-per-rank, add --colocate (the engines then share the train ranks' "
        "bundles), or run on a larger machine (RAY_ADDRESS joins an existing cluster).")


def test_cpus_per_rank_count_for_every_bundle(tmp_path):
    message = refusal(tmp_path, machine(tmp_path, cpus=3), "--num-cpus-per-rank", "2")
    assert "= 2 bundles x --num-cpus-per-rank 2 = 4 CPUs, and this machine has 3" in message


def test_what_fits_is_accepted(tmp_path):
    check(tmp_path, machine(tmp_path, cpus=2))  # 1 rank + 1 engine
    check(tmp_path, machine(tmp_path, cpus=2), "--num-train-ranks", "2", "--colocate")  # engines share bundles


def test_a_cluster_is_not_judged_by_the_driver_s_cpus(tmp_path):
    check(tmp_path, machine(tmp_path, cpus=2, ray_address="10.0.0.1:6379"), "--num-train-ranks", "2")


def test_a_ray_already_running_in_this_process_is_the_run_s_cluster(tmp_path):
    check(tmp_path, machine(tmp_path, cpus=2, ray_running=lambda: True), "--num-train-ranks", "2")


def test_colocated_engines_beyond_the_ranks_are_refused_before_ray(tmp_path):
    message = refusal(tmp_path, machine(tmp_path, cpus=8), "--colocate", "--num-rollout-engines", "2")
    assert "--num-rollout-engines 2" in message and "--num-train-ranks 1" in message and "--colocate" in message


def test_a_host_tier_larger_than_the_host_s_memory_is_refused(tmp_path):
    env = machine(tmp_path, available_memory=16 * GIB)
    message = refusal(tmp_path, env, *STREAM, "--stream-optimizer-state-host-cache-mb", "99999999")
    assert message == (
        "--stream-optimizer-state-host-cache-mb 99999999 asks 97656.25 GiB of host RAM for the host tier of each "
        "of the 1 train ranks on this machine (97656.25 GiB in all), and it has 16.00 GiB available. Fix: pass "
        "at most 16384 MiB (16.00 GiB over 1 ranks), or auto (fit to the free memory when the store is built).")


def test_every_rank_on_the_machine_takes_its_own_tier(tmp_path):
    env = machine(tmp_path, cpus=4, available_memory=16 * GIB)
    check(tmp_path, env, *STREAM, "--stream-optimizer-state-host-cache-mb", "10240")
    message = refusal(tmp_path, env, *STREAM, "--num-train-ranks", "2", "--stream-optimizer-state-host-cache-mb",
                      "10240")
    assert "each of the 2 train ranks on this machine (20.00 GiB in all)" in message
    assert "at most 8192 MiB" in message


def test_auto_and_an_unreadable_memory_are_left_to_the_store(tmp_path):
    check(tmp_path, machine(tmp_path, available_memory=1 * GIB), *STREAM, "--stream-optimizer-state-host-cache-mb",
          "auto")
    check(tmp_path, machine(tmp_path, available_memory=None), *STREAM, "--stream-optimizer-state-host-cache-mb",
          "99999999")


def test_miles_train_reports_a_refusal_in_one_line(capsys):
    from miles import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--stream-optimizer-state-to-disk"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("miles train: error: --stream-optimizer-state-to-disk requires")
    assert lines[0].endswith("Fix: add --offload-train-target=disk.")


# ---- the optimizer-state root: the same rules for the library and `miles train`, honest messages ------------
def _plain_adamw():
    import torch

    return torch.optim.AdamW([torch.nn.Parameter(torch.randn(3000, generator=torch.Generator().manual_seed(0)))])


def test_the_library_creates_a_missing_root_only_below_an_existing_parent(tmp_path):
    from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state

    with pytest.raises(StoreConfigError, match="does not exist and neither does its parent"):
        stream_optimizer_state(_plain_adamw(), dir=str(tmp_path / "a" / "b" / "root"))
    assert not (tmp_path / "a").exists()
    store = stream_optimizer_state(_plain_adamw(), dir=str(tmp_path / "root"))
    try:
        assert (tmp_path / "root").is_dir()
    finally:
        store.close()


def test_the_library_refuses_a_system_directory_without_talking_of_free_space():
    from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state

    with pytest.raises(StoreConfigError) as info:
        stream_optimizer_state(_plain_adamw(), dir="/proc/nope")
    assert "system directory /proc" in str(info.value)
    assert "free space" not in str(info.value) and "0.00 GiB" not in str(info.value)


def _usage(total, free):
    import shutil

    return lambda path: shutil._ntuple_diskusage(total, total - free, free)


def test_a_filesystem_without_capacity_is_named_as_such(tmp_path, monkeypatch):
    import shutil

    from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state

    monkeypatch.setattr(shutil, "disk_usage", _usage(total=0, free=0))  # what /proc and /sys report
    with pytest.raises(StoreConfigError) as info:
        stream_optimizer_state(_plain_adamw(), dir=str(tmp_path / "root"))
    message = str(info.value)
    assert "reports no capacity at all" in message and "not a disk" in message, message
    assert "0.00 GiB" not in message


def test_a_full_filesystem_states_a_small_need_in_a_unit_that_shows_it(tmp_path, monkeypatch):
    import shutil

    from miles_plugins.optimizers.nvme_stream import StoreConfigError, stream_optimizer_state

    monkeypatch.setattr(shutil, "disk_usage", _usage(total=1 << 30, free=0))
    with pytest.raises(StoreConfigError) as info:
        stream_optimizer_state(_plain_adamw(), dir=str(tmp_path / "root"))
    message = str(info.value)
    assert "not enough free space" in message and "0.00 GiB" not in message
    assert "need 24.00 KiB, 0 bytes available" in message, message  # 2 moments x 3000 fp32, 4 KiB-aligned
