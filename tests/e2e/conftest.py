"""One local Ray cluster per test session (CPU, loopback only)."""

import os
import shutil
import tempfile

import pytest

# Set before Ray starts (and before its workers inherit the environment).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # bind 127.0.0.1: test traffic stays on loopback
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="rt_", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 1024 * 1024, _temp_dir=temp_dir,
             log_to_driver=True)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture()
def failing_backend(monkeypatch):
    """`--train-backend torch` builds tests/e2e/failing_backend.py's FailingTrainer in every train actor.

    The registry entry is resolved in the driver and imported inside the actor, whose PYTHONPATH the
    actor factory extends with the driver's (so the actor can import this test module)."""
    from miles.config import backends

    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setitem(backends.BACKENDS, "torch", "failing_backend:FailingTrainer")
    monkeypatch.setenv("PYTHONPATH", here + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
