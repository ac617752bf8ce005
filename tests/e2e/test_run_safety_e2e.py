"""Run-level safety of the disk with real runs (issue 13, CPU, tiny model).

1. teardown of an ordinary run leaves what it did not make (a results.csv placed before the run, another
   job's store directory) and lists it in one warning; the issue found both deleted;
2. ``miles train`` interrupted by SIGTERM / SIGINT: exit 128 + signum, one line, no traceback, none of
   the run's directories left; while the first run holds the root a second run on it exits 2 naming it.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _argv(tmp, num_rollout):
    return ["--tiny-model", "--num-train-ranks", "1", "--num-rollout-engines", "1", "--colocate",
            "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
            "--offload-train-disk-dir", str(tmp / "root"), "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--micro-batch-size", "2", "--metrics-file", str(tmp / "metrics.jsonl")]


def _place_foreign_files(root):
    from miles_plugins.host.ownership import make_directory

    results = root / "rollout" / "engine0" / "results.csv"
    results.parent.mkdir(parents=True)
    results.write_text("placed before the run")
    theirs = root / "optimizer_state" / "rank00000" / "opt3_0"
    theirs.parent.mkdir(parents=True)
    make_directory(str(theirs), "another-job")
    (theirs / "bucket00000.bin").write_bytes(b"\x07" * 4096)
    return results, theirs


def _this_runs_directories(root, run_id):
    """Directories under root whose marker names run_id (none may survive the run)."""
    from miles_plugins.host.ownership import created_by

    found = []
    for dirpath, dirnames, _ in os.walk(root):
        found += [os.path.join(dirpath, d) for d in dirnames if created_by(os.path.join(dirpath, d), run_id)]
    return found


def test_teardown_leaves_what_the_run_did_not_make_and_lists_it(ray_cluster, tmp_path, caplog):
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.train import run

    results, theirs = _place_foreign_files(tmp_path / "root")
    config = validate_args(parse_args(_argv(tmp_path, 1)))
    with caplog.at_level(logging.INFO, logger="miles"):
        run(config)
    assert results.read_text() == "placed before the run"
    assert (theirs / "bucket00000.bin").read_bytes() == b"\x07" * 4096
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "miles.train"]
    assert len(warnings) == 1, warnings
    # the sweep does not enter folders the run did not make: they are listed whole
    assert f"{results.parent.parent} (not made by this run)" in warnings[0], warnings[0]
    assert f"{theirs.parent.parent} (not made by this run)" in warnings[0], warnings[0]
    assert "left behind" not in caplog.text
    assert _this_runs_directories(tmp_path / "root", config.run_id) == []
    assert not os.path.exists(config.paths.trainer), "trainer/ was made by the run: removed"


class _Run:
    """``miles train`` in a subprocess (``launch``: what runs ``miles.cli`` with ``train`` and the argv, on
    ``pythonpath``); stderr collected line by line."""

    def __init__(self, argv, tmp, launch=("-m", "miles.cli"), pythonpath=REPO):
        env = {**os.environ, "PYTHONPATH": pythonpath, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TMPDIR": "/tmp", "RAY_object_store_memory": str(200 << 20)}
        self.proc = subprocess.Popen([sys.executable, *launch, "train", *argv], cwd=tmp, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"{text!r} never appeared (exit {self.proc.poll()}):\n" + "\n".join(self.lines[-40:]))

    def finish(self, timeout=120):
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def _assert_interrupted(run, signum, root, code):
    name = signal.Signals(signum).name
    log = "\n".join(run.lines)
    assert code == 128 + signum, log
    assert "Traceback" not in log, log
    ours = [line for line in run.lines if line.startswith("miles train: interrupted")]
    assert len(ours) == 1 and f"interrupted by {name} after rollout " in ours[0], log
    assert "directories" in ours[0] or "directory" in ours[0]
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]
    assert not os.path.exists(root) or leftovers == [], leftovers


def test_sigterm_ends_the_run_with_its_cleanup_and_a_second_run_is_refused_meanwhile(tmp_path):
    first = _Run(_argv(tmp_path, 50), tmp_path)
    try:
        first.wait_for("rollout 1/50")
        second = _Run(_argv(tmp_path, 1), tmp_path)
        assert second.finish() == 2, "\n".join(second.lines)
        refusal = [line for line in second.lines if "in use by" in line]
        assert len(refusal) == 1 and f"pid {first.proc.pid}" in refusal[0], second.lines
        assert refusal[0].startswith("miles train: run root") and not any("Traceback" in x for x in second.lines)
        first.proc.send_signal(signal.SIGTERM)
        code = first.finish()
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    _assert_interrupted(first, signal.SIGTERM, tmp_path / "root", code)


def test_sigint_ends_the_run_with_its_cleanup_and_no_traceback(tmp_path):
    run = _Run(_argv(tmp_path, 50), tmp_path)
    try:
        run.wait_for("rollout 1/50")
        run.proc.send_signal(signal.SIGINT)
        code = run.finish()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    _assert_interrupted(run, signal.SIGINT, tmp_path / "root", code)
