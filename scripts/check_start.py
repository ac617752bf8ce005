"""What `miles train` itself checks before it starts, on this node, with the launcher's flags: `miles train
--dry-run` leaves out what only a real start refuses (TP x PP > 1 without --experimental-model-parallel; a
machine without megatron-core or CUDA), which would stop the head after every node started Ray.

Usage (from a launcher, with the run's RAY_ADDRESS set): python scripts/check_start.py <miles train flags>;
exit 2 with one line on a refusal, 0 otherwise."""

import sys

from miles.config import ArgumentError, build_parser
from miles.preflight import validate_args

parser = build_parser(prog="miles train")
try:
    validate_args(parser.parse_args(sys.argv[1:]))
except ArgumentError as e:
    parser.exit(2, f"{parser.prog}: error: {e}\n")
