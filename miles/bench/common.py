"""Helpers every benchmark shares: counts, medians, progress lines, a synthetic forward/backward, and
the standalone entry point. The benchmark modules import this one and nothing of each other's."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from miles.cli import DefaultsHelpFormatter


def parse_count(text: str) -> int:
    text = text.strip().upper().replace("_", "")
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


class Progress:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FwdBwd:
    """A synthetic forward/backward of a given length: bf16 matmuls on CUDA, or sleep."""

    def __init__(self, device: torch.device, kind: str):
        self.device = device
        self.kind = ("matmul" if device.type == "cuda" else "sleep") if kind == "auto" else kind
        if self.kind == "matmul":
            dt = torch.bfloat16 if device.type == "cuda" else torch.float32
            n = 8192 if device.type == "cuda" else 1024
            self.a = torch.randn(n, n, device=device, dtype=dt)
            self.b = torch.randn(n, n, device=device, dtype=dt)

    def __call__(self, seconds: float) -> float:
        t0 = time.perf_counter()
        if self.kind == "sleep":
            time.sleep(seconds)
        else:
            while time.perf_counter() - t0 < seconds:
                for _ in range(8):
                    self.a @ self.b
                sync_device(self.device)
        return time.perf_counter() - t0


def describe(module) -> str:
    return module.__doc__.split("\n\n")[0]


def run_standalone(module, argv=None) -> int:
    """`python -m miles.bench.<name> ...`: the module's own flags, then its run."""
    parser = argparse.ArgumentParser(prog=f"miles bench {module.NAME}", description=describe(module),
                                     formatter_class=DefaultsHelpFormatter)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(sys.argv[1:] if argv is None else list(argv))) or 0)
