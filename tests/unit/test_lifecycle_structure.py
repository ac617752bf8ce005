"""The run's lifecycle beside its loop: miles/train.py is the loop and its setup, miles/run_lifecycle.py the
root lock, signals and teardown, and what the run did is one typed RunState (what `miles.train.run`
returns). The backend registry is pure data beside the config types: reading it imports no torch."""

import ast
import dataclasses
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_loop_module_holds_no_root_lock_signal_handler_or_sweep():
    imported = _imported_modules(REPO / "miles/train.py")
    lifecycle = {"signal", "threading", "miles.ray.node_sweep", "miles_plugins.host.ownership",
                 "miles.weights.transport"}
    assert not imported & lifecycle, f"miles/train.py imports {sorted(imported & lifecycle)}: that is " \
                                     "miles/run_lifecycle.py's part"


def test_run_returns_the_state_the_loop_wrote(make_config, tmp_path, monkeypatch):
    import miles.train as train
    from miles.run_lifecycle import RunState

    cfg = make_config("--tiny-model", "--offload-train-disk-dir", str(tmp_path / "root"))

    def body(config, stop, state):
        state.records.append({"rollout_id": 0})
        state.start_rollout = 0
        return state

    monkeypatch.setattr(train, "_run_holding_root", body)
    state = train.run(cfg)
    assert isinstance(state, RunState)
    assert state.records == [{"rollout_id": 0}] and state.checkpoints == [] and state.latest_checkpoint is None
    assert (state.run_dir, state.metrics_file) == (cfg.paths.run_dir, cfg.logging.metrics_file)


def test_every_field_of_the_run_state_is_typed_and_starts_empty():
    from miles.run_lifecycle import RunState

    fields = dataclasses.fields(RunState)
    assert all(f.type and f.type != "Any" for f in fields)
    state = RunState(run_dir="/run", metrics_file="/run/metrics.jsonl")
    other = RunState(run_dir="/run", metrics_file="/run/metrics.jsonl")
    state.records.append({"rollout_id": 0})
    assert other.records == [], "two runs share no list"


def test_the_interrupted_line_names_the_loaded_checkpoint_when_none_was_saved():
    import signal

    from miles.run_lifecycle import RunState, interrupted_line

    state = RunState(run_dir="/run", metrics_file="/run/metrics.jsonl", loaded_checkpoint="/ck/rollout_000004")
    assert interrupted_line(signal.SIGTERM, state, 0).endswith(
        "removed 0 directories, checkpoint /ck/rollout_000004 is the last complete one")


def _modules_after(statement: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{statement}; import sys; print('\\n'.join(sys.modules))"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         check=True)
    return set(out.stdout.split())


def test_the_driver_reads_the_backend_registry_without_importing_torch_or_the_store():
    for statement in ("import miles.config.backends", "import miles.ray.actor_factory"):
        loaded = _modules_after(statement)
        assert "torch" not in loaded, f"`{statement}` imports torch"
        assert "miles_plugins.optimizers.nvme_stream" not in loaded, f"`{statement}` imports the store"
        assert "miles.backends.rank" not in loaded, f"`{statement}` imports the train rank"


def test_every_train_backend_choice_names_a_registered_backend():
    from miles.config import build_parser
    from miles.config.backends import BACKENDS

    (action,) = [a for a in build_parser()._actions if a.dest == "train_backend"]
    assert set(action.choices) == set(BACKENDS)
    assert all(spec.count(":") == 1 and spec.startswith("miles.backends.") for spec in BACKENDS.values())


def test_the_registry_resolves_to_the_torch_trainer():
    from miles.backends.rank import TrainRank, resolve_backend
    from miles.config.backends import BACKENDS

    cls = resolve_backend(BACKENDS["torch"])
    assert issubclass(cls, TrainRank) and cls.__name__ == "TorchTrainer"
