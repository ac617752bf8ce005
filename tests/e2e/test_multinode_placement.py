"""Multi-node placement without a second machine: Ray's own multi-node test cluster on this host.

A head node with no CPUs (nothing runs where the driver is, as on a cluster whose driver is a login
node) and two worker nodes of 2 CPUs; later two nodes of 4 logical GPUs. Every node is a raylet of its
own, so `ray.get_runtime_context().get_node_id()` tells which node a process runs on. The cluster runs
in a subprocess (this file run as a script), because the session's `ray_cluster` fixture holds the
test process's Ray connection; the subprocess writes what it saw as JSON and the tests check it:

1. a node whose disk (as its probe task reports it; the test shrinks one node's report) is below the
   per-node need from `miles plan` stops `miles train` with one line naming that node and the numbers,
   before any train actor is made;
2. a real run (torch backend, --tiny-model, streamed state + disk offload, colocated): 4 train ranks,
   2 per node, ranks 0-1 on one node and 2-3 on the other; the 2 rollout engines one per node; every
   `cell0_rank<j>` directory made (its `.miles-created` marker) by the pid of rank j's actor, on rank
   j's node; the per-node disk check passed for both nodes; at the end a sweep task on each worker node
   removed the folders this run made under the root (`trainer/`, `optimizer_state/`, `rollout/`), and a
   file the run did not make stays and is listed in the one teardown warning, naming the node (the nodes
   share this host's disk, so the first node's sweep removes the shared folders and every node lists the
   file);
3. GPU bundles on nodes of 4 logical GPUs: 8 ranks fill the two nodes 4 + 4 in rank order, each with
   its own GPU id on its node, the colocated engines on each node's first rank.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytestmark = pytest.mark.e2e

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OBJECT_STORE_BYTES = 80 * 2**20
SHRUNK_FREE_BYTES = 1000  # what the test makes one node report: below any run's need


# ---- the tests (in the pytest process) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, f"the simulated cluster failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    with open(out / "seen.json") as f:
        facts = json.load(f)
    facts["wall_seconds"] = time.perf_counter() - t0
    print(f"multi-node simulation: {facts['wall_seconds']:.1f} s wall")
    return facts


def test_a_node_short_of_disk_stops_the_run_before_any_train_actor(seen):
    short = seen["short_disk"]
    victim = seen["cpu_nodes"][1]
    assert short["train_actors_made"] == 0
    (line,) = short["error"].splitlines()
    assert f"node {victim[:12]}" in line and f"node {seen['cpu_nodes'][0][:12]}" not in line
    assert "1.00 kB free" in line and "2 train rank(s)" in line
    assert "`miles plan`" in line


def test_train_ranks_of_one_node_are_consecutive_and_engines_spread(seen):
    run = seen["run"]
    nodes = seen["cpu_nodes"]
    rank_nodes = [r["node_id"] for r in sorted(run["train_ranks"], key=lambda r: r["rank"])]
    assert rank_nodes[0] == rank_nodes[1] != rank_nodes[2] == rank_nodes[3]
    assert set(rank_nodes) == set(nodes)  # nothing on the CPU-less head
    assert [e["node_id"] for e in run["rollout_engines"]] == [rank_nodes[0], rank_nodes[2]]
    # what each rank was told shares its node's host RAM (the auto host tier divides by it)
    assert [r["ranks_on_node"] for r in run["train_ranks"]] == [2, 2, 2, 2]


def test_each_rank_directory_was_made_on_its_node_by_its_actor(seen):
    run = seen["run"]
    assert run["markers"], "no rank directory was seen during the run"
    for rank in run["train_ranks"]:
        marker = run["markers"][rank["rank_dir"]]
        assert rank["rank_dir"].endswith(f"/trainer/cell0_rank{rank['rank']}")
        assert marker["pid"] == rank["pid"]  # made by this rank's actor, which reported rank["node_id"]
    made_on = {}
    for rank in run["train_ranks"]:
        made_on.setdefault(rank["node_id"], set()).add(os.path.basename(rank["rank_dir"]))
    assert sorted(map(sorted, made_on.values())) == [["cell0_rank0", "cell0_rank1"], ["cell0_rank2", "cell0_rank3"]]
    assert run["left_after"] == []  # and removed at the end


def test_each_node_disk_was_checked_against_the_plan(seen):
    nodes = {n["node_id"]: n for n in seen["run"]["nodes"]}
    assert set(nodes) == set(seen["cpu_nodes"])
    for n in nodes.values():
        assert len(n["ranks"]) == 2
        assert n["need_bytes"] == 2 * seen["run"]["need_per_rank"] <= n["free_bytes"]
    assert seen["run"]["need_per_rank"] > 0


def test_each_worker_node_was_swept_and_its_foreign_file_listed(seen):
    run = seen["run"]
    sweeps = {n["node_id"]: n for n in run["node_sweeps"]}
    assert set(sweeps) == set(seen["cpu_nodes"])  # not the driver's (head) node: the driver sweeps that one
    root = run["root"]
    parents = {os.path.join(root, d) for d in ("trainer", "optimizer_state", "rollout")}
    assert parents <= {p for n in sweeps.values() for p in n["removed"]}
    assert run["parents_after"] == []
    assert run["foreign_after"], "a file the run did not make was removed"
    (warning,) = run["warnings"]
    for node in seen["cpu_nodes"]:
        assert f"node {node[:12]} (" in warning and f"): {run['foreign']}" in warning


def test_gpu_bundles_fill_each_node_in_rank_order(seen):
    gpu = seen["gpu_layout"]
    nodes = gpu["nodes"]
    ranks = gpu["ranks"]  # [(node, gpu ids)] by rank
    assert [r[0] for r in ranks] == [nodes[0]] * 4 + [nodes[1]] * 4 or [r[0] for r in ranks] == [nodes[1]] * 4 + [nodes[0]] * 4
    for node in nodes:
        ids = sorted(g for n, gids in ranks for g in gids if n == node)
        assert len(ids) == 4 and len(set(ids)) == 4  # each rank its own GPU on its node
    assert [e[0] for e in gpu["engines"]] == [ranks[0][0], ranks[4][0]]
    assert [e[1] for e in gpu["engines"]] == [ranks[0][1], ranks[4][1]]  # sharing the rank's GPU


# ---- the simulated cluster (in the subprocess) ---------------------------------------------------------
def _config(out, name, *extra):
    from miles.config import parse_args
    from miles.preflight import validate_args

    return validate_args(parse_args([
        "--tiny-model", "--num-train-ranks", "4", "--num-rollout-engines", "2", "--colocate",
        "--stream-optimizer-state-to-disk", "--offload-train-target", "disk",
        "--offload-train-disk-dir", os.path.join(out, name), "--metrics-file", os.path.join(out, f"{name}.jsonl"),
        "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--micro-batch-size", "1", *extra]))


def _short_disk_run(out, victim):
    """The victim node's probe reports SHRUNK_FREE_BYTES; the run must stop before making train actors."""
    from miles.ray import actor_factory, node_disk
    from miles.train import RunError, run

    real_probe, real_make = node_disk.probe_nodes, actor_factory.make_train_actors
    made = []

    def probe(node_ids, path):
        probed = real_probe(node_ids, path)
        address, _, checked, memory = probed[victim]
        return {**probed, victim: (address, SHRUNK_FREE_BYTES, checked, memory)}

    def make(*args, **kwargs):
        made.append(args)
        return real_make(*args, **kwargs)

    node_disk.probe_nodes, actor_factory.make_train_actors = probe, make
    try:
        run(_config(out, "short"))
        error = None
    except RunError as e:
        error = str(e)
    finally:
        node_disk.probe_nodes, actor_factory.make_train_actors = real_probe, real_make
    return {"error": error, "train_actors_made": len(made)}


