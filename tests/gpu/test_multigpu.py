"""Multi-GPU validation (issue 8): needs >= 2 GPUs and megatron-core; skipped otherwise."""

import os
import subprocess
import sys

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs >= 2 GPUs", allow_module_level=True)
pytest.importorskip("megatron.core")


def test_megatron_moe_dp2_ep2_bit_exact(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "multigpu_megatron.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script,
                          str(tmp_path)], capture_output=True, text=True, timeout=400)
    print(out.stdout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "store tree:" in out.stdout and "rank00001/opt0_1" in out.stdout
    assert os.listdir(tmp_path) == []
