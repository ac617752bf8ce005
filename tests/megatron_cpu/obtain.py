"""Obtain megatron-core 0.19.2 for the CPU suite: the pinned wheel from PyPI (``pip download``, checked by its
sha256), unpacked and edited by :mod:`patches` into a folder of the test cache that any process can import
with that folder on ``sys.path`` / ``PYTHONPATH`` (spawned ranks, Ray actors): no monkeypatching at run time.

The folder's name carries the wheel's hash and the patch file's hash, so a changed patch list builds a new
copy. Two processes preparing at once each build in a temporary folder beside it and rename it into place;
the loser drops its copy. Nothing here skips: a download that fails raises :class:`HarnessError` with pip's
output, and the tests that need megatron fail with it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from . import patches

VERSION = "0.19.2"
# pure Python but for one dataset helper (.so) the suite never imports; the cp312 build, as the GPU host runs
WHEEL = f"megatron_core-{VERSION}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5"
WHEEL_ENV = "MILES_TEST_MEGATRON_WHEEL"  # a pre-downloaded copy of WHEEL (its hash is checked all the same)
CACHE_ENV = "MILES_TEST_CACHE"  # default ~/.cache/miles-tests


class HarnessError(RuntimeError):
    """The pinned megatron-core could not be obtained or patched (the message says which step and why)."""


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "miles-tests")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checked(path: str) -> str:
    digest = _sha256(path)
    if digest != WHEEL_SHA256:
        raise HarnessError(f"{path}: sha256 {digest}, expected {WHEEL_SHA256} (megatron-core {VERSION}, {WHEEL}); "
                           "delete the file so that it is downloaded again")
    return path


def _download(wheels: str) -> str:
    """The wheel in ``wheels``, downloaded with pip unless it is there already (checked either way)."""
    given = os.environ.get(WHEEL_ENV)
    if given:
        return _checked(given)
    target = os.path.join(wheels, WHEEL)
    if os.path.isfile(target):
        return _checked(target)
    os.makedirs(wheels, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".download-", dir=wheels)
    try:
        cmd = [sys.executable, "-m", "pip", "download", f"megatron-core=={VERSION}", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
               "--disable-pip-version-check", "-d", scratch]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        got = os.path.join(scratch, WHEEL)
        if done.returncode != 0 or not os.path.isfile(got):
            raise HarnessError(f"could not download megatron-core {VERSION} ({' '.join(cmd)} exited "
                               f"{done.returncode}; set {WHEEL_ENV} to a downloaded {WHEEL} to use a copy):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        _checked(got)
        os.replace(got, target)  # atomic: a concurrent download writes the same bytes
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _patch_file_digest() -> str:
    with open(patches.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def prepare() -> str:
    """The folder holding the patched ``megatron`` package (built on first use); put it on ``sys.path``."""
    root = cache_root()
    final = os.path.join(root, f"megatron-core-{VERSION}-{WHEEL_SHA256[:12]}-{_patch_file_digest()[:12]}")
    if os.path.isdir(os.path.join(final, "megatron", "core")):
        return final
    wheel = _download(os.path.join(root, "wheels"))
    build = tempfile.mkdtemp(prefix=".build-", dir=root)
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(build)
        try:
            patches.apply(build)
        except ValueError as e:
            raise HarnessError(str(e)) from None
        try:
            os.rename(build, final)
        except OSError:  # another process renamed its copy first: the same bytes
            if not os.path.isdir(os.path.join(final, "megatron", "core")):
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return final
