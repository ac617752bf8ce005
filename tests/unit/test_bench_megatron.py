"""`miles bench megatron` without megatron: its flags, the model's param count, the store arms' host cache,
the bit-identity check on saved tensors, the ratios and table from arm results (fake ones here), the
parent's orchestration with a fake arm, an arm process on a machine without CUDA, and the one-line error
with exit status 2 where CUDA or megatron-core is missing. The real arms run in tests/gpu/test_bench_megatron.py."""

import importlib.util
import json
import os

import pytest
import torch

from miles.bench import megatron as bench
from miles.bench import megatron_report as rep
from miles.bench.cli import main as bench_main

GB = 1e9


def args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


# ---- shape, params, flags ------------------------------------------------------------------------------
def test_default_shape_is_about_1_34b_params():
    shape, _ = bench.validate(args())
    counts = bench.param_count(shape)
    assert counts["total"] == 1_364_297_728
    assert counts["total"] == counts["layers"] + counts["embeddings"] + counts["final_norm"]
    assert 16e9 < 12 * counts["total"] < 16.5e9  # fp32 mains + moments: the state the arms move


@pytest.mark.parametrize("groups", [None, 2])
def test_param_count_matches_a_llama_of_the_same_shape(groups):
    """The formula counts what a Llama of the shape holds (transformers' LlamaForCausalLM has the same
    params as the GPTModel the arms build: q/k/v/o, gate/up/down, two norms a layer, final norm, untied
    embeddings), and the shape goes through the megatron trainer's config mapping unchanged."""
    transformers = pytest.importorskip("transformers")
    from miles.backends.megatron_backend.families import describe
    from miles.backends.megatron_backend.model import gpt_model_kwargs, transformer_config_from_hf

    shape, _ = bench.validate(args("--hidden", "64", "--layers", "2", "--heads", "4", "--ffn", "96", "--vocab", "128",
                                   *(["--query-groups", str(groups)] if groups else [])))
    ns = bench.llama_config(shape)
    hf = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=groups or 4, vocab_size=128, tie_word_embeddings=False)
    assert bench.param_count(shape)["total"] == sum(p.numel() for p in transformers.LlamaForCausalLM(hf).parameters())
    arch = describe(ns)
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.num_query_groups, arch.tied_embeddings) == \
        (2, 64, 96, groups or 4, False)
    kw = transformer_config_from_hf(ns, params_dtype=torch.bfloat16)
    assert kw["bf16"] and kw["num_query_groups"] == (groups or 4) and not kw["add_bias_linear"]
    assert gpt_model_kwargs(ns)["share_embeddings_and_output_weights"] is False


def test_arms_in_order_with_one_store_arm_per_tier():
    _, arms = bench.validate(args())
    assert [a["name"] for a in arms] == ["resident", "cpu-offload", "store-0", "store-50", "store-100", "store-budget"]
    assert arms[-1] == {"name": "store-budget", "kind": "store", "tier_pct": 0, "budget_mb": 1024}
    _, arms = bench.validate(args("--arms", "store,resident", "--tiers", "25"))
    assert [a["name"] for a in arms] == ["resident", "store-25"]


