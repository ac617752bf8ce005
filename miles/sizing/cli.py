"""`miles plan`: size a run (memory per rank, buckets, disk per node, step floor) before launching it.

    miles plan --preset qwen3.5-35b-a3b --nodes 1 --gpus-per-node 8 --ep 8
    miles plan --config path/to/config.json --nodes 8 --gpus-per-node 4 --tp 8 --pp 4 --ep 8 --json plan.json
    miles plan --params 1.5B --nodes 1 --gpus-per-node 1 --from-bench bench.json

`miles plan --help` lists every flag with its default. Also runs as `python -m miles.sizing.cli`.

A model the megatron backend builds is read through its family (``miles.backends.megatron_backend.families``), as
the trainer reads it: the plan sizes what the backend builds and refuses what it cannot build, in its words. Any
other model type is sized as transformers lays it out, for the torch backend (data parallel only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import stat
import sys
from typing import Callable, Optional

from miles.arg_parser import DefaultsHelpFormatter, SuggestingParser
from miles.parallel.layout import EP_FLAG, ETP_FLAG, FIRST_STAGE_FLAG, LAST_STAGE_FLAG, PP_FLAG, TP_FLAG
from miles_plugins.optimizers.streaming.config import DEFAULT_BUCKET_NUMEL, MOMENT_DTYPES

from .bounds import (BUCKET_NUMEL, CHECKPOINT_COPIES, HARDWARE, MAX_JSON_BYTES, PARALLEL_SIZE, PARAMS, PIPELINE_SIZE,
                     STAGE_LAYERS, TIMING, Bound, PlanInputError, check_bound, shown, shown_path)
from .inputs import GB, GRAD_BYTES, Hardware, SizingError, Training, short_decimal
from .model_params import model_tensors
from .presets import PRESET_NAMES, preset_arg, preset_config
from .sharding import DEFAULT_ETP, Parallelism
from .tensors import ModelConfigError, ModelTensors, flat_model

# The estimate and the report are imported once the arguments parsed: the store's codecs they plan with need
# torch (seconds to import), and a bad argument is refused before that.

COUNT_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """`1.5B`, `200M`, `4096` -> an integer count; ValueError when the text is not a finite count."""
    t = text.strip().upper().replace("_", "")
    scale = COUNT_SUFFIXES.get(t[-1:], 1)
    value = float(t[:-1] if scale > 1 else t) * scale
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not finite")
    return int(value)


def bounded(parse: Callable[[str], float], bound: Bound, example: str = "") -> Callable[[str], float]:
    """An argparse type: `parse` the text, then refuse a value outside `bound`, quoting the text as typed."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not {bound.describe()}{example}") from None
        if not bound.holds(value):
            raise argparse.ArgumentTypeError(f"{shown(text)}: must be {bound.describe()}{example}")
        return value
    return convert


def count_flag(bound: Bound) -> Callable[[str], int]:
    return bounded(parse_count, bound, " (e.g. 1.5B, 200M, 4096)")


def _hw_default(name: str):
    return next(f.default for f in dataclasses.fields(Hardware) if f.name == name)


def _hw_help(text: str, field: str) -> str:
    """A hardware flag's help with Hardware's default; a field whose default is None ("not given") says in
    its own help what happens then."""
    default = _hw_default(field)
    return text if default is None else f"{text} (default: {short_decimal(default)})"


class PlanArgumentParser(SuggestingParser):
    """Refuses a bad command line in one line (what was wrong, with which value), exit code 2, in the words of
    the planner's other refusals ("miles plan: ...")."""

    def one_line_error(self, message: str) -> str:
        return f"{self.prog}: {message} (see {self.prog} --help)"


