import os

import pytest

# Ray (e2e tests) stays on loopback and reports nothing; set before anything imports ray.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runs_entries() -> dict[str, set[str]]:
    dirs = {os.path.join(REPO, "runs"), os.path.abspath("runs")}
    return {d: set(os.listdir(d)) if os.path.isdir(d) else None for d in dirs}


@pytest.fixture(autouse=True)
def _no_runs_dir_in_the_working_tree():
    """Tests write only under pytest's tmp dirs: fail the test that makes a ``runs/`` entry appear in the
    repository or the working directory (a run's default output folder)."""
    before = _runs_entries()
    yield
    after = _runs_entries()
    for d, entries in after.items():
        new = (entries or set()) - (before.get(d) or set())
        if new or (entries is not None and before.get(d) is None):
            pytest.fail(f"the test wrote into {d}: {sorted(new) or '(created the folder)'}; pass --metrics-file / "
                        "--save under tmp_path")


@pytest.fixture()
def make_config(tmp_path):
    """``make_config("--tiny-model", ...)`` -> a validated RunConfig whose every path lies under tmp_path
    (no CUDA, no optional modules, so the model is the tiny one unless --hf-checkpoint)."""
    from miles.config import parse_args
    from miles.preflight import Environment, validate_args

    def make(*argv: str):
        argv = list(argv)
        if "--metrics-file" not in argv:
            argv += ["--metrics-file", str(tmp_path / "metrics.jsonl")]
        env = Environment(cuda_available=lambda: False, has_module=lambda m: False,
                          scratch_root=str(tmp_path / "scratch"), run_id="test")
        return validate_args(parse_args(argv), env)

    return make


@pytest.fixture(scope="session")
def megatron_cpu() -> str:
    """The folder of megatron-core 0.19.2 patched for CPU (tests/megatron_cpu), prepared once: put it first on a
    child's sys.path or PYTHONPATH. A failed download fails the test (CI has PyPI), never skips it."""
    from megatron_cpu import HarnessError, megatron_path

    try:
        return megatron_path()
    except HarnessError as e:
        pytest.fail(f"megatron-core for the CPU suite: {e}", pytrace=False)
