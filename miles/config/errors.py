"""The one error ``miles train``'s validation raises."""

from __future__ import annotations

__all__ = ["ArgumentError"]


class ArgumentError(ValueError):
    """One invalid argument combination: ``flags`` (the flags involved) and ``fix`` (what to do)."""

    def __init__(self, message: str, flags: tuple[str, ...] = (), fix: str = ""):
        self.flags = tuple(flags)
        self.fix = fix
        full = f"{message} Fix: {fix}" if fix else message
        super().__init__(full)
