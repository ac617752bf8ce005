"""`miles train` and the Ray clusters a user started on the machine (issue 51): without RAY_ADDRESS the run starts
a private cluster of its own and finishes, leaving a user's `ray start` cluster (live, or dead but recorded as
the latest) untouched; with RAY_ADDRESS every connect and wait is bounded and ends in one line.

The user's cluster is a real `ray start --head` in a session of its own, with its own temp dir and ports; only
that session's processes are stopped afterwards (never `ray stop`: it stops every Ray on the machine). A run
that hangs (the old behaviour) is killed the same way, by its session."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
RUN_TIMEOUT_S = 240  # a tiny run takes ~30 s on 2 busy cores; the old code waited 120 s, or forever


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (the Ray daemons a `ray start` or a run left there)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _stop_session(sid: int) -> None:
    """SIGTERM, then SIGKILL, to every process of session ``sid`` (one we started), and nothing else."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while _session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _session_pids(sid):
            return


def _env(ray_tmpdir: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmpdir, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_object_store_memory=str(200 << 20),
               PYTHONPATH=str(REPO), **extra)
    return env


@pytest.fixture()
def scratch():
    """A short folder under /tmp for Ray's temp dirs (its socket paths must stay under 108 characters, which
    pytest's tmp_path can exceed); RAY_TMPDIR points here, so it also holds what Ray takes as "the latest
    cluster" (ray/ray_current_cluster), away from other Ray users of the machine."""
    path = tempfile.mkdtemp(prefix="rpc_", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def users_cluster(scratch):
    """`ray start --head --num-cpus 1` as a user would type it, in its own session; stopped by that session."""
    port = _free_port()
    log = Path(scratch, "ray-start.log")
    proc = subprocess.Popen([RAY, "start", "--head", "--port", str(port), "--num-cpus", "1",
                             "--temp-dir", os.path.join(scratch, "ray"), "--include-dashboard=false",
                             "--dashboard-port", str(_free_port()),
                             "--object-store-memory", str(100 << 20), "--disable-usage-stats"],
                            env=_env(scratch), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    sid = proc.pid  # start_new_session: the daemons it leaves stay in the session it led
    try:
        # a file, not a pipe: the daemons it leaves may hold its stdout open
        assert proc.wait(timeout=120) == 0, log.read_text()
        yield {"address": f"127.0.0.1:{port}", "sid": sid, "pids": sorted(_session_pids(sid))}
    finally:
        _stop_session(sid)


def _train(tmp_path, env, *argv, timeout=RUN_TIMEOUT_S):
    """`miles train` (the issue's command, its files under tmp_path) in a session of its own: returns
    (exit code, stderr, seconds); a run still going after ``timeout`` is stopped with its Ray and fails."""
    args = [sys.executable, "-m", "miles.cli", "train", "--tiny-model", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
            "--micro-batch-size", "2", "--metrics-file", str(tmp_path / "metrics.jsonl"),
            "--offload-train-disk-dir", str(tmp_path / "root"), *argv]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_session(proc.pid)
        _, err = proc.communicate()
        pytest.fail(f"miles train was still running after {timeout} s:\n{err[-3000:]}")
    finally:
        _stop_session(proc.pid)  # whatever of its private Ray outlived it
    return proc.returncode, err, time.monotonic() - t0


def _driver_logs(scratch, session):
    return sorted(p.name for p in (Path(scratch) / "ray" / session / "logs").glob("python-core-driver-*"))


def test_a_run_without_ray_address_starts_its_own_cluster_beside_a_users(users_cluster, scratch, tmp_path):
    """The issue's repro: `ray start --head --num-cpus 1`, then `miles train --tiny-model --num-rollout 1`. The
    old run joined that cluster, waited 120 s for CPUs it lacks and ended in a traceback."""
    recorded = Path(scratch, "ray", "ray_current_cluster")
    assert recorded.read_text().strip() == users_cluster["address"]  # what a plain ray.init() would join
    (session,) = [p.name for p in Path(scratch, "ray").glob("session_2*")]
    code, err, _ = _train(tmp_path, _env(scratch))
    assert code == 0, err[-3000:]
    assert "starting a private Ray cluster" in err and "Traceback" not in err
    assert "run finished" in err
    # the user's cluster: every process alive, still the recorded latest, and no driver of ours ever joined it
    assert set(users_cluster["pids"]) <= set(_session_pids(users_cluster["sid"]))
    assert recorded.read_text().strip() == users_cluster["address"]
    assert _driver_logs(scratch, session) == []


def test_a_run_without_ray_address_ignores_a_dead_cluster_recorded_as_the_latest(scratch, tmp_path):
    """A `ray start` cluster that died stays recorded as the latest: plain ray.init() retried its address for
    10+ minutes without a word."""
    recorded = Path(scratch, "ray", "ray_current_cluster")
    recorded.parent.mkdir(parents=True)
    recorded.write_text(f"127.0.0.1:{_free_port()}")
    code, err, _ = _train(tmp_path, _env(scratch), timeout=180)
    assert code == 0, err[-3000:]
    assert "starting a private Ray cluster" in err and "run finished" in err and "Traceback" not in err


def test_a_dead_ray_address_stops_in_one_line_naming_it(scratch, tmp_path):
    address = f"127.0.0.1:{_free_port()}"
    code, err, seconds = _train(tmp_path, _env(scratch, RAY_ADDRESS=address), timeout=90)
    assert code == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"miles train: run stopped: RAY_ADDRESS={address}: no Ray cluster answers at {address}"), err
    assert "unset it to run on a private single-node cluster" in last
    assert seconds < 60


def test_joining_a_cluster_that_cannot_hold_the_run_stops_in_one_line_naming_both(users_cluster, scratch,
                                                                                  tmp_path):
    """RAY_ADDRESS names the user's 1-CPU cluster; the run's 2 bundles (a train rank and an engine) cannot fit:
    one line with what was asked and what the cluster has, at once, instead of 120 s and a traceback."""
    address = users_cluster["address"]
    code, err, seconds = _train(tmp_path, _env(scratch, RAY_ADDRESS=address), timeout=150)
    assert code == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("miles train: run stopped: the run asks for 2 bundles of CPU=1, GPU=0 (CPU=2, GPU=0 in "
                           f"all), and the Ray cluster at {address} has CPU=1, GPU=0 in all"), err
    assert "--num-train-ranks" in last
    assert seconds < 100
    assert set(users_cluster["pids"]) <= set(_session_pids(users_cluster["sid"]))  # the cluster lives on
    (session,) = [p.name for p in Path(scratch, "ray").glob("session_2*")]
    assert _driver_logs(scratch, session) != []  # a run that joins leaves its driver's log in the cluster's session


def test_a_placement_group_whose_resources_other_jobs_hold_stops_after_its_wait_in_one_line(ray_cluster,
                                                                                          make_config):
    """The cluster could hold the run, but another job holds its CPUs: the wait ends with one line naming what was
    asked, what the cluster has and what stayed free (it was a RuntimeError traceback)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from miles.ray.placement_group import PlacementError, create_placement_group

    others = placement_group([{"CPU": 4}])  # the session cluster's every CPU
    ray_cluster.get(others.ready())
    try:
        with pytest.raises(PlacementError) as caught:
            create_placement_group(make_config("--tiny-model"), timeout_s=1)
    finally:
        remove_placement_group(others)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the run asks for 2 bundles of CPU=1, GPU=0 (CPU=2, GPU=0 in all), and the Ray cluster "
                              "at "), message
    assert "has CPU=4, GPU=0, of which CPU=0, GPU=0 stayed free for 1 s (other jobs hold the rest)" in message
