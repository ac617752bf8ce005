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
import tempfile
import time
from decimal import Decimal, InvalidOperation

import torch

from miles.arg_parser import DefaultsHelpFormatter, SuggestingParser
from miles_plugins.optimizers.streaming.units import GB


def parse_count(text: str) -> int:
    return int(parse_count_exactly(text))


def count_text(count: int) -> str:
    """A count as :func:`parse_count` reads it back, to 3 digits: ``1.5B``, ``450M``, ``12K``, ``7``, ``1e+15``."""
    if count >= 10**12:
        return f"{count:.3g}"
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


def free_memory(device: torch.device) -> int | None:
    """Bytes a bench may still allocate on ``device``: the CUDA device's free memory; on cpu what this process
    can still take of the host's (the store's own reading: MemAvailable, less under a cgroup limit). None
    where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from miles_plugins.host.memory import available_host_memory

    return available_host_memory()


def refuse_count_beyond(flag: str, count: int, bytes_each: float, available: int | None, where: str,
                        what: str) -> None:
    """Refuse a count before anything is allocated or written (ArgumentError: one line, exit 2) when
    ``count x bytes_each`` is more than the ``available`` bytes (None: unknown, not refused) of ``where``;
    ``what`` says what the bytes are. The fix names the largest count that fits."""
    from miles.config.errors import ArgumentError

    needed = count * bytes_each
    if available is not None and needed > available:
        raise ArgumentError(f"{flag} {count_text(count)} needs about {needed / GB:,.1f} GB of {where} ({what}), but "
                            f"this machine has {available / GB:,.1f} GB free there.", (flag,),
                            f"give at most about {flag} {count_text(int(available // bytes_each))} here.")


def number_arg(kind, what: str, low: float = 0.0, inclusive: bool = False, high: float | None = None):
    """An argparse type: a finite number > low (>= low when inclusive) and <= high; the error says what
    to give."""

    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give {what}") from None
        ok = math.isfinite(value) and (value >= low if inclusive else value > low)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, got {text}; give {what}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}; give {what}")
        return value

    return parse


def count_arg(what: str, minimum: int, why: str):
    """An argparse type: a whole count (``100M``, ``1.5B``, ``2000000``: :func:`parse_count`'s spellings) of at least
    ``minimum``; the error says which of the two it is not, and ``why`` the minimum is what it is."""
    parse_number = number_arg(parse_count_exactly, what)

    def parse(text: str) -> int:
        value = parse_number(text)  # a finite number > 0, or the error that says it is not one
        if value != value.to_integral_value():
            raise argparse.ArgumentTypeError(f"{text} is not a whole number; give {what}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is less than {count_text(minimum)} ({why}); give {what}")
        return int(value)

    return parse


def parse_count_exactly(text: str) -> Decimal:
    """:func:`parse_count`'s value before it is cut to a whole number, exact (``1.5`` stays 1.5, ``1.1B`` is
    1100000000); ValueError when it is not a number, OverflowError beyond a float."""
    text = text.strip().upper().replace("_", "")
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    try:
        value = Decimal(text[:-1] if scale > 1 else text) * scale
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a number") from None
    if not value.is_finite():
        raise ValueError(f"{text!r} is not a finite number")
    if math.isinf(float(value)):
        raise OverflowError(f"{text!r} is beyond a float")
    return value


MAX_FWD_BWD_SECONDS = 600.0  # a synthetic forward/backward stands for one step's compute, not a wait


def fractions_arg(text: str) -> list[float]:
    """An argparse type: a comma-separated list of fractions, each within [0, 1]."""
    parse = number_arg(float, "fractions within [0, 1], e.g. 0.5,0.75", inclusive=True, high=1.0)
    values = [parse(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} holds no fraction; give fractions within [0, 1], e.g. 0.5,0.75")
    return values


def device_arg(text: str) -> torch.device:
    """An argparse type: ``cpu`` or ``cuda[:N]`` (whether this machine has it is :func:`one_device`'s check,
    at run time, so that a command line written for a GPU host still parses elsewhere)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text} is not supported; use cpu or cuda")
    return device


def dir_arg(text: str) -> str:
    """An argparse type: the absolute path of a directory the bench may create files in, existing or to be
    made, outside the system's trees (/proc, /sys, /dev, ...). Nothing is created here."""
    from miles_plugins.host.ownership import system_directory_reason

    path = os.path.abspath(text)
    for candidate in dict.fromkeys((path, os.path.realpath(path))):
        reason = system_directory_reason(candidate, home="")
        if reason is not None:
            raise argparse.ArgumentTypeError(f"{text} cannot hold a bench's files: {candidate} {reason}; give a "
                                             "directory on the disk under test")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} exists and is not a directory; give a directory (it is created "
                                         "when missing)")
    existing = path
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
        if os.path.lexists(existing) and not os.path.isdir(existing):
            raise argparse.ArgumentTypeError(f"{path}: {existing} is not a directory; give a directory path")
    try:
        with tempfile.TemporaryFile(dir=existing):  # permission bits lie for root and on read-only mounts
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot create files in {existing} ({e.strerror or e}); give a "
                                         "writable directory") from None
    return path


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
    """The device the bench runs on, refused (ArgumentError, before anything is created) when this machine
    has no such device; `cuda` as the current CUDA device by index, so that memory stats and the name are
    of that one."""
    from miles.config.errors import ArgumentError

    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(f"--device {device}, but torch sees no CUDA device on this machine.", ("--device",),
                                "use --device cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ArgumentError(f"--device {device}, but this machine has {torch.cuda.device_count()} CUDA "
                                "device(s).", ("--device",), "give an index below that, or cuda.")
        if device.index is None:
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
    parser = SuggestingParser(prog=f"miles bench {module.NAME}", description=describe(module),
                              formatter_class=DefaultsHelpFormatter)
    module.add_arguments(parser)
    return run_checked(parser.prog, module.run, parser.parse_args(sys.argv[1:] if argv is None else list(argv)))


def run_checked(prog: str, run, args) -> int:
    """Run a benchmark; a value its own checks refuse (an ArgumentError, raised before it creates anything)
    ends it as argparse ends a bad flag: one line, exit 2."""
    from miles.config.errors import ArgumentError

    try:
        return int(run(args) or 0)
    except ArgumentError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
