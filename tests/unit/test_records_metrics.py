"""The metrics file keeps every record a run did not itself write again.

Each record names the run that wrote it (``run_id``); a checkpoint's meta names the runs whose rollouts
lead to it (``runs``). A fresh or ``--finetune`` run appends and drops nothing; a resumed run (``--load``
without ``--finetune``) re-runs the rollouts from the checkpoint on and supersedes only those records of
the runs the checkpoint names. One line says what was kept and replaced."""

import json
import logging
import os

import pytest

from miles import checkpoint, train
from miles.metrics import MetricsSink, superseded_lines
from miles.run_lifecycle import RunState


def _record(rollout_id, run_id=None, **more):
    rec = {"rollout_id": rollout_id, "reward_mean": float(rollout_id), **more}
    if run_id is not None:
        rec["run_id"] = run_id
    return json.dumps(rec, sort_keys=True) + "\n"


def _records(path):
    """(rollout, run) of each record in the file, in order; other lines are left out."""
    return [(r["rollout_id"], r.get("run_id")) for r in map(json.loads, (line for line in open(path)
                                                                          if line.startswith("{")))]


def _write_rollouts(sink, rollouts):
    for i in rollouts:
        sink.write({"rollout_id": i, "reward_mean": 10.0 * i})
    sink.close()


def test_superseded_lines_are_the_resumed_runs_records_from_the_resume_on():
    lines = [_record(0, "a"), _record(2, "a"), _record(3, "b"), _record(2), "not json\n", "[2]\n",
             _record(5, "c"), json.dumps({"rollout_id": "2", "run_id": "a"}) + "\n"]
    assert superseded_lines(lines, ["a", "c"], 2) == [False, True, False, False, False, False, True, False]
    assert superseded_lines(lines, [], 0) == [False] * len(lines)  # a fresh run supersedes nothing


@pytest.mark.parametrize("start_rollout", [0, 2])
def test_a_fresh_or_finetune_run_appends_and_keeps_every_earlier_line(tmp_path, caplog, start_rollout):
    path = tmp_path / "metrics.jsonl"
    earlier = [_record(i, "first") for i in range(4)] + ["a note\n", _record(1)]
    path.write_text("".join(earlier))
    with caplog.at_level(logging.INFO, logger="miles.train"):
        sink = MetricsSink(str(path), None, "second", superseded_runs=(), start_rollout=start_rollout)
    _write_rollouts(sink, range(2))
    lines = path.read_text().splitlines(keepends=True)
    assert lines[:len(earlier)] == earlier
    assert _records(path) == [(i, "first") for i in range(4)] + [(1, None), (0, "second"), (1, "second")]
    assert [r.getMessage() for r in caplog.records] == [f"metrics: appending to {path}; kept its 6 earlier line(s)"]


def test_a_resume_supersedes_only_the_resumed_runs_records_of_the_rollouts_it_reruns(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join([_record(i, "a") for i in range(3)] + [_record(i, "b") for i in range(3, 6)]
                            + [_record(4, "sibling"), _record(5), "a note\n"]))
    with caplog.at_level(logging.INFO, logger="miles.train"):
        sink = MetricsSink(str(path), None, "c", superseded_runs=["a", "b"], start_rollout=4)
    _write_rollouts(sink, [4, 5])
    assert _records(path) == [(0, "a"), (1, "a"), (2, "a"), (3, "b"), (4, "sibling"), (5, None),
                              (4, "c"), (5, "c")]
    assert "a note" in path.read_text()
    assert [r.getMessage() for r in caplog.records] == [
        f"metrics: appending to {path}; kept 7 earlier line(s), replaced 2 record(s) of rollouts >= 4 written by "
        "run(s) a, b, whose history this resumed run continues (it writes them again)"]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # the replacement left no temporary behind


