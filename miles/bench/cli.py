"""`miles bench ...`: one subcommand per benchmark module. A module names itself (NAME, HELP), adds its
flags (add_arguments(parser)) and runs (run(args)); its first docstring paragraph is the description.
Each also runs alone (`python -m miles.bench.<name>`) through run_standalone."""

from __future__ import annotations

import sys

from miles.arg_parser import DefaultsHelpFormatter, SuggestingParser, unknown_arguments_message

from . import checkpoint, megatron, rl, stream
from .common import describe, run_checked

BENCHMARKS = (stream, checkpoint, megatron, rl)


def main(argv=None) -> int:
    parser = SuggestingParser(prog="miles bench", description="miles benchmarks")
    sub = parser.add_subparsers(title="benchmarks", dest="benchmark", parser_class=SuggestingParser,
                                metavar="{" + ",".join(m.NAME for m in BENCHMARKS) + "}")
    parsers = {}
    for module in BENCHMARKS:
        parsers[module.NAME] = sub.add_parser(module.NAME, help=module.HELP, description=describe(module),
                                              formatter_class=DefaultsHelpFormatter)
        module.add_arguments(parsers[module.NAME])
        parsers[module.NAME].set_defaults(func=module.run)
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if unknown:  # the benchmark's flags, not `miles bench`'s own, are what a typo was meant as
        bench = parsers.get(args.benchmark, parser)
        bench.error(unknown_arguments_message(unknown, bench.option_strings()))
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return run_checked(f"{parser.prog} {args.benchmark}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
