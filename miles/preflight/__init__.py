"""``miles train``'s checks before anything starts: the parsed flags judged against each other, the model folder,
this machine and its disks, into the run's one frozen :class:`~miles.config.RunConfig`.

    from miles.config import parse_args, ArgumentError
    from miles.preflight import validate_args
    cfg = validate_args(parse_args(argv))   # ArgumentError (a ValueError) names the flags and the fix

It sits above :mod:`miles.config` (the configuration itself, which imports none of this) and reads what the
checks need from the layers in between: the model folder rules (:mod:`miles.models`), the sizes of
:mod:`miles.sizing`, the prompt data, the sglang flags, the megatron backend's model types and machine needs.
The modules: :mod:`~miles.preflight.validation` (``validate_args``, the flag rules), :mod:`~miles.preflight.environment`
(the probes, :class:`Environment`), :mod:`~miles.preflight.model_checks`, :mod:`~miles.preflight.parallel_checks`,
:mod:`~miles.preflight.resource_checks` and :mod:`~miles.preflight.disk_budget` (what a rank writes to disk, also
asked by :mod:`miles.ray.node_disk` once Ray placed the ranks).
"""

from miles.preflight.environment import Environment  # noqa: F401
from miles.preflight.validation import validate_args  # noqa: F401