@pytest.mark.parametrize("argv,match", [
    (["--tiers", "0,150"], "--tiers"), (["--tiers", "a"], "--tiers"), (["--tiers", "50,50"], "--tiers"),
    (["--arms", "resident,zero"], "--arms"), (["--hidden", "100", "--heads", "16"], "--hidden 100"),
    (["--query-groups", "3"], "--query-groups 3"), (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"),
    (["--budget-mb", "0"], "--budget-mb"),
])
def test_bad_flags_are_named(argv, match):
    with pytest.raises(ValueError, match=match):
        bench.validate(args(*argv))


def test_bad_flags_exit_2_with_one_line(tmp_path, capsys):
    assert bench.main(["--tiers", "0,200", "--dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tiers" in err
    assert not os.path.exists(tmp_path / "d")


def test_host_cache_of_a_tier():
    state = 16_371_572_736
    assert bench.host_cache_mb(0, state) == 0
    assert bench.host_cache_mb(50, state) == -(-state // 2 // (1 << 20))
    assert bench.host_cache_mb(100, state) * (1 << 20) >= state + 64 * (1 << 20)  # every bucket's file fits


def test_help_renders(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["megatron", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tiers", "--budget-mb", "--steps", "--warmup", "--dir", "--json", "--arms"):
        assert flag in out
    assert "CPU offload" in out


def test_without_cuda_or_megatron_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "megatron" else real(name, *a))
    assert bench_main(["megatron", "--dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no CUDA GPU" in err and "megatron-core is not installed" in err and "run it on a GPU host" in err
    assert not os.path.exists(tmp_path / "d")


# ---- bit identity --------------------------------------------------------------------------------------
def test_compare_saved_tensor_by_tensor(tmp_path):
    ref = {"a": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    torch.save(ref, tmp_path / "ref.pt")
    torch.save({k: v.clone() for k, v in ref.items()}, tmp_path / "same.pt")
    other = {k: v.clone() for k, v in ref.items()}
    other["b"][2] = 1.5
    torch.save(other, tmp_path / "other.pt")
    torch.save({"a": ref["a"]}, tmp_path / "fewer.pt")
    mains = {"000000": torch.zeros(3)}
    torch.save(mains, tmp_path / "m.pt")
    torch.save({"000000": torch.tensor([0.0, 1e-7, 0.0])}, tmp_path / "m2.pt")

    same = rep.compare_saved(str(tmp_path / "ref.pt"), str(tmp_path / "same.pt"))
    assert same["identical"] and same["mains"] is None and same["params"]["tensors"] == 2
    assert rep.identical_text(same) == "yes (bf16 params)"
    diff = rep.compare_saved(str(tmp_path / "ref.pt"), str(tmp_path / "other.pt"))
    assert not diff["identical"] and diff["params"]["differing"] == 1 and diff["params"]["first_differing"] == "b"
    assert diff["params"]["max_abs_diff"] == 0.5
    assert rep.identical_text(diff).startswith("no (params: 1/2 differ")
    assert not rep.compare_saved(str(tmp_path / "ref.pt"), str(tmp_path / "fewer.pt"))["identical"]
    both = rep.compare_saved(str(tmp_path / "ref.pt"), str(tmp_path / "same.pt"), str(tmp_path / "m.pt"),
                             str(tmp_path / "m2.pt"))
    assert not both["identical"] and both["params"]["identical"] and both["mains"]["differing"] == 1
    assert "mains: 1/1 differ" in rep.identical_text(both)
    assert rep.identical_text(None) == "n/a" and rep.identical_text("reference") == "(reference)"


# ---- ratios and the table from arm results -------------------------------------------------------------
def fake_arm(name, step, peak, rss, state=16.4e9, e2e=None, moved=None, identical=True, **extra):
    rows = [{"measured": False, "seconds": 99.0, "peak_bytes": 10 * peak}]  # the warm-up: never counted
    for k in range(3):
        row = {"measured": True, "seconds": step * (1 + (k - 1) * 0.1), "peak_bytes": peak - k}
        if e2e is not None:
            row.update(end_to_end_seconds=e2e, bytes_read=moved, bytes_written=moved, disk_bytes_read=moved / 2,
                       cache_bytes_read=moved / 2, disk_bytes_written=0)
        rows.append(row)
    r = {"name": name, "ok": True, "rows": rows, "rss_peak_bytes": rss, "rss_bytes": rss / 2, "state_bytes": state,
         "params": 1_364_297_728, "identical": identical}
    if e2e is not None:
        r.update(host_cache_mb=extra.pop("host_cache_mb", 0),
                 store={"num_buckets": 34, "bucket_numel": 40e6, "depth": 2, "device_budget_bytes": 2.4e9,
                        "residency_bound_bytes": 2.3e9, "direct_io": True})
    r.update(extra)
    return r


def fake_results(cpu_offload_ok=True):
    same = {"identical": True, "params": {"identical": True, "tensors": 171}, "mains": None}
    arms = {
        "resident": fake_arm("resident", 0.05, 4e9, 30e9, state=16.37e9, identical="reference"),
        "cpu-offload": fake_arm("cpu-offload", 1.6, 1e9, 60e9, identical={
            "identical": False, "params": {"identical": False, "tensors": 171, "differing": 170, "max_abs_diff": 1e-3},
            "mains": None}) if cpu_offload_ok else
        {"name": "cpu-offload", "ok": False, "error": "RuntimeError: get_megatron_optimizer refused this arm"},
        "store-0": fake_arm("store-0", 8.0, 2e9, 10e9, e2e=9.0, moved=16.4e9, identical=same),
        "store-50": fake_arm("store-50", 4.0, 2e9, 20e9, e2e=6.0, moved=16.4e9, identical=same, host_cache_mb=7807),
        "store-100": fake_arm("store-100", 1.2, 2e9, 32.8e9, e2e=3.0, moved=16.4e9, identical=same,
                              host_cache_mb=15678),
        "store-budget": fake_arm("store-budget", 9.0, 0.9e9, 10e9, e2e=10.0, moved=16.4e9, identical=same,
                                 budget_mb=1024),
    }
    return {"shape": {"layers": 24, "hidden": 2048}, "arms": arms, "params_predicted": 1_364_297_728,
            "device": "NVIDIA H200", "torch": "2.11.0"}


def test_ratios_from_medians_and_peaks_of_the_measured_steps():
    r = rep.ratios(fake_results())
    assert r["store_100_over_cpu_offload_step"] == pytest.approx(1.2 / 1.6)
    assert r["store_100_end_to_end_over_cpu_offload_step"] == pytest.approx(3.0 / 1.6)
    assert r["store_100_rss_peak_over_state"] == pytest.approx(32.8 / 16.4)
    assert r["store_50_over_store_0_step"] == pytest.approx(0.5)
    assert r["store_50_over_store_0_end_to_end"] == pytest.approx(6.0 / 9.0)
    assert r["store_budget_peak_over_budget"] == pytest.approx(0.9e9 / (1024 << 20))
    assert r["store_0_peak_over_resident_peak"] == pytest.approx(0.5)
    s = rep.summarize(fake_results()["arms"]["store-0"])
    assert s["step"] == 8.0 and s["peak"] == 2e9 and s["read"] == 16.4e9  # the warm-up row is left out


def test_report_prints_every_arm_and_the_ratios():
    text = rep.report(fake_results())
    lines = text.splitlines()
    row = next(l for l in lines if l.startswith("store-100 "))
    assert "1.200" in row and "3.000" in row and f"{1.2 / 0.05:.2f}" in row and f"{1.2 / 1.6:.2f}" in row
    assert "16.40+16.40" in row and "yes (bf16 params)" in row
    assert "no (params: 170/171 differ" in next(l for l in lines if l.startswith("cpu-offload "))
    assert "(reference)" in next(l for l in lines if l.startswith("resident "))
    assert f"store 100% tier step / cpu-offload step{' ' * 20}" in text and f"{1.2 / 1.6:.3f}x" in text
    assert "16.37 GB" in lines[1]  # the resident arm's state bytes
    assert "per step: read 8.20 GB from disk and 8.20 GB from the host cache; 0.00 GB written to disk" in text


def test_a_failed_arm_is_reported_and_its_ratios_are_na():
    results = fake_results(cpu_offload_ok=False)
    r = rep.ratios(results)
    assert r["store_100_over_cpu_offload_step"] is None and r["store_50_over_store_0_step"] == pytest.approx(0.5)
    text = rep.report(results)
    assert "cpu-offload    FAILED: RuntimeError: get_megatron_optimizer refused" in text
    assert "n/a (an arm it needs is missing or failed)" in text
    assert "x cpu-offl" in text and "cpu-offload failed: RuntimeError" in text


# ---- the parent, with fake arms ------------------------------------------------------------------------
def test_run_compares_every_arm_with_resident_and_cleans_up(tmp_path, monkeypatch, capsys):
    """The parent runs the arms in order, compares each one's saved params with resident's as it finishes,
    deletes them, and writes the numbers; a failed cpu-offload arm does not fail the run."""
    seen = []

    def fake_run_arm(spec, workdir, say, *, verbose=False, timeout=None):
        seen.append(spec["name"])
        assert os.path.dirname(spec["saved_params"]) == workdir and spec["dir"] == workdir
        if spec["kind"] == "store":  # a closed store leaves its (empty) directory: the run removes it
            os.makedirs(os.path.join(spec["dir"], spec["name"], "rank00000"))
        if spec["name"] == "cpu-offload":
            return {"name": spec["name"], "ok": False, "error": "ValueError: refused"}
        weights = {"w": torch.full((3,), 1.0 if spec["name"] != "store-50" else 2.0, dtype=torch.bfloat16)}
        torch.save(weights, spec["saved_params"])
        r = fake_arm(spec["name"], 1.0, 1e9, 1e9, e2e=2.0 if spec["kind"] == "store" else None,
                     moved=1e9, identical=None, budget_mb=spec.get("budget_mb"))
        r.update(saved_params=spec["saved_params"], saved_mains=None, device="FakeGPU")
        return r

    monkeypatch.setattr(bench, "missing_requirements", lambda: None)
    monkeypatch.setattr(bench, "run_arm", fake_run_arm)
    out = tmp_path / "out.json"
    rc = bench.main(["--dir", str(tmp_path / "d"), "--json", str(out), "--hidden", "64", "--layers", "2",
                     "--heads", "4", "--ffn", "96", "--vocab", "128"])
    assert rc == 0
    assert seen == ["resident", "cpu-offload", "store-0", "store-50", "store-100", "store-budget"]
    r = json.loads(out.read_text())
    arms = r["arms"]
    assert arms["resident"]["identical"] == "reference" and r["device"] == "FakeGPU"
    assert arms["store-0"]["identical"]["identical"] is True
    assert arms["store-50"]["identical"]["identical"] is False
    assert arms["cpu-offload"]["identical"] is None
    assert r["ratios"]["store_100_over_cpu_offload_step"] is None
    assert "store-50" in r["report"] and not os.path.exists(tmp_path / "d")  # saved params and the dir are gone
    printed = capsys.readouterr().out
    assert "arm 2/6: cpu-offload" in printed and "arm cpu-offload FAILED" in printed


def test_a_failed_store_arm_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "missing_requirements", lambda: None)
    monkeypatch.setattr(bench, "run_arm", lambda spec, *a, **k: {"name": spec["name"], "ok": False, "error": "boom"})
    assert bench.main(["--dir", str(tmp_path / "d"), "--arms", "store", "--tiers", "0"]) == 1


def test_an_arm_process_without_cuda_reports_its_error(tmp_path):
    """The real arm process (python -m miles.bench.megatron_arm) on a machine without a GPU: it writes
    a result with the error instead of numbers, and the parent reads it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    spec = {"name": "resident", "kind": "resident", "shape": {}, "seed": 1, "lr": 1e-4, "steps": 1, "warmup": 0,
            "dir": str(tmp_path), "saved_params": str(tmp_path / "p.pt"), "saved_mains": str(tmp_path / "m.pt"),
            "result": str(tmp_path / "result.json")}
    lines = []
    r = bench.run_arm(spec, str(tmp_path), lines.append)
    assert r["ok"] is False and r["error"] and r["name"] == "resident"
    assert any("failed:" in l for l in lines)


def test_an_arm_killed_by_a_signal_says_which_and_what_sigkill_usually_means():
    assert bench.exit_reason(3) == "exited with status 3"
    assert bench.exit_reason(-15) == "was killed by SIGTERM"
    assert bench.exit_reason(-9).startswith("was killed by SIGKILL (what Linux's out-of-memory killer sends")


def test_report_shows_where_host_memory_peaked():
    results = fake_results()
    arm = results["arms"]["store-0"]
    arm.update(rss_peak_after_optimizer_bytes=1e9, rss_peak_after_bind_bytes=12e9)
    for row, peak in zip(arm["rows"], (12e9, 12e9, 12e9, 12e9)):
        row["rss_peak_bytes"] = peak
    text = rep.report(results)
    assert "store-0 1.00 / 12.00 / 12.00 / 12.00 / 12.00 / 12.00" in text
    assert "since the previous step returned" in text


def test_an_arm_reports_its_own_peak_rss_not_its_parents():
    """getrusage's ru_maxrss survives fork + exec: an arm started by a parent that held 12 GB reported
    12 GB (seen on the H200). The arm's peak is its own VmHWM."""
    import subprocess
    import sys

    parent_bytes = 1536 << 20
    held = bytearray(parent_bytes)
    held[::4096] = b"\x01" * len(held[::4096])  # touch every page: resident
    code = ("import resource; from miles.process_memory import peak_rss_bytes; "
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    own, inherited = map(int, out.split())
    assert inherited >= parent_bytes  # the artefact the bench no longer reports
    assert own < parent_bytes / 2
    del held


def test_report_shows_the_first_step_after_a_load():
    results = fake_results()
    step = {"seconds": 8.0, "disk_bytes_read": 0, "cache_bytes_read": 16.4e9}
    results["arms"]["store-100"]["after_load"] = {
        "save_seconds": 20.0, "at_once_load_seconds": 9.0, "after_fill_load_seconds": 9.5, "fill_seconds": 7.5,
        "at_once": step, "after_fill": step | {"seconds": 0.5}}
    line = next(l for l in rep.report(results).splitlines() if "first step after a load" in l)
    assert "at once 8.000 s" in line and "after the tier's read-ahead landed (7.50 s after the load) 0.500 s" in line
    assert "ratio 0.062x" in line and "host cache 16.40 GB" in line
    assert "first step after a load" not in rep.report(fake_results())  # only with --after-load


def test_report_says_what_the_save_wrote_against_the_state():
    results = fake_results()
    step = {"seconds": 8.0, "disk_bytes_read": 0, "cache_bytes_read": 16.4e9}
    results["arms"]["store-100"]["after_load"] = {
        "save_seconds": 9.0, "at_once_load_seconds": 9.0, "after_fill_load_seconds": 9.5, "fill_seconds": 7.5,
        "at_once": step, "after_fill": step | {"seconds": 0.5}, "state_bytes": 16.0e9,
        "save_checkpoint_bytes": 16.0e9 + 4096, "save_disk_write_bytes": 16.08e9}
    line = next(l for l in rep.report(results).splitlines() if "first step after a load" in l)
    assert "checkpoint files 16.00 GB for 16.00 GB of state, 16.08 GB written to disk (1.005x the state)" in line
    results["arms"]["store-100"]["after_load"]["save_disk_write_bytes"] = None  # /proc/self/io unreadable
    line = next(l for l in rep.report(results).splitlines() if "first step after a load" in l)
    assert line.endswith("checkpoint files 16.00 GB for 16.00 GB of state")


def test_disk_write_bytes_counts_this_process_s_writes(tmp_path):
    from miles.bench.common import tree_file_bytes
    from miles.process_memory import disk_write_bytes

    before = disk_write_bytes()
    assert before is not None, "/proc/self/io is not readable: miles runs on Linux"
    (tmp_path / "d").mkdir()
    with open(tmp_path / "d" / "f", "wb") as f:
        f.write(b"\1" * (8 << 20))
        f.flush()
        os.fsync(f.fileno())
    assert disk_write_bytes() - before >= 8 << 20
    assert tree_file_bytes(str(tmp_path)) == 8 << 20
