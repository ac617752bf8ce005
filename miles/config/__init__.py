"""Arguments of ``miles train``: config dataclasses, parser, validation, the run's directory tree.

    from miles.config import parse_args, validate_args, ArgumentError
    cfg = validate_args(parse_args(argv))   # a frozen RunConfig; ArgumentError (a ValueError) on bad input
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
from miles.config.environment import Environment  # noqa: F401
from miles.config.errors import ArgumentError  # noqa: F401
from miles.config.validation import validate_args  # noqa: F401