def _add_layout_flags(p: argparse.ArgumentParser) -> None:
    lay = p.add_argument_group("parallel layout")
    size = bounded(int, PARALLEL_SIZE)
    # each size also under `miles train`'s (Megatron's) flag name, which the layout's messages use
    lay.add_argument("--tp", TP_FLAG, type=size, default=1, help="tensor parallel size")
    lay.add_argument("--pp", PP_FLAG, type=bounded(int, PIPELINE_SIZE), default=1, help="pipeline parallel size")
    lay.add_argument("--dp", type=size, default=None, help="data parallel size (default: GPUs / (TP x PP))")
    lay.add_argument("--ep", EP_FLAG, type=size, default=1, help="expert parallel size")
    lay.add_argument("--etp", ETP_FLAG, type=size, default=DEFAULT_ETP, help="expert tensor parallel size")
    for flag, which in ((FIRST_STAGE_FLAG, "first"), (LAST_STAGE_FLAG, "last")):
        lay.add_argument(flag, type=bounded(int, STAGE_LAYERS), default=None,
                         help=f"decoder layers of the {which} pipeline stage; the stages without a count split the "
                         "rest evenly (default: an even split, as miles train)")


def build_parser() -> argparse.ArgumentParser:
    p = PlanArgumentParser(prog="miles plan", description=__doc__.split("\n\n")[0],
                           formatter_class=DefaultsHelpFormatter)
    m = p.add_argument_group("model (one of)").add_mutually_exclusive_group(required=True)
    m.add_argument("--preset", type=preset_arg, metavar="NAME",
                   help=f"a named model, one of {', '.join(PRESET_NAMES)} (miles/sizing/presets.py says each one's "
                   "source; `miles bench rl --preset` takes the same names)")
    m.add_argument("--config", metavar="CONFIG_JSON", help="a transformers config.json")
    m.add_argument("--params", type=count_flag(PARAMS), help="just a parameter count (e.g. 1.5B): a dense stand-in")
    p.add_argument("--no-mtp", action="store_true", help="leave out multi-token-prediction layers (not trained)")

    _add_layout_flags(p)

    hw = p.add_argument_group("hardware (per node)")
    for flag, help_ in (
            ("nodes", "training nodes"), ("gpus-per-node", "training GPUs per node"),
            ("hbm-gb", "HBM per GPU, GB"), ("host-ram-gb", "host RAM per node, GB"),
            ("disk-read-gbps", "node-local disk read speed alone, GB/s"),
            ("disk-write-gbps", "node-local disk write speed alone, GB/s"),
            ("disk-combined-gbps", "read + write GB per second when both run at once (default: not known; "
                                   "when known, this decides the floor)"),
            ("disk-gb", "node-local disk capacity, GB (default: not checked)"),
            ("pcie-gbps", "host <-> GPU speed per direction, GB/s"),
            ("host-tier-gb", "host RAM per rank for hot buckets, GB"),
            ("device-budget-mb", "GPU memory a store may hold while it steps, MiB, as "
                                 "--stream-optimizer-state-device-budget-mb (default: the store's, what one bucket "
                                 f"of {short_decimal(DEFAULT_BUCKET_NUMEL / 1e6)}M elements needs)"),
            ("reserve-gb", "HBM kept for activations etc., GB (default: 10%% of HBM)")):
        field = flag.replace("-", "_")
        bound = HARDWARE[field]
        hw.add_argument(f"--{flag}", type=bounded(int if bound.integer else float, bound), default=None,
                        help=_hw_help(help_, field))
    hw.add_argument("--from-bench", metavar="FILE", help="take the disk speeds from `miles bench stream --json FILE` "
                    "(flags given explicitly win; default: the speeds above)")

    t = p.add_argument_group("training")
    t.add_argument("--moment-dtype", choices=MOMENT_DTYPES, default=Training.moment_dtype,
                   help="storage of the Adam moments in the streamed files")
    t.add_argument("--bucket-numel", type=count_flag(BUCKET_NUMEL), default=Training.bucket_numel,
                   help="elements per bucket, e.g. 62.5M, used as given: it must fit the device budget (default: "
                   f"let the store fit it to the device budget, at most {short_decimal(DEFAULT_BUCKET_NUMEL / 1e6)}M, "
                   "as the store does when --stream-optimizer-state-bucket-numel is not given)")
    t.add_argument("--grad-dtype", choices=sorted(GRAD_BYTES), default=Training.grad_dtype,
                   help="Megatron DDP grad buffer dtype")
    t.add_argument("--no-offload-train-to-disk", action="store_true",
                   help="the sleeping trainer's weights (and its optimizer state, when not streamed) do not go "
                   "to the disk during rollouts")
    t.add_argument("--checkpoint-copies", type=bounded(int, CHECKPOINT_COPIES), default=Training.checkpoint_copies,
                   help="saved copies of the streamed state on the node-local disk")
    p.add_argument("--json", metavar="FILE", help="also write the estimate as JSON ('-': to stdout, instead of the "
                   "table)")
    return p


