"""Validation before Ray starts: the run's directories, the free space they need (from the model size), and
flags that would change nothing. Every case builds its paths under tmp_path; disk probes are injected."""

from __future__ import annotations

import json
import os

import pytest

from miles.config import ArgumentError, parse_args
from miles.preflight import Environment, validate_args
from miles.preflight.disk_budget import SMOLLM2_PARAMS, disk_budget, model_tensors_of_run, streamed_state_bytes

DEMO = ["--stream-optimizer-state-to-disk", "--offload-train-target=disk"]
GIB = 2**30


def env(tmp_path, **kw) -> Environment:
    base = dict(cuda_available=lambda: False, has_module=lambda m: False, scratch_root=str(tmp_path / "scratch"),
                run_id="test")
    return Environment(**{**base, **kw})


def validate(tmp_path, *argv, **env_kw):
    argv = list(argv) + ["--metrics-file", str(tmp_path / "metrics.jsonl")]
    return validate_args(parse_args(argv), env(tmp_path, **env_kw))


def error(tmp_path, *argv, **env_kw) -> str:
    with pytest.raises(ArgumentError) as ei:
        validate(tmp_path, *argv, **env_kw)
    return str(ei.value)


# ---- directories ---------------------------------------------------------------------------------------


def test_disk_dir_that_is_a_file_fails_in_validation(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    assert error(tmp_path, *DEMO, "--offload-train-disk-dir", str(f)) == (
        f"--offload-train-disk-dir {f} is a file, not a directory. Fix: pass a directory for "
        "--offload-train-disk-dir (it is created when missing, below an existing parent).")


def test_disk_dir_under_a_file_fails(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    msg = error(tmp_path, *DEMO, "--offload-train-disk-dir", str(f / "sub"))
    assert msg.startswith(f"--offload-train-disk-dir {f / 'sub'} cannot be created: {f} is a file.")


def test_disk_dir_under_proc_fails_with_the_real_probe(tmp_path):
    msg = error(tmp_path, *DEMO, "--offload-train-disk-dir", "/proc/miles-test")
    assert msg.startswith("--offload-train-disk-dir /proc/miles-test is not writable: files cannot be created in /proc.")
    assert not os.path.exists("/proc/miles-test")


def test_save_dir_that_is_a_file_fails(tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("x")
    assert error(tmp_path, "--tiny-model", "--save", str(f)).startswith(f"--save {f} is a file, not a directory.")


def test_missing_directories_are_fine_and_not_created(tmp_path):
    root, save = tmp_path / "root", tmp_path / "ckpt"  # below existing parents (tests/unit/test_inputs_dirs.py)
    cfg = validate(tmp_path, *DEMO, "--tiny-model", "--offload-train-disk-dir", str(root), "--save", str(save))
    assert cfg.paths.root == str(root) and not root.exists() and not save.exists()


def test_unwritable_directory_reported_by_the_injected_probe(tmp_path):
    msg = error(tmp_path, "--tiny-model", "--save", str(tmp_path / "ckpt"), dir_writable=lambda d: False)
    assert msg.startswith(f"--save {tmp_path / 'ckpt'} is not writable: files cannot be created in {tmp_path}.")


# ---- free space ----------------------------------------------------------------------------------------


def test_demo_needs_the_smollm2_state_plus_offload_on_the_root(tmp_path):
    # the embedded default model (smollm2 importable), fp32 on CPU: 12 B/param streamed + 4 B/param offloaded
    kw = dict(has_module=lambda m: True, disk_free_bytes=lambda p: 1 * GIB)
    msg = error(tmp_path, *DEMO, **kw)
    assert msg.startswith(f"{tmp_path / 'scratch' / 'miles-run-test'} (the default of --offload-train-disk-dir): the run "
                          "needs about 2.00 GiB there (1.50 GiB streamed optimizer state + 0.50 GiB trainer offload, "
                          "for 134.5M params) and its filesystem has 1.00 GiB free.")
    assert "`miles plan`" in msg
    validate(tmp_path, *DEMO, has_module=lambda m: True, disk_free_bytes=lambda p: 3 * GIB)


def test_narrow_moments_shrink_the_need(tmp_path):
    kw = dict(has_module=lambda m: True, disk_free_bytes=lambda p: int(1.6 * GIB))
    error(tmp_path, *DEMO, **kw)
    validate(tmp_path, *DEMO, "--stream-optimizer-state-moment-dtype", "fp8e4m3", **kw)


def test_checkpoint_copy_counts_on_the_same_filesystem_only(tmp_path):
    save = str(tmp_path / "ckpt")
    same = dict(has_module=lambda m: True, disk_free_bytes=lambda p: 3 * GIB, filesystem_id=lambda p: 1)
    msg = error(tmp_path, *DEMO, "--save", save, **same)
    assert "+ 2.00 GiB checkpoint copy" in msg
    # another filesystem for --save: the root holds scratch only, the checkpoint is checked where it goes
    (tmp_path / "scratch").mkdir()
    other = dict(same, filesystem_id=lambda p: 1 if "scratch" in p else 2)
    validate(tmp_path, *DEMO, "--save", save, **other)


def test_hf_checkpoint_size_comes_from_its_config_json(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    cfg = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
           "num_key_value_heads": 16, "intermediate_size": 4096, "vocab_size": 32000, "tie_word_embeddings": False}
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "vocab.txt").write_text("[UNK]\n")  # a tokenizer file (validation reads tokenizer.json's contents)
    params = model_tensors_of_run("hf_checkpoint", cfg).total()
    assert 300e6 < params < 500e6
    msg = error(tmp_path, *DEMO, "--hf-checkpoint", str(model), disk_free_bytes=lambda p: GIB)
    assert f"for {params / 1e6:.1f}M params" in msg


def test_streamed_state_uses_the_store_codecs():
    n = 1 << 20
    assert streamed_state_bytes(n, "fp32") == 12 * n
    assert streamed_state_bytes(n, "bf16") == 8 * n
    assert 6 * n < streamed_state_bytes(n, "fp8e4m3") < 6.1 * n


ROOMY = dict(disk_free_bytes=lambda p: 1 << 50, cpu_count=lambda: 8, host_memory_available=lambda: 64 * GIB)


def test_budget_terms(tmp_path):
    cfg = validate(tmp_path, *DEMO, "--colocate", "--num-train-ranks", "2", "--save", str(tmp_path / "x"), **ROOMY)
    assert cfg.model.model_dtype == "fp32" and cfg.trainer_offload_to_disk
    b = disk_budget(cfg, model_tensors_of_run("smollm2", None))
    p = SMOLLM2_PARAMS
    # the two ranks' streamed files (12 B/param between them, the buckets' alignment on top), each rank's
    # fp32 weights offloaded; the colocated engine keeps no backup of its weights
    assert 12 * p <= b.state <= 12 * p * 1.001 and b.state_in_ram == 0
    assert b.trainer_offload == 8 * p and b.checkpoint == 16 * p


def test_the_host_tier_share_of_the_state_is_not_asked_of_the_disk(tmp_path):
    """A bucket the host tier holds lives in RAM only: an explicit tier, or "auto" from the memory
    available now, takes its share of the state off the disk need."""
    def budget(host_cache_mb, memory_available=None):
        cfg = validate(tmp_path, *DEMO, "--stream-optimizer-state-bucket-numel", "20000000",  # 7 buckets of 240 MB
                       "--stream-optimizer-state-host-cache-mb", host_cache_mb, **ROOMY)
        return disk_budget(cfg, model_tensors_of_run("smollm2", None), memory_available=memory_available)

    none, tier = budget("0"), budget("1024")
    assert none.state_in_ram == 0 and 0 < tier.state_in_ram <= 2**30  # the whole buckets 1 GiB holds
    assert tier.state + tier.state_in_ram == none.state and tier.trainer_offload == none.trainer_offload
    assert budget("auto").state == none.state  # memory unknown: no tier counted
    whole = budget("auto", memory_available=64 * GIB)
    assert whole.state == 0 and whole.state_in_ram == none.state


def test_a_state_larger_than_the_tier_and_the_free_disk_stops_before_ray(tmp_path):
    kw = dict(has_module=lambda m: True, disk_free_bytes=lambda p: 1 * GIB)
    tier = ["--stream-optimizer-state-host-cache-mb", "auto", "--stream-optimizer-state-bucket-numel", "20000000"]
    # 512 MiB over the 16 GiB "auto" leaves free: the whole buckets that fit in it stay in RAM, the rest
    # of the 1.50 GiB state needs files
    msg = error(tmp_path, *DEMO, *tier, host_memory_available=lambda: 16 * GIB + 512 * 2**20, **kw)
    assert "(1.13 GiB streamed optimizer state files (the host tier holds 0.38 GiB more in RAM) + 0.50 GiB " \
           "trainer offload, for 134.5M params)" in msg
    assert "and its filesystem has 1.00 GiB free" in msg
    validate(tmp_path, *DEMO, *tier, host_memory_available=lambda: 20 * GIB, **kw)  # the tier holds it all


# ---- flags that change nothing ------------------------------------------------------------------------


@pytest.mark.parametrize("argv,expected", [
    (["--stream-optimizer-state-moment-dtype", "fp8e4m3"],
     "--stream-optimizer-state-moment-dtype fp8e4m3 has no effect: --stream-optimizer-state-to-disk is off. Fix: "
     "add --stream-optimizer-state-to-disk --offload-train-target=disk, or drop --stream-optimizer-state-moment-dtype."),
    (["--stream-optimizer-state-bucket-numel", "1000"], "--stream-optimizer-state-bucket-numel 1000 has no effect"),
    (["--offload-train-disk-chunk-mb", "64"], "--offload-train-disk-chunk-mb 64 has no effect: trainer offload "
     "does not go to disk"),
    (["--colocate", "--offload-train-disk-chunk-mb", "64"], "--offload-train-disk-chunk-mb 64 has no effect"),
    (["--offload-train-target", "cpu"], "--offload-train-target cpu has no effect: trainer offload is off"),
    (["--no-offload-train", "--offload-train-target", "cpu"],
     "--offload-train-target cpu has no effect: --no-offload-train turns trainer offload off. Fix: drop "
     "--no-offload-train, or drop --offload-train-target."),
    (["--optimizer", "sgd", "--adam-beta1", "0.5"], "--adam-beta1 0.5 has no effect: --optimizer sgd has no Adam terms"),
    (["--tensorboard-dir", "{tmp}/tb"], "--tensorboard-dir {tmp}/tb has no effect: TensorBoard is not installed."),
])
def test_flags_without_effect_are_rejected(tmp_path, argv, expected):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert error(tmp_path, "--tiny-model", *argv).startswith(expected.format(tmp=tmp_path))


@pytest.mark.parametrize("argv", [
    ["--stream-optimizer-state-moment-dtype", "fp32"],  # the default, repeated: asks for what the run does
    [*DEMO, "--stream-optimizer-state-moment-dtype", "fp8e4m3", "--stream-optimizer-state-bucket-numel", "1000"],
    ["--offload-train-target", "disk", "--offload-train-disk-chunk-mb", "64"],
    ["--colocate", "--offload-train-target", "cpu", "--offload-train-disk-dir", "{tmp}/d"],
])
def test_flags_that_count_are_accepted(tmp_path, argv):
    validate(tmp_path, "--tiny-model", *[a.format(tmp=tmp_path) for a in argv])


def test_tensorboard_dir_accepted_when_installed(tmp_path):
    validate(tmp_path, "--tiny-model", "--tensorboard-dir", str(tmp_path / "tb"), has_module=lambda m: m == "tensorboard")
