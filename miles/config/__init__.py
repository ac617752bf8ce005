"""Arguments of ``miles train``: config dataclasses, parser, validation.

    from miles.config import parse_args, validate_args, ArgumentError
    args = validate_args(parse_args(argv))   # raises ArgumentError (a ValueError) on bad combinations
"""

from miles.config.arguments import (  # noqa: F401
    CONFIG_GROUPS,
    MOMENT_DTYPES,
    CheckpointConfig,
    ClusterConfig,
    LoggingConfig,
    MilesConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    RolloutConfig,
    TrainingConfig,
    build_parser,
    config_from_args,
    default_args,
    flag_name,
    parse_args,
)
from miles.config.validation import ArgumentError, Environment, validate_args  # noqa: F401