def test_a_record_cut_short_by_a_crash_stays_and_the_next_starts_on_its_own_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_record(0, "a") + '{"rollout_id": 1, "rew')
    _write_rollouts(MetricsSink(str(path), None, "b"), [0])
    assert path.read_text().splitlines() == [_record(0, "a").strip(), '{"rollout_id": 1, "rew',
                                             _record(0, "b", reward_mean=0.0).strip()]


def test_a_failed_replacement_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    text = "".join(_record(i, "a") for i in range(3))
    path.write_text(text)

    def fail(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        MetricsSink(str(path), None, "b", superseded_runs=["a"], start_rollout=1)
    assert path.read_text() == text


def test_checkpoint_meta_names_its_runs_and_a_malformed_field_supersedes_nothing(tmp_path, caplog):
    base = checkpoint.prepare(str(tmp_path / "save"), 2)
    checkpoint.write_meta(base, next_rollout_id=2, data_state={}, world_size=1, runs=["a", "b"])
    assert checkpoint.runs_of(checkpoint.read_meta(base)) == ["a", "b"]
    assert checkpoint.runs_of({"next_rollout_id": 2}) == []  # written before the field
    with caplog.at_level(logging.WARNING):
        assert checkpoint.runs_of({"runs": "a"}) == [] and checkpoint.runs_of({"runs": [1]}) == []
    assert caplog.text.count("not a list of run ids: ignored") == 2


class _Group:
    """The train group as _resume sees it: loading a checkpoint reports what it loaded."""

    def load(self, base, load_optimizer):
        return [{"optimizer": "state_dict" if load_optimizer else "skipped"}]


def _run(make_config, save, run_id, rollouts, *flags, completed=None):
    """A run as the driver does it: resume (or not), its records into the default <save>/metrics.jsonl,
    and a checkpoint after ``completed`` rollouts (default: all of them) naming its runs."""
    config = make_config("--save", str(save), "--metrics-file", str(save / "metrics.jsonl"), *flags)
    state = RunState(run_dir=str(save), metrics_file=config.logging.metrics_file)
    target = checkpoint.resume_target(config.checkpoint.load, config.checkpoint.loads_optimizer_state,
                                      config.parallel_layout)
    start, _ = train._resume(config, _Group(), state, target)
    assert start == rollouts[0]
    _write_rollouts(MetricsSink(config.logging.metrics_file, None, run_id, state.resumed_runs, start),
                    rollouts)
    completed = rollouts[-1] + 1 if completed is None else completed
    base = checkpoint.prepare(str(save), completed, run_id)
    checkpoint.write_meta(base, next_rollout_id=completed, data_state={}, world_size=1,
                          runs=[*state.resumed_runs, run_id])
    checkpoint.publish(str(save), base)
    return state


def test_load_finetune_save_on_one_folder_keeps_the_first_runs_history(make_config, tmp_path):
    save = tmp_path / "S"
    _run(make_config, save, "first", [0, 1, 2, 3])
    # the finetune saves after rollout 1 and goes on to write rollout 2 before it stops
    state = _run(make_config, save, "tuned", [0, 1, 2], "--load", str(save), "--finetune", completed=2)
    assert state.resumed_runs == []
    assert _records(save / "metrics.jsonl") == [(0, "first"), (1, "first"), (2, "first"), (3, "first"),
                                                (0, "tuned"), (1, "tuned"), (2, "tuned")]
    # its resume re-runs rollout 2: the finetune's record of it is superseded, the first run's stays
    state = _run(make_config, save, "resumed", [2, 3], "--load", str(save))
    assert state.resumed_runs == ["tuned"]
    assert _records(save / "metrics.jsonl") == [(0, "first"), (1, "first"), (2, "first"), (3, "first"),
                                                (0, "tuned"), (1, "tuned"), (2, "resumed"), (3, "resumed")]
    assert checkpoint.runs_of(checkpoint.read_meta(checkpoint.resolve(str(save)))) == ["tuned", "resumed"]
