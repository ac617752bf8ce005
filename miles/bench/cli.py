"""`miles bench ...`: one subcommand per benchmark module (each has add_parser(subparsers) and run(args))."""

from __future__ import annotations

import argparse
import sys

from . import checkpoint, stream

BENCHMARKS = (stream, checkpoint)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="miles bench", description="miles benchmarks")
    sub = parser.add_subparsers(title="benchmarks", dest="benchmark", metavar="{stream,checkpoint}")
    for module in BENCHMARKS:
        module.add_parser(sub)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
