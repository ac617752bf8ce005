"""Helpers every benchmark shares: counts, medians, progress lines, the device and machine a run reports,
a synthetic forward/backward, the JSON results file, and the standalone entry point. The benchmark modules
import this one and nothing of each other's."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time

import torch

from miles.cli import DefaultsHelpFormatter


def parse_count(text: str) -> int:
    text = text.strip().upper().replace("_", "")
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def number_arg(kind, what: str, low: float = 0.0, inclusive: bool = False):
    """An argparse type: a finite number > low (>= low when inclusive); the error says what to give."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {what}") from None
        ok = math.isfinite(value) and (value >= low if inclusive else value > low)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, got {text}; give {what}")
        return value

    return parse


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


class Progress:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)


def log_store_lines(quiet: bool) -> None:
    """The store's own INFO lines (per step, per save) beside the bench's, unless --quiet."""
    if not quiet:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def one_device(device: torch.device) -> torch.device:
    """`cuda` as the current CUDA device by index, so that memory stats and the name are of that one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def machine(device: torch.device) -> dict:
    """What the results were measured on."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "cpus": os.cpu_count()}


def write_json(path: str | None, results: dict, say) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
        say(f"wrote {path}")


def tree_file_bytes(root: str) -> int:
    """Total size of the regular files under ``root``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


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
