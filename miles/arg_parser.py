"""The command line's argument parsers: argparse with a one-line error that names the flag meant
(:class:`SuggestingParser`) and help that states each default once (:class:`DefaultsHelpFormatter`).

Shared by ``miles train`` (miles/config/arguments.py), ``miles plan`` and ``miles bench``; it imports nothing
of miles, so parsing and its errors come before any heavy import."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn, Optional, Sequence

__all__ = ["DefaultsHelpFormatter", "SuggestingParser", "unknown_arguments_message", "unknown_flags"]


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that states each flag's default once, for the subcommands that build their own parsers.

    ``(default: X)`` is appended unless the help already says what the default is (it mentions
    "default"), and never for a default that means "not given" (None, an empty list) or a switch that
    is off: "(default: None)" after a help that explains the unset case would contradict it."""

    def _get_help_string(self, action: argparse.Action) -> str:  # argparse's extension point for this
        text = action.help or ""
        default = action.default
        unset = default is None or default is argparse.SUPPRESS or isinstance(default, bool) or default == []
        if not text or not action.option_strings or unset or "default" in text.lower():
            return text
        return text + " (default: %(default)s)"


# argparse's messages for a missing required argument (its only handle on them is the text)
_MISSING_REQUIRED = ("the following arguments are required", "one of the arguments")


class SuggestingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error is one line and a pointer to ``--help`` (argparse's usage, 48 lines for
    ``miles train``, would bury it), whose unknown-flag error suggests the closest known flag, and which names
    an unknown flag before a required argument it reports missing: the one was likely meant as the other
    (``--dri /x`` for ``--dir /x``)."""

    _given: Sequence[str] = ()

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102 - argparse's contract
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's contract
        ns, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unknown_arguments_message(unknown, self.option_strings()))
        return ns

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse's contract
        unknown = unknown_flags(self._given, self.option_strings(), self.allow_abbrev)
        if unknown and message.startswith(_MISSING_REQUIRED):
            message = unknown_arguments_message(unknown, self.option_strings())
        self.exit(2, self.one_line_error(message) + "\n")

    def one_line_error(self, message: str) -> str:
        return f"{self.prog}: error: {message} (see {self.prog} --help)"

    def option_strings(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings]


def unknown_flags(argv: Sequence[str], known: Sequence[str], allow_abbrev: bool = False) -> list[str]:
    """The long flags in ``argv`` (``--name`` or ``--name=value``, before a lone ``--``) that are none of
    ``known``, nor, where abbreviations are allowed, the start of one."""
    unknown = []
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if not name.startswith("--") or len(name) < 3 or " " in token or name in known:
            continue
        if not (allow_abbrev and any(flag.startswith(name) for flag in known)):
            unknown.append(token)
    return unknown


_LISTED_COMPLETIONS = 8


def _flag_hint(name: str, known: Sequence[str]) -> Optional[str]:
    """What ``name`` was probably meant as. A truncated flag (the start of known flags) names the main one of
    them and lists them all; the main one is the flag the others extend (``--sav`` -> ``--save``, not
    ``--save-interval``), else the first declared, which leads its group (``--stream-optimizer-state`` ->
    ``--stream-optimizer-state-to-disk``). Otherwise the closest spelling."""
    completions = [flag for flag in known if flag.startswith(name)] if len(name) > 2 else []
    if len(completions) > 1:
        extended_by = {flag: sum(other.startswith(flag + "-") for other in completions) for flag in completions}
        main = max(completions, key=lambda flag: extended_by[flag])  # the first declared among equals
        completions = [main] + [flag for flag in completions if flag != main]
    if len(completions) == 1:
        return f"{name}: did you mean {completions[0]}?"
    if completions:
        listed = ", ".join(completions[:_LISTED_COMPLETIONS])
        more = f", ... ({len(completions)} in all)" if len(completions) > _LISTED_COMPLETIONS else ""
        return f"{name}: did you mean {completions[0]}? {name} starts several flags: {listed}{more}"
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name}: did you mean {close[0]}?" if close else None


def unknown_arguments_message(unknown: Sequence[str], known: Sequence[str]) -> str:
    """``unrecognized arguments: --eps-clp 0 (--eps-clp: did you mean --eps-clip?)`` (flags only; ``--x=v``
    is matched by its name)."""
    hints = [hint for token in unknown if token.startswith("-")
             for hint in [_flag_hint(token.split("=", 1)[0], known)] if hint]
    message = "unrecognized arguments: " + " ".join(unknown)
    return message + (" (" + "; ".join(hints) + ")" if hints else "")
