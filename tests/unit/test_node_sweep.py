"""Teardown on several nodes: the driver sweeps its own node and aggregates the other nodes' sweeps into its
one info line and one warning (which node each entry is on); on one node its lines are what they were.
The sweeps themselves run on a simulated cluster in tests/e2e/test_multinode_placement.py."""

import dataclasses
import os

from miles.ray.node_sweep import NodeSweep, left_entries, removed_line
from miles_plugins.host.ownership import Sweep

OTHER = NodeSweep("abcdef0123456789", "10.0.0.2", ("/r/trainer", "/r/rollout"),
                  ("/r/theirs.txt (not made by this run)",))


def _config(make_config, tmp_path):
    cfg = make_config("--tiny-model", "--offload-train-target", "disk", "--offload-train-disk-dir",
                      str(tmp_path / "root"))
    return dataclasses.replace(cfg, run_id="test")


def test_one_node_lines_are_unchanged():
    here = Sweep(["/r/trainer"], ["/r/x (not made by this run)"])
    assert removed_line("/r", here, []) == "removed 1 directory this run made under /r"
    assert removed_line("/r", Sweep(["/r/a", "/r"], []), []) == "removed 2 directories this run made under /r"
    assert removed_line("/r", Sweep([], ["/r/x"]), []) is None
    assert left_entries(here, []) == ["/r/x (not made by this run)"]


def test_other_nodes_are_counted_and_named():
    here = Sweep(["/r/optimizer_state"], ["/r/mine.txt"])
    assert removed_line("/r", here, [OTHER]) == ("removed 3 directories this run made under /r "
                                                 "(this node 1, node abcdef012345 (10.0.0.2) 2)")
    assert removed_line("/r", Sweep([], []), [OTHER]).startswith("removed 2 directories")
    assert left_entries(here, [OTHER]) == ["this node: /r/mine.txt",
                                           "node abcdef012345 (10.0.0.2): /r/theirs.txt (not made by this run)"]


def test_driver_warns_once_for_all_nodes(make_config, tmp_path, caplog):
    from miles.run_lifecycle import claim_run_root, remove_run_directories

    cfg = _config(make_config, tmp_path)
    (tmp_path / "root").mkdir()  # the user's directory: not the run's to remove
    (tmp_path / "root" / "notes.txt").write_text("not the run's")
    claim_run_root(cfg).release()
    with caplog.at_level("INFO", logger="miles.train"):
        removed = remove_run_directories(cfg, [OTHER])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(warnings) == 1
    assert f"this node: {tmp_path / 'root' / 'notes.txt'}" in warnings[0]
    assert "node abcdef012345 (10.0.0.2): /r/theirs.txt" in warnings[0]
    # trainer/, optimizer_state/, rollout/ here + 2 on the other node
    assert removed == 5 and infos == [f"removed 5 directories this run made under {cfg.paths.root} "
                                      "(this node 3, node abcdef012345 (10.0.0.2) 2)"]
    assert os.listdir(cfg.paths.root) == ["notes.txt"]


def _fake_ray(monkeypatch, here):
    import ray

    class Context:
        def get_node_id(self):
            return here

    monkeypatch.setattr(ray, "get_runtime_context", Context)


def test_teardown_sweeps_only_the_other_nodes_and_waits_for_local_pids_only(make_config, tmp_path, monkeypatch):
    import miles.run_lifecycle as run_lifecycle

    cfg = _config(make_config, tmp_path)
    calls, waited = [], []
    monkeypatch.setattr(run_lifecycle, "sweep_nodes",
                        lambda nodes, root, run_id, pids: calls.append((nodes, pids)) or [])
    monkeypatch.setattr(run_lifecycle, "wait_for_exit", waited.append)
    _fake_ray(monkeypatch, "driver")
    pids = {"driver": [11], "other": [22]}
    run_lifecycle.sweep_actor_nodes(cfg, ["driver"], {"driver": [11]})  # one node: nothing to sweep remotely
    run_lifecycle.sweep_actor_nodes(cfg, ["driver", "other"], pids)
    assert calls == [([], {"driver": [11]}), (["other"], pids)]
    assert waited == [[11], [11]]  # the other node's pids are waited for there, by its sweep


def test_actor_pids_are_grouped_by_node():
    from miles.run_lifecycle import RunState, actor_pids_by_node

    state = RunState(run_dir="/run", metrics_file="/run/metrics.jsonl",
                     train_ranks=[{"node_id": "a", "pid": 1}, {"node_id": "b", "pid": 2}],
                     rollout_engines=[{"node_id": "a", "pid": 3}])
    assert actor_pids_by_node(state) == {"a": [1, 3], "b": [2]}
    assert actor_pids_by_node(RunState(run_dir="/run", metrics_file="/run/metrics.jsonl")) == {}
