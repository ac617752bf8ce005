"""The configuration of ``miles train``: config dataclasses, parser, the validated RunConfig, the run's directory tree.

    from miles.config import parse_args, ArgumentError
    from miles.preflight import validate_args
    cfg = validate_args(parse_args(argv))   # a frozen RunConfig; ArgumentError (a ValueError) on bad input

The lowest layer of the framework: it imports only the argument parser (:mod:`miles.arg_parser`), the parallel
layout's arithmetic (:mod:`miles.parallel.layout`) and the store's config (its defaults, ``StreamConfig``). What judges a configuration against the model, the machine and the
disks (``validate_args``) is :mod:`miles.preflight`, above it.
"""

from miles.config.arguments import (  # noqa: F401
    CONFIG_GROUPS,
    MOMENT_DTYPES,
    CheckpointConfig,
    ClusterConfig,
    LoggingConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    RolloutConfig,
    TrainingConfig,
    build_parser,
    flag_name,
    parse_args,
)
from miles.config.paths import RunPaths  # noqa: F401
from miles.config.run_config import RunConfig, store_config  # noqa: F401
from miles.config.errors import ArgumentError  # noqa: F401
