"""End-to-end RL loop on a local Ray cluster (CPU): 2 train ranks + 1 rollout engine, colocated,
streamed optimizer state + disk trainer offload, tiny model.

1. three rollouts, saving at 2 (and at the end); per-rank directories exist during the run, gone after;
2. a second run with --load <checkpoint of rollout 2> continues at rollout 2 and really loads the
   streamed optimizer state: its first step reads all three segments, i.e. 3x what the very first step
   of the first run read (mains only, before Adam has moments; fp32 moments);
3. an actor that raises stops the run with the actor's traceback, and the temporary directories are
   removed.
"""

import json
import logging
import os
import threading
import time

import pytest

pytestmark = pytest.mark.e2e


def _args(tmp, *extra):
    from miles.config import parse_args
    from miles.preflight import validate_args

    argv = ["--tiny-model", "--num-train-ranks", "2", "--num-rollout-engines", "1", "--colocate",
            "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
            "--offload-train-plan", "offload-all",  # the disk offload itself (the plan: test_sleep_plan_e2e.py)
            "--offload-train-disk-dir", str(tmp / "offload"),
            "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "8", "--micro-batch-size", "2", *extra]
    return validate_args(parse_args(argv))


class _DirWatcher:
    """Polls the per-rank directories while the run is in progress (the run is synchronous)."""

    def __init__(self, dirs):
        self.dirs = list(dirs)
        self.seen = {d: False for d in self.dirs}
        self.files_seen = {d: set() for d in self.dirs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            for d in self.dirs:
                if os.path.isdir(d):
                    self.seen[d] = True
                    try:
                        self.files_seen[d].update(os.listdir(d))
                    except FileNotFoundError:
                        pass
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_train_save_resume_streamed_state(ray_cluster, tmp_path):
    from miles.train import run

    t0 = time.perf_counter()
    save = tmp_path / "ckpt"
    args = _args(tmp_path, "--save", str(save), "--save-interval", "2",
                 "--metrics-file", str(tmp_path / "run1.jsonl"))
    rank_dirs = [args.paths.rank_dir(0, r) for r in range(2)]
    assert rank_dirs[0].endswith(os.path.join("offload", "trainer", "cell0_rank0"))
    with _DirWatcher(rank_dirs) as watch:
        summary = run(args)
    run1_seconds = time.perf_counter() - t0

    # per-rank directories existed during the run (the offload file appeared while asleep) and are gone
    assert all(watch.seen.values()), watch.seen
    assert all("offload.bin" in files for files in watch.files_seen.values()), watch.files_seen
    assert not any(os.path.exists(d) for d in rank_dirs)
    assert not os.path.exists(args.paths.optimizer_state) or not os.listdir(args.paths.optimizer_state)

    recs = _records(tmp_path / "run1.jsonl")
    assert [r["rollout_id"] for r in recs] == [0, 1, 2]
    ck2, ck3 = str(save / "rollout_000002"), str(save / "rollout_000003")
    assert summary.checkpoints == [ck2, ck3]
    assert recs[1]["checkpoint"] == ck2 and recs[0]["checkpoint"] is None
    for r in recs:
        assert r["offload_bytes"] > 0 and r["sleep_seconds"] >= 0 and r["wake_seconds"] >= 0
        assert len(r["stream_bytes_read_per_rank"]) == 2
    first_read = recs[0]["stream_bytes_read_per_rank"]
    steady_read = recs[1]["stream_bytes_read_per_rank"]
    # the first step reads mains only; from the second step on main + exp_avg + exp_avg_sq (fp32)
    assert all(s == 3 * f for f, s in zip(first_read, steady_read)), (first_read, steady_read)
    meta = json.loads((save / "rollout_000002" / "meta.json").read_text())
    assert meta["next_rollout_id"] == 2 and meta["data_state"]["consumed_prompts"] == 8
    assert (save / "rollout_000002" / "nvme_opt_state" / "rank00001").is_dir()

    # ---- resume from rollout 2
    t1 = time.perf_counter()
    args2 = _args(tmp_path, "--load", ck2, "--metrics-file", str(tmp_path / "run2.jsonl"))
    summary2 = run(args2)
    run2_seconds = time.perf_counter() - t1
    assert summary2.start_rollout == 2
    assert all(info["optimizer"] == "streamed" for info in summary2.load_info), summary2.load_info
    recs2 = _records(tmp_path / "run2.jsonl")
    assert [r["rollout_id"] for r in recs2] == [2]
    resumed_read = recs2[0]["stream_bytes_read_per_rank"]
    assert all(r == 3 * f for f, r in zip(first_read, resumed_read)), (first_read, resumed_read)
    # same data position, same weights, same optimizer state: the resumed rollout 2 repeats the first run's
    assert recs2[0]["reward_mean"] == pytest.approx(recs[2]["reward_mean"])
    assert recs2[0]["loss"] == pytest.approx(recs[2]["loss"], rel=1e-4, abs=1e-7)
    assert not any(os.path.exists(d) for d in rank_dirs)

    # ---- resume the 2-rank checkpoint onto 1 rank: the store reshards from the manifests
    t2 = time.perf_counter()
    args3 = _args(tmp_path, "--load", ck2, "--num-train-ranks", "1", "--metrics-file", str(tmp_path / "run3.jsonl"))
    summary3 = run(args3)
    run3_seconds = time.perf_counter() - t2
    assert summary3.start_rollout == 2
    assert [info["optimizer"] for info in summary3.load_info] == ["streamed"], summary3.load_info
    recs3 = _records(tmp_path / "run3.jsonl")
    assert [r["rollout_id"] for r in recs3] == [2]
    # one rank now holds the whole state, moments included: it reads what both ranks read before
    assert recs3[0]["stream_bytes_read_per_rank"] == [sum(steady_read)], (recs3[0], steady_read)
    assert recs3[0]["reward_mean"] == pytest.approx(recs[2]["reward_mean"])
    assert recs3[0]["loss"] == pytest.approx(recs[2]["loss"], rel=1e-4, abs=1e-6)
    print(f"\ne2e timing: run1 {run1_seconds:.1f}s, run2 {run2_seconds:.1f}s, run3 (DP 2->1) {run3_seconds:.1f}s")


def test_actor_failure_stops_run_with_traceback(ray_cluster, tmp_path, failing_backend, caplog, capfd):
    from miles.train import RunError, run

    # failing_backend: rank 1 raises in the train call of rollout 1
    args = _args(tmp_path, "--metrics-file", str(tmp_path / "fail.jsonl"))
    rank_dirs = [args.paths.rank_dir(0, r) for r in range(2)]
    t0 = time.perf_counter()
    with caplog.at_level(logging.ERROR, logger="miles"), pytest.raises(RunError) as err:
        run(args)
    seconds = time.perf_counter() - t0
    message = str(err.value)
    # one line naming the actor and the cause; the actor's own traceback (frames of the remote call) is
    # logged once, not repeated in the error, by Ray, or per waiting rank
    assert "\n" not in message and "injected fault" in message and "rank 1" in message, message
    assert "\x1b[" not in message
    assert sum("failing_backend.py" in r.getMessage() and "in train" in r.getMessage() for r in caplog.records) == 1
    # nothing else prints it (Ray's actor log, unhandled-error reports); the log line itself reaches this
    # capture only when this test installed the logging handler, hence <= 1
    printed = "".join(capfd.readouterr())
    assert printed.count('failing_backend.py", line') <= 1, printed
    assert [r["rollout_id"] for r in _records(tmp_path / "fail.jsonl")] == [0]  # stopped at rollout 1
    assert not any(os.path.exists(d) for d in rank_dirs)
    leftovers = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path / "offload") for f in fs]
    assert leftovers == [], leftovers
    print(f"\ne2e timing: failing run {seconds:.1f}s")
