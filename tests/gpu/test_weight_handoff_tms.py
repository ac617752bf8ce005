"""Weight buckets shared by CUDA IPC from a trainer process running under torch_memory_saver (skipped
without CUDA or torch_memory_saver): with TMS_INIT_ENABLE=1 every cudaMalloc is a virtual-memory mapping
that CUDA IPC cannot export, so the handoff allocates its buckets in ``bucket_allocation()``.

    python -m pytest -q tests/gpu/test_weight_handoff_tms.py
"""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("torch_memory_saver", reason="needs torch_memory_saver (pip install 'miles[gpu]')")

CHILD = r"""
import torch, torch.multiprocessing
try:  # as a megatron train rank does: this import sets torch_memory_saver's hook mode to "torch"
    import megatron.core.models.gpt.gpt_model  # noqa
except ImportError:
    pass
from multiprocessing.reduction import ForkingPickler
from miles.offload.tms import tms_active
from miles.weights.push import bucket_allocation
assert tms_active()
def shares(t):
    try:
        ForkingPickler.dumps(t)
        return "shared"
    except Exception as e:
        return "refused " + type(e).__name__
plain = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
say("plain:", shares(plain))
for _ in range(3):
    with bucket_allocation():
        flat = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        say("bucket:", shares(flat))
        del flat
"""


def _tms_env():
    from miles.ray.layout import tms_preload_library

    library = tms_preload_library()
    if library is None:
        pytest.skip("torch_memory_saver's preload hook is not installed")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {**os.environ, "LD_PRELOAD": library, "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1",
            "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_a_bucket_from_bucket_allocation_is_shareable_under_torch_memory_saver():
    out = subprocess.run([sys.executable, "-c", "say = print\n" + CHILD], env=_tms_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "plain: refused" in out.stdout  # what makes bucket_allocation necessary
    assert out.stdout.count("bucket: shared") == 3


def test_the_same_in_a_ray_train_actor_with_the_train_actors_environment(tmp_path):
    """What a colocated train rank does at its first handoff: the actor's environment as the actor factory
    builds it (the preload hook, TMS_INIT_ENABLE, disk backup)."""
    ray = pytest.importorskip("ray")
    from miles.config import parse_args
    from miles.preflight import validate_args
    from miles.ray import layout
    from miles.ray.actor_factory import base_env

    config = validate_args(parse_args(["--tiny-model", "--colocate", "--offload-train-target=disk",
                                       "--offload-train-plan", "offload-all",  # the one plan that pauses under TMS
                                       "--offload-train-disk-dir", str(tmp_path / "disk"),
                                       "--metrics-file", str(tmp_path / "m.jsonl")]))
    env = {**base_env(), **layout.rank_env(config, 0, 0, use_gpu=True, tms_library=layout.tms_preload_library())}
    os.makedirs(env.get("TMS_DISK_BACKUP_DIR", str(tmp_path)), exist_ok=True)

    @ray.remote(num_gpus=1)
    class Child:
        def run(self):
            lines: list = []
            exec(CHILD, {"say": lambda *words: lines.append(" ".join(map(str, words)))})
            return "\n".join(lines)

    ray.init(include_dashboard=False, num_cpus=2, num_gpus=1, object_store_memory=200 << 20,
             _temp_dir="/tmp/ray-tms-test")
    try:
        out = ray.get(Child.options(runtime_env={"env_vars": env}).remote().run.remote(), timeout=180)
    finally:
        ray.shutdown()
    assert out.count("bucket: shared") == 3, out