class InputFileError(PlanInputError):
    """A --config or --from-bench file that cannot be read as a JSON document of a sane size."""


class BenchFileError(PlanInputError):
    """A --from-bench file without the timings the planner takes the disk speeds from."""


def read_json_file(flag: str, path: str, max_bytes: int = MAX_JSON_BYTES):
    """The JSON document in a regular file of at most `max_bytes`. Anything else (a device, a FIFO, a
    directory, a larger file, bytes that are not JSON) is refused, naming the flag and the path, without
    reading more than `max_bytes` + 1 bytes and without opening what is not a regular file."""
    where = f"{flag} {shown_path(path)}"
    try:
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode):
            raise InputFileError(f"{where}: not a regular file; pass the JSON file itself")
        # O_NONBLOCK: should a FIFO replace the file after the check, opening it does not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InputFileError(f"{where}: cannot read it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise InputFileError(f"{where}: changed while it was opened; pass a JSON file nothing else rewrites")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise InputFileError(f"{where}: cannot read it ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise InputFileError(f"{where}: larger than the {max_bytes >> 20} MiB a JSON file for the planner may hold")
    try:
        return json.loads(data)
    except RecursionError:
        raise InputFileError(f"{where}: not JSON the planner reads (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, bytes that are not text, numbers of too many digits
        raise InputFileError(f"{where}: not JSON ({shown(str(exc), 120)})") from None


def _positive_timing(results, path: str, section: str, key: str) -> float:
    try:
        value = results["floor"][section][key]
    except (KeyError, TypeError):
        raise BenchFileError(f"{path} has no floor.{section}.{key}: pass the --json output of a full "
                             "`miles bench stream` run (not --only-exposed)") from None
    check_bound(BenchFileError, f"{path}: floor.{section}.{key}", value, TIMING)
    return value


def disk_speeds_from_bench(results: dict, path: str = "the bench file") -> dict:
    """{disk_read_gbps, disk_write_gbps, disk_combined_gbps} from a `miles bench stream --json` result: the
    sequential floor times reads and writes separately, the concurrent floor both at once. Each timing must
    be a positive number and each speed within the range of its flag (BenchFileError naming both)."""
    def timing(section: str, key: str) -> float:
        return _positive_timing(results, path, section, key)

    speeds = {"disk_read_gbps": timing("sequential", "bytes_read") / timing("sequential", "read_seconds") / GB,
              "disk_write_gbps": timing("sequential", "bytes_written") / timing("sequential", "write_seconds") / GB,
              "disk_combined_gbps": (timing("concurrent", "bytes_read") + timing("concurrent", "bytes_written"))
              / timing("concurrent", "seconds") / GB}
    for name, speed in speeds.items():
        check_bound(BenchFileError, f"{path}: its timings give --{name.replace('_', '-')}", speed, HARDWARE[name])
    return speeds


def _model(args) -> ModelTensors:
    if args.params is not None:
        return flat_model(args.params, name=f"{args.params / 1e9:g}B params (dense stand-in)")
    if args.preset:
        config, name = preset_config(args.preset), args.preset
    else:
        config, name = read_json_file("--config", args.config), args.config
    return read_model(config, name, args, mtp=not args.no_mtp)


def read_model(config, name: str, args, mtp: bool) -> ModelTensors:
    """The tensors of a config.json's model: through its family where the megatron backend builds it (a config it
    refuses is refused here), else as transformers lays it out, which only a data-parallel layout trains."""
    from miles.backends.megatron_backend.families import (SUPPORTED_MODEL_TYPES, UnsupportedModelError,
                                                          count_tensors, read_config)

    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type in SUPPORTED_MODEL_TYPES:
        try:
            return count_tensors(read_config(config, name), name, tp=args.tp, mtp=mtp)
        except UnsupportedModelError as exc:
            raise ModelConfigError(f"{shown_path(name)}: {exc} (--train-backend megatron would refuse it too; "
                                   "--params sizes a parameter count without an architecture)") from None
    tensors = model_tensors(config, name, tp=args.tp, mtp=mtp)  # a config it cannot count is refused first
    what = f"model_type {shown(model_type)}" if model_type is not None else "a config without model_type"
    model_parallel = [f"--{flag} {value}" for flag, value in (("tp", args.tp), ("pp", args.pp), ("ep", args.ep))
                      if value > 1]
    if model_parallel:
        raise SizingError(f"{shown_path(name)}: {what} is not built by --train-backend megatron (it builds "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}), and {' '.join(model_parallel)} needs it: plan the "
                          "torch backend's data-parallel layout (--tp 1 --pp 1 --ep 1), or a model of those types")
    print(f"miles plan: note: {shown_path(name)}: {what} is not built by --train-backend megatron: sized as "
          "transformers lays it out (--train-backend torch trains it, data parallel only)", file=sys.stderr)
    return tensors


