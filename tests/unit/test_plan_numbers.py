"""`miles plan`'s numbers and help say what a run does: the trainer-offload disk is what sleep backs up, rates
print short, the buckets are the ones `miles bench stream`'s store cuts, a layout mistake names the flags
given, and the help states each default once. CPU only; no Ray, no GPU."""

import json
import re

import pytest
import torch

from miles.bench.stream import make_state
from miles.sizing.cli import build_parser, main
from miles.sizing.estimate import GB, Hardware, Training, estimate
from miles.sizing.model_params import model_tensors
from miles.sizing.presets import QWEN3_30B_A3B
from miles.sizing.sharding import Parallelism
from miles_plugins.optimizers.streaming.plan import plan_buckets


def plan_json(argv, capsys) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def plan_text(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def refused(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


# ---- the trainer offload is what sleep backs up --------------------------------------------------------------
def qwen3_30b(stream_optimizer_state=True):
    return estimate(model_tensors(QWEN3_30B_A3B, "qwen3-30b-a3b"), Parallelism(dp=8, ep=8),
                    Hardware(nodes=1, gpus_per_node=8), Training(stream_optimizer_state=stream_optimizer_state))


def test_trainer_offload_counts_the_weights_not_the_grads_sleep_drops():
    # Both backends drop the grads at sleep (megatron frees its grad buffers, the torch backend's step sets
    # them to None) and back up the bf16 weights; the streamed state is in its files already.
    est = qwen3_30b()
    offload = est.disk_bytes_per_node["trainer_offload"]
    assert offload == 8 * est.binding.weight_bytes
    assert 80 * GB < offload < 85 * GB  # ~83 GB written per node, not the 247.9 GB that counted fp32 grads


def test_trainer_offload_adds_the_optimizer_state_only_when_it_stays_in_memory():
    est = qwen3_30b(stream_optimizer_state=False)
    assert est.disk_bytes_per_node["trainer_offload"] == 8 * (est.binding.weight_bytes
                                                               + est.binding.resident_state_bytes)


def test_the_table_shows_the_offload_written(capsys):
    text = plan_text(["--preset", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "8", "--ep", "8"], capsys)
    line = next(l for l in text.splitlines() if l.startswith("disk per node"))
    assert "trainer offload 82.6 GB" in line, line


# ---- rates and sizes print short -------------------------------------------------------------------------
def test_rates_from_a_bench_file_print_with_a_few_decimals(tmp_path, capsys):
    bench = {"floor": {"concurrent": {"seconds": 25.1557, "bytes_read": 18e9, "bytes_written": 18e9},
                       "sequential": {"seconds": 20.0, "read_seconds": 12.5777, "write_seconds": 6.9311,
                                      "bytes_read": 18e9, "bytes_written": 18e9}}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    text = plan_text(["--params", "1.5B", "--nodes", "1", "--gpus-per-node", "1", "--host-tier-gb", "9",
                      "--from-bench", str(path)], capsys)
    assert "(read + write) / 1.43 GB/s combined" in text
    long_numbers = re.findall(r"\d+\.\d{3,}", text)
    assert not long_numbers, long_numbers
    text = plan_text(["--params", "1.5B", "--nodes", "1", "--gpus-per-node", "1", "--from-bench", str(path),
                      "--disk-combined-gbps", "0.123456"], capsys)
    assert "(read + write) / 0.123 GB/s combined" in text  # below 1: three significant digits


# ---- the buckets are the store's over the bench's entries ------------------------------------------------
@pytest.mark.parametrize("bucket_numel", [700_000, 1_000_000, 3_000_000, 6_250_000])
def test_the_plan_cuts_the_buckets_the_benchs_store_cuts(capsys, bucket_numel):
    total = 10_000_000
    _, masters = make_state(total, torch.device("cpu"))
    stores_buckets = len(plan_buckets([m.numel() for m in masters], bucket_numel))
    plan = plan_json(["--params", str(total), "--nodes", "1", "--gpus-per-node", "1",
                      "--bucket-numel", str(bucket_numel)], capsys)
    assert plan["per_rank"]["dense_store"]["num_buckets"] == stores_buckets


# ---- a layout that does not divide the GPUs -------------------------------------------------------------
def test_a_tp_that_does_not_divide_the_gpus_names_the_flags_given(capsys):
    err = refused(["--params", "1B", "--tp", "3"], capsys)
    assert "--tp 3" in err and "8 GPUs" in err
    assert "--dp" not in err  # not given: changing it is no fix
    assert "--gpus-per-node" in err  # what can change: the GPUs, or a TP x PP that divides them


def test_an_explicit_dp_that_does_not_match_names_it(capsys):
    err = refused(["--params", "1B", "--nodes", "1", "--gpus-per-node", "8", "--tp", "2", "--dp", "3"], capsys)
    assert "--dp 3" in err and "--tp 2" in err and "8 GPUs" in err


# ---- help ---------------------------------------------------------------------------------------------------
def test_help_states_each_default_once_and_names_no_code(capsys):
    text = build_parser().format_help()
    entries = re.split(r"\n  (?=-)", text)
    for entry in entries:
        flat = " ".join(entry.split())
        assert flat.count("(default") <= 1, flat
        assert "(default: None)" not in flat, flat
        assert not re.search(r"\[[\d.]+\]", flat), flat  # defaults are written "(default: X)"
    assert "estimate." not in text
    assert "hardware (per node):" in text
    nodes = next(" ".join(e.split()) for e in entries if e.startswith("--nodes"))
    assert "(default: 1)" in nodes, nodes
