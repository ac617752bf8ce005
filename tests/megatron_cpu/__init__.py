"""megatron-core 0.19.2's own code, runnable on CPU: the CPU megatron suite's harness (tests only).

The product's megatron backend runs released megatron-core, which assumes CUDA. To test that backend in CI
(CPU, Python 3.11, gloo), this harness

- downloads the pinned wheel from PyPI with ``pip download`` into the test cache (``~/.cache/miles-tests``, or
  ``$MILES_TEST_CACHE``; ``$MILES_TEST_MEGATRON_WHEEL`` names a downloaded copy instead), checks its sha256
  (obtain.py),
- unpacks it into a folder keyed by the wheel's hash and the patch file's hash, and applies the exact-text
  edits of patches.py, the one list of every change made to megatron's behaviour, each with its reason
  (CUDA device literals, CUDA streams, ``torch.cuda.*Tensor`` type checks, Triton-only imports, the Gated
  DeltaNet's l2norm from transformers' torch reference where fla's Triton kernel is missing, and the version
  label ``+cpu`` by which miles recognises a build that runs without CUDA),
- hands out that folder: any process with it on ``sys.path`` / ``PYTHONPATH`` imports the patched megatron
  (spawned ranks, Ray actors), with nothing patched at run time, and nothing of ``miles`` changed.

``megatron_path()`` is the entry point (the ``megatron_cpu`` fixture in tests/conftest.py). It never skips: a
failed download or a patch that no longer matches fails the tests that need it, with the reason.
"""

from .obtain import HarnessError, prepare

__all__ = ["HarnessError", "megatron_path"]


def megatron_path() -> str:
    """The folder holding the patched megatron-core (prepared on first use)."""
    return prepare()
