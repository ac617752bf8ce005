"""`miles bench ...`: one subcommand per benchmark module. A module names itself (NAME, HELP), adds its
flags (add_arguments(parser)) and runs (run(args)); its first docstring paragraph is the description.
Each also runs alone (`python -m miles.bench.<name>`) through run_standalone."""

from __future__ import annotations

import argparse
import sys

from miles.cli import DefaultsHelpFormatter

from . import checkpoint, megatron, rl, stream
from .common import describe, run_checked

BENCHMARKS = (stream, checkpoint, megatron, rl)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="miles bench", description="miles benchmarks")
    sub = parser.add_subparsers(title="benchmarks", dest="benchmark",
                                metavar="{" + ",".join(m.NAME for m in BENCHMARKS) + "}")
    for module in BENCHMARKS:
        p = sub.add_parser(module.NAME, help=module.HELP, description=describe(module),
                           formatter_class=DefaultsHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return run_checked(f"{parser.prog} {args.benchmark}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