def _hardware(args) -> Hardware:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware) if getattr(args, f.name) is not None}
    if args.from_bench:
        bench = disk_speeds_from_bench(read_json_file("--from-bench", args.from_bench),
                                      f"--from-bench {shown_path(args.from_bench)}")
        given = bench | given
    return Hardware(**given)


def _gpu_flags(args, hw: Hardware) -> str:
    """`--nodes 1 (default) x --gpus-per-node 8`: the flags the GPU count comes from, and which were given."""
    flags = [f"--{name.replace('_', '-')} {getattr(hw, name)}" + ("" if getattr(args, name) is not None else
                                                                   " (default)")
             for name in ("nodes", "gpus_per_node")]
    return " x ".join(flags)


def data_parallel_size(args, hw: Hardware) -> int:
    """--dp, or the GPUs / (TP x PP) it defaults to; a layout that does not cover the GPUs exactly is
    refused naming the flags given and a change that makes it fit."""
    per_replica = args.tp * args.pp
    model_parallel = f"--tp {args.tp} x --pp {args.pp}"
    if args.dp is None:
        if hw.gpus % per_replica:
            raise SizingError(f"{model_parallel} = {per_replica} GPUs per model replica does not divide the "
                              f"{hw.gpus} GPUs of {_gpu_flags(args, hw)}: choose --tp and --pp whose product "
                              f"divides {hw.gpus}, or --nodes and --gpus-per-node that make a multiple of "
                              f"{per_replica} GPUs")
        return hw.gpus // per_replica
    if per_replica * args.dp != hw.gpus:
        raise SizingError(f"{model_parallel} x --dp {args.dp} = {per_replica * args.dp} GPUs, but "
                          f"{_gpu_flags(args, hw)} = {hw.gpus} GPUs: leave --dp out to derive it, or change --dp, "
                          "--tp/--pp or --nodes/--gpus-per-node so that the two agree")
    return args.dp


def plan_from_args(argv: list[str]):
    args = build_parser().parse_args(argv)
    hw = _hardware(args)
    dp = data_parallel_size(args, hw)
    par = Parallelism(tp=args.tp, pp=args.pp, dp=dp, ep=args.ep, etp=args.etp,
                      first_stage_layers=args.decoder_first_pipeline_num_layers,
                      last_stage_layers=args.decoder_last_pipeline_num_layers)
    training = Training(moment_dtype=args.moment_dtype, bucket_numel=args.bucket_numel, grad_dtype=args.grad_dtype,
                        offload_train_to_disk=not args.no_offload_train_to_disk,
                        checkpoint_copies=args.checkpoint_copies)
    model = _model(args)
    from .estimate import estimate

    return args, estimate(model, par, hw, training)


def _write_json(path: str, est) -> None:
    from .report import to_json

    try:
        with open(path, "w") as f:
            json.dump(to_json(est), f, indent=1)
    except OSError as exc:
        raise InputFileError(f"--json {shown_path(path)}: cannot write it ({exc.strerror})") from None


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args, est = plan_from_args(list(sys.argv[1:] if argv is None else argv))
        from .report import to_json, to_text

        if args.json == "-":
            print(json.dumps(to_json(est), indent=1))
            return 0
        print(to_text(est))
        if args.json:
            _write_json(args.json, est)
            print(f"wrote {args.json}")
    except PlanInputError as exc:
        print(f"miles plan: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
