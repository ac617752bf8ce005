"""`miles train --train-backend megatron` end to end on CPU: 2 train ranks at TP2 through Ray's actors over gloo,
colocated with the embedded engine (trainer offload at sleep, the weight handoff), the optimizer state streamed,
a checkpoint saved.

megatron-core 0.19.2 patched for CPU by the test harness (tests/megatron_cpu) reaches the run through
PYTHONPATH only: the CLI's validation in the driver sees it (a build for CPU, '+cpu'), and the actors inherit the
driver's PYTHONPATH (miles/ray/actor_factory.py). The run is a subprocess, as a user starts it, with its own
private Ray cluster, so this test process never imports megatron.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
ROLLOUTS = 2


def test_miles_train_megatron_tp2_on_cpu_through_ray(tmp_path, megatron_cpu):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["train", "--train-backend", "megatron", "--tiny-model", "--num-train-ranks", "2",
            "--tensor-model-parallel-size", "2", "--experimental-model-parallel", "--colocate",
            "--num-rollout", str(ROLLOUTS), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--model-dtype", "bf16",
            "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
            "--offload-train-disk-dir", str(tmp_path / "offload"), "--save", str(tmp_path / "ckpt"),
            "--metrics-file", str(metrics)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (megatron_cpu, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", "import sys; from miles.cli import main; sys.exit(main(sys.argv[1:]))",
                           *argv], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout[-6000:] + "\n" + done.stderr[-6000:]
    assert done.returncode == 0, log
    records = [json.loads(line) for line in open(metrics)]
    print("\n" + "\n".join(str({k: r.get(k) for k in ("rollout_id", "loss", "grad_norm", "stream_read_gb",
                                                         "weight_handoff_bytes")}) for r in records))
    assert [r["rollout_id"] for r in records] == list(range(ROLLOUTS)), log
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records), records
    assert all(r["stream_read_gb"] > 0 and r["weight_handoff_bytes"] > 0 for r in records), records
    saved = sorted(os.listdir(tmp_path / "ckpt"))
    assert any(name.startswith("rollout_") for name in saved), saved
