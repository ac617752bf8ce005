"""The ``miles`` console script.

Subcommands come from :data:`SUBCOMMANDS`, a small table; an entry whose ``requires`` module cannot be
found at import time is not registered, so ``miles --help`` lists only what works. To add one, append
a line, e.g.::

    Subcommand("bench", "Benchmarks (e.g. `miles bench stream`).", "miles.bench.cli:main", requires="miles.bench"),

A handler is ``"module:function"``; the function receives the remaining argv (``list[str]``) and
returns an exit code (None means 0).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from miles.arg_parser import SuggestingParser

__all__ = ["Subcommand", "SUBCOMMANDS", "available_subcommands", "main", "train_main"]


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    handler: str  # "module:function", called with the remaining argv
    requires: Optional[str] = None  # module that must exist for the subcommand to be listed


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("train", "Train a policy with RL (see `miles train --help`).", "miles.cli:train_main"),
    Subcommand("bench", "Benchmarks (see `miles bench --help`).", "miles.bench.cli:main", requires="miles.bench"),
    Subcommand("plan", "Size a run before launching it: memory per rank, buckets, disk, step-time floor "
               "(see `miles plan --help`).", "miles.sizing.cli:main", requires="miles.sizing"),
)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def available_subcommands() -> list[Subcommand]:
    """The subcommands whose ``requires`` module exists (checked now)."""
    return [s for s in SUBCOMMANDS if s.requires is None or _module_exists(s.requires)]


def _resolve(handler: str) -> Callable[[list[str]], Optional[int]]:
    mod, _, fn = handler.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _top_parser(subs: Sequence[Subcommand]) -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="miles",
        description="miles: RL training whose optimizer state can stream through node-local disk.",
    )
    sp = parser.add_subparsers(title="subcommands", dest="command", metavar="{" + ",".join(s.name for s in subs) + "}")
    for s in subs:
        sp.add_parser(s.name, help=s.help, add_help=False)
    return parser


def train_main(argv: Sequence[str]) -> int:
    """``miles train``: parse, validate (one clear error, before anything starts), run ``miles.train.run``."""
    from miles.config import ArgumentError, build_parser
    from miles.logging_setup import configure_logging
    from miles.preflight import validate_args

    parser = build_parser(prog="miles train")
    args = parser.parse_args(list(argv))
    try:
        config = validate_args(args)
    except ArgumentError as e:  # one line: the message names the flags and the fix; the usage would bury it
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    configure_logging(config.logging.log_level)
    if config.cluster.dry_run:  # validated: flags, layout, placement, disk and memory here; nothing started
        from miles import checkpoint
        from miles.preflight import Environment
        from miles.preflight.parallel_checks import layout_summary

        print(layout_summary(config, Environment()))
        try:
            target = checkpoint.checked_resume_target(config)
        except checkpoint.CheckpointError as e:
            print(f"miles train --dry-run: --load: {e}", file=sys.stderr)
            return 1
        if target is not None:
            print(f"--load: resumes {target[0]} at rollout {target[1].get('next_rollout_id')}")
        if config.rollout.load_debug_rollout_data is not None:  # the rollouts the run would replay, as it reads them
            from miles.models import load_tokenizer, prepare_policy
            from miles.train import RunError, checked_replay

            try:
                checked_replay(config, prepare_policy(config), load_tokenizer(config), target)
            except RunError as e:
                print(f"miles train --dry-run: {e}", file=sys.stderr)
                return 1
            print("--load-debug-rollout-data: the recorded rollouts check out against the flags and the model")
        print("miles train --dry-run: the flags, the parallel layout, placement, disk, memory, the checkpoint to "
              "resume and the rollouts to replay check out on this machine; stopping before Ray and the actors start")
        return 0
    try:
        train_mod = importlib.import_module("miles.train")
    except ModuleNotFoundError as e:
        if e.name != "miles.train":
            raise
        print("miles train: the training loop (miles.train) is not part of this build", file=sys.stderr)
        return 1
    try:
        train_mod.run(config)
    except train_mod.RunError as e:  # the actor's traceback is already in the log: one line here
        print(f"miles train: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``miles`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    subs = available_subcommands()
    parser = _top_parser(subs)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    by_name = {s.name: s for s in subs}
    if argv[0] not in by_name:
        close = difflib.get_close_matches(argv[0], list(by_name), n=1)
        parser.error(f"unknown subcommand {argv[0]!r} (choose from {', '.join(by_name)})"
                     + (f"; did you mean {close[0]}?" if close else ""))  # exits 2
    ret = _resolve(by_name[argv[0]].handler)(argv[1:])
    return int(ret) if isinstance(ret, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
