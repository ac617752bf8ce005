"""`miles bench megatron` on a tiny GPTModel, every arm in its own process, on one GPU.

Run on the GPU host: `python -m pytest -q -s tests/gpu/test_bench_megatron.py` (needs CUDA and
megatron-core). The store arms must be bit-identical to the resident DistributedOptimizer (fp32
moments); Megatron's CPU offload either produces numbers or reports why Megatron refused it.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--hidden", "256", "--layers", "2", "--heads", "4", "--ffn", "512", "--vocab", "1024", "--seq-len", "128",
        "--steps", "2", "--warmup", "1", "--budget-mb", "4", "--arm-timeout", "300", "--after-load"]


def test_every_arm_runs_and_the_store_is_bit_identical(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "miles.bench.megatron", "--dir", str(tmp_path / "d"), "--json",
                           str(out), *TINY], cwd=REPO, capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-8000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    arms = r["arms"]
    assert list(arms) == ["resident", "cpu-offload", "store-0", "store-50", "store-100", "store-budget"]
    assert arms["resident"]["params"] == r["params_predicted"]
    for name, a in arms.items():
        if name == "cpu-offload" and not a["ok"]:
            assert a["error"], "a refused cpu-offload arm says why"
            print(f"\ncpu-offload refused by megatron-core: {a['error']}")
            continue
        assert a["ok"], f"{name}: {a.get('error')}"
        measured = [s for s in a["rows"] if s["measured"]]
        assert len(measured) == 2 and all(s["seconds"] > 0 and s["peak_bytes"] >= 0 for s in measured)
        assert a["rss_peak_bytes"] >= a["rss_bytes"] > 0 and a["state_bytes"] >= 12 * a["streamed_numel"]
        if name.startswith("store"):
            assert all(s["end_to_end_seconds"] >= s["seconds"] for s in measured)
            state = 12 * a["streamed_numel"]  # fp32 mains + moments, read and written every step
            assert all(0.99 * state <= s["bytes_read"] <= a["state_bytes"] and s["bytes_written"] > 0 for s in measured)
            assert a["identical"]["identical"] is True, f"{name}: {a['identical']}"
    assert arms["store-100"]["host_cache_mb"] * (1 << 20) >= arms["store-100"]["state_bytes"]
    # --after-load: a tier holding the whole state keeps every bucket in RAM only, and a load reads the
    # checkpoint straight back into RAM: the first step after it reads no disk even at once, nothing to refill
    after = arms["store-100"]["after_load"]
    for label in ("at_once", "after_fill"):
        assert after[label]["disk_bytes_read"] == 0 and after[label]["cache_bytes_read"] > 0, (label, after[label])
        assert after[label]["tier_fill_bytes"] == 0, (label, after[label])
    assert "after_load" not in arms["store-0"] and "first step after a load" in r["report"]
    assert arms["store-budget"]["store"]["device_budget_bytes"] == 4 << 20
    assert arms["store-budget"]["store"]["residency_bound_bytes"] <= 4 << 20
    if arms["cpu-offload"]["ok"]:
        print(f"\ncpu-offload vs resident: {arms['cpu-offload']['identical']}")
    assert "store 100% tier step / cpu-offload step" in r["report"]
    assert not os.path.exists(tmp_path / "d")  # store files and saved params removed
