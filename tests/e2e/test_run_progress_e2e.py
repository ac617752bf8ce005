"""`miles train` on a terminal (issue 51: no progress bar appeared, not even in a terminal, and the waits before the
first rollout were silent for up to 2 minutes): each long wait shows what it waits for and the time so far, and
the rollout bar runs, on a pty that reports no size as on any other."""

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_a_run_on_a_terminal_shows_its_waits_and_the_rollout_bar(tmp_path):
    master, slave = os.openpty()  # 0 x 0: no window size
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(REPO),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_object_store_memory": str(200 << 20), "TMPDIR": "/tmp"}
    argv = [sys.executable, "-m", "miles.cli", "train", "--tiny-model", "--num-train-ranks", "1",
            "--num-rollout-engines", "1", "--colocate", "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--micro-batch-size", "2",
            "--metrics-file", str(tmp_path / "metrics.jsonl"), "--offload-train-disk-dir", str(tmp_path / "root")]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the pty's other end closed: the run is over
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = shown.decode(errors="replace")
    assert code == 0, text[-3000:]
    for wait in ("preparing the policy model: 00:", "starting a private Ray cluster: 00:",
                 "placing 1 bundles of CPU=1, GPU=0 (CPU=1, GPU=0 in all): 00:",
                 "starting 1 train actor(s) and 1 rollout engine(s): 00:"):
        assert f"\r{wait}" in text, (wait, text[-3000:])
    assert "\rrollouts:" in text and "2/2 [" in text, text[-3000:]  # the bar, ticking to the end
    assert "\rrollout 1/2:" in text  # the rollout in progress, on the bar