def _watch_markers(dirs, stop, found):
    from miles_plugins.host.ownership import CREATED_FILE, read_record

    while not stop.is_set():
        for d in dirs:
            record = read_record(os.path.join(d, CREATED_FILE))
            if record is not None:
                found.setdefault(d, {"pid": record.pid, "host": record.host})
        time.sleep(0.02)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _full_run(out):
    """A real run over the two CPU nodes, watching who makes the rank directories, with a file under the
    root that the run did not make."""
    from miles.ray.node_disk import per_rank_disk_bytes
    from miles.preflight.disk_budget import model_tensors_of_run
    from miles.train import run

    cfg = _config(out, "run")
    os.makedirs(cfg.paths.root)
    foreign = os.path.join(cfg.paths.root, "notes.txt")
    with open(foreign, "w") as f:
        f.write("not the run's")
    dirs = [cfg.paths.rank_dir(0, r) for r in range(cfg.cluster.num_train_ranks)]
    found, stop = {}, threading.Event()
    watcher = threading.Thread(target=_watch_markers, args=(dirs, stop, found), daemon=True)
    watcher.start()
    warnings = _Warnings()
    logging.getLogger("miles.train").addHandler(warnings)
    try:
        summary = run(cfg)
    finally:
        logging.getLogger("miles.train").removeHandler(warnings)
        stop.set()
        watcher.join()
    parents = [cfg.paths.trainer, cfg.paths.optimizer_state, cfg.paths.rollout]
    ranks = [{"rank": r, "pid": info["pid"], "node_id": info["node_id"], "rank_dir": dirs[r],
              "ranks_on_node": info["ranks_on_node"]}
             for r, info in enumerate(summary.train_ranks)]
    return {"train_ranks": ranks, "rollout_engines": [{"node_id": e["node_id"]} for e in summary.rollout_engines],
            "markers": found, "nodes": summary.nodes,
            "need_per_rank": per_rank_disk_bytes(cfg, model_tensors_of_run(cfg.model_source, None)),
            "left_after": [d for d in dirs if os.path.exists(d)],
            "node_sweeps": [dataclasses.asdict(n) for n in summary.node_sweeps],
            "root": cfg.paths.root, "parents_after": [d for d in parents if os.path.exists(d)],
            "foreign": foreign, "foreign_after": os.path.exists(foreign), "warnings": warnings.lines}


