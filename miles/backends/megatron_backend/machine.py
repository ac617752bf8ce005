"""What the megatron backend needs of the machine: CUDA, unless megatron-core is a build for CPU.

Released megatron-core assumes CUDA (``device="cuda"`` literals, CUDA streams and RNG state); a build made to run
on CPU says so with the local version label ``+cpu`` (``0.19.2+cpu``), as torch's CPU wheels do. Pure: both
validation (before Ray) and each train rank (its own process) ask it.
"""

from __future__ import annotations

from typing import Optional

from packaging.version import InvalidVersion, Version

__all__ = ["DISTRIBUTION", "runs_without_cuda", "needs_cuda_message"]

DISTRIBUTION = "megatron-core"
_CPU_LABEL = "cpu"


def runs_without_cuda(version: Optional[str]) -> bool:
    """Whether megatron-core of ``version`` (None: not installed) runs on a machine without CUDA."""
    if version is None:
        return False
    try:
        local = Version(version).local or ""
    except InvalidVersion:
        return False
    return _CPU_LABEL in local.split(".")


def needs_cuda_message(version: Optional[str]) -> str:
    """Why a process without CUDA cannot run the megatron backend with megatron-core ``version``."""
    installed = f"megatron-core {version}" if version else "megatron-core"
    return (f"--train-backend megatron needs CUDA: {installed} assumes a CUDA device (only a build for CPU, "
            f"version '+{_CPU_LABEL}', runs without one), and none is available")
