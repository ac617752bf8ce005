"""`miles plan`: size a run (memory per rank, buckets, disk per node, step floor) before launching it.

    miles plan --preset qwen3.5-35b-a3b --nodes 1 --gpus-per-node 8 --ep 8
    miles plan --config path/to/config.json --nodes 8 --gpus-per-node 4 --tp 8 --pp 4 --ep 8 --json plan.json
    miles plan --params 1.5B --nodes 1 --gpus-per-node 1 --from-bench bench.json

Defaults of the hardware and training knobs live in `estimate.Hardware` / `estimate.Training`.
Also runs as `python -m miles.sizing.cli`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional

from miles_plugins.optimizers.streaming.config import MOMENT_DTYPES

from .estimate import GB, GRAD_BYTES, Hardware, SizingError, Training, estimate
from .model_params import ModelConfigError, ModelTensors, flat_model, model_tensors
from .presets import PRESETS, preset_config
from .report import to_json, to_text
from .sharding import DEFAULT_ETP, LayoutError, Parallelism


def parse_count(text: str) -> int:
    """`1.5B`, `200M`, `4096` -> an integer count."""
    t = text.strip().upper().replace("_", "")
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 1.5B, 200M, 4096)") from None


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give decoder layers per stage, e.g. 21,19,19,19") from None


def _hw_default(name: str):
    return next(f.default for f in dataclasses.fields(Hardware) if f.name == name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model (one of)").add_mutually_exclusive_group(required=True)
    m.add_argument("--preset", choices=sorted(PRESETS), help="a named model (miles/sizing/presets.py says its source)")
    m.add_argument("--config", metavar="CONFIG_JSON", help="a transformers config.json")
    m.add_argument("--params", type=parse_count, help="just a parameter count (e.g. 1.5B): a dense stand-in")
    p.add_argument("--no-mtp", action="store_true", help="leave out multi-token-prediction layers (not trained)")

    lay = p.add_argument_group("parallel layout")
    lay.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    lay.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    lay.add_argument("--dp", type=int, default=None, help="data parallel size (default: GPUs / (TP x PP))")
    lay.add_argument("--ep", type=int, default=1, help="expert parallel size")
    lay.add_argument("--etp", type=int, default=DEFAULT_ETP, help="expert tensor parallel size")
    lay.add_argument("--pipeline-layers", type=_layers, default=None,
                     help="decoder layers per pipeline stage, e.g. 21,19,19,19 (default: even split)")

    hw = p.add_argument_group("hardware (per node; defaults: estimate.Hardware)")
    for flag, kind, help_ in (
            ("nodes", int, "training nodes"), ("gpus-per-node", int, "training GPUs per node"),
            ("hbm-gb", float, "HBM per GPU, GB"), ("host-ram-gb", float, "host RAM per node, GB"),
            ("disk-read-gbps", float, "node-local disk read speed alone, GB/s"),
            ("disk-write-gbps", float, "node-local disk write speed alone, GB/s"),
            ("disk-combined-gbps", float, "read + write bytes per second when both run at once (when "
                                          "known, this decides the floor)"),
            ("disk-gb", float, "node-local disk capacity, GB (checked when given)"),
            ("pcie-gbps", float, "host <-> GPU speed per direction, GB/s"),
            ("host-tier-gb", float, "host RAM per rank for hot buckets, GB"),
            ("device-budget-mb", float, "GPU bytes the stores may hold, MB (default: what their depth holds)"),
            ("reserve-gb", float, "HBM kept for activations etc., GB (default: 10%% of HBM)")):
        hw.add_argument(f"--{flag}", type=kind, default=None, help=f"{help_} [{_hw_default(flag.replace('-', '_'))}]")
    hw.add_argument("--from-bench", metavar="FILE", help="take the disk speeds from `miles bench stream --json FILE` "
                    "(flags given explicitly win)")

    t = p.add_argument_group("training")
    t.add_argument("--moment-dtype", choices=MOMENT_DTYPES, default=Training.moment_dtype,
                   help="storage of the Adam moments in the streamed files")
    t.add_argument("--bucket-numel", type=parse_count, default=Training.bucket_numel, help="elements per bucket")
    t.add_argument("--grad-dtype", choices=sorted(GRAD_BYTES), default=Training.grad_dtype,
                   help="Megatron DDP grad buffer dtype")
    t.add_argument("--no-offload-train-to-disk", action="store_true",
                   help="the trainer's weights and grads do not go to the disk during rollouts")
    t.add_argument("--checkpoint-copies", type=int, default=Training.checkpoint_copies,
                   help="saved copies of the streamed state on the node-local disk")
    p.add_argument("--json", metavar="FILE", help="write the estimate as JSON ('-': stdout, instead of the table)")
    return p


class BenchFileError(ValueError):
    pass


def disk_speeds_from_bench(results: dict, path: str = "the bench file") -> dict:
    """{disk_read_gbps, disk_write_gbps, disk_combined_gbps} from a `miles bench stream --json` result: the
    sequential floor times reads and writes separately, the concurrent floor both at once."""
    try:
        seq, conc = results["floor"]["sequential"], results["floor"]["concurrent"]
        return {"disk_read_gbps": seq["bytes_read"] / seq["read_seconds"] / GB,
                "disk_write_gbps": seq["bytes_written"] / seq["write_seconds"] / GB,
                "disk_combined_gbps": (conc["bytes_read"] + conc["bytes_written"]) / conc["seconds"] / GB}
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise BenchFileError(f"{path} has no usable floor.sequential / floor.concurrent timings ({exc!r}): pass "
                             "the --json output of a full `miles bench stream` run (not --only-exposed)") from None


def _model(args) -> ModelTensors:
    if args.params is not None:
        return flat_model(args.params, name=f"{args.params / 1e9:g}B params (dense stand-in)")
    if args.preset:
        config, name = preset_config(args.preset), args.preset
    else:
        with open(args.config) as f:
            config, name = json.load(f), args.config
    return model_tensors(config, name, tp=args.tp, mtp=not args.no_mtp)


def _hardware(args) -> Hardware:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Hardware) if getattr(args, f.name) is not None}
    if args.from_bench:
        with open(args.from_bench) as f:
            bench = disk_speeds_from_bench(json.load(f), args.from_bench)
        given = bench | given
    return Hardware(**given)


def plan_from_args(argv: list[str]):
    args = build_parser().parse_args(argv)
    hw = _hardware(args)
    dp = args.dp if args.dp is not None else max(hw.gpus // (args.tp * args.pp), 1)
    par = Parallelism(tp=args.tp, pp=args.pp, dp=dp, ep=args.ep, etp=args.etp, pipeline_layers=args.pipeline_layers)
    training = Training(moment_dtype=args.moment_dtype, bucket_numel=args.bucket_numel, grad_dtype=args.grad_dtype,
                        offload_train_to_disk=not args.no_offload_train_to_disk,
                        checkpoint_copies=args.checkpoint_copies)
    return args, estimate(_model(args), par, hw, training)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args, est = plan_from_args(list(sys.argv[1:] if argv is None else argv))
    except (SizingError, LayoutError, ModelConfigError, BenchFileError, KeyError, OSError) as exc:
        print(f"miles plan: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(to_json(est), indent=1))
        return 0
    print(to_text(est))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(est), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