def _where_am_i():
    import ray

    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


def _gpu_layout(out):
    """GPU bundles: where each rank's and engine's share of its bundle is scheduled, and which GPU it gets."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from miles.ray import layout
    from miles.ray.placement_group import create_placement_group, rank_bundles, remove

    cfg = _config(out, "gpu", "--num-train-ranks", "8", "--rollout-batch-size", "4")
    pg, _, _ = create_placement_group(cfg, use_gpu=True, timeout_s=60)
    try:
        bundles = rank_bundles(pg, 8)
        probe = ray.remote(_where_am_i)

        def at(bundle, resources):
            return probe.options(num_cpus=resources["num_cpus"], num_gpus=resources["num_gpus"],
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     placement_group=pg, placement_group_bundle_index=bundle)).remote()

        ranks = ray.get([at(bundles[r], layout.train_actor_resources(cfg, True)) for r in range(8)])
        engines = ray.get([at(layout.rollout_engine_placement(cfg, e, bundles), layout.rollout_engine_resources(cfg, True))
                           for e in range(2)])
    finally:
        remove(pg)
    return {"ranks": ranks, "engines": engines}


def simulate(out):
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                      TOKENIZERS_PARALLELISM="false")
    import ray
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="rmn_", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    # Cluster writes the head's address to Ray's default temp folder whatever temp_dir says; on a machine
    # where no Ray has run yet that folder does not exist and the head fails to start
    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    small = {"object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": temp_dir, **small})
    try:
        cpu_nodes = [cluster.add_node(num_cpus=2, **small) for _ in range(2)]
        cluster.wait_for_nodes()
        facts = {"cpu_nodes": [n.node_id for n in cpu_nodes]}
        facts["short_disk"] = _short_disk_run(out, victim=cpu_nodes[1].node_id)
        facts["run"] = _full_run(out)
        gpu_nodes = [cluster.add_node(num_cpus=4, num_gpus=4, **small) for _ in range(2)]
        cluster.wait_for_nodes()
        facts["gpu_layout"] = {"nodes": [n.node_id for n in gpu_nodes], **_gpu_layout(out)}
    finally:
        ray.shutdown()
        cluster.shutdown()
    with open(os.path.join(out, "seen.json"), "w") as f:
        json.dump(facts, f)


if __name__ == "__main__":
    simulate(sys.argv[1])
